"""A fault-injecting HTTP proxy in front of the tests' S3 endpoint, run as its own process (``python stallproxy.py
UPSTREAM PORT_FILE``): every request is passed on to ``UPSTREAM`` as it came, except a GET whose path holds one of
the substrings set with ``POST /__stall__`` (a JSON list): that one is read and never answered (the connection stays
open and silent until the client gives up), as a stalled or hostile endpoint treats one object. ``GET /__stalled__``
answers how many requests were held so far. The chosen port is written to PORT_FILE.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from urllib.parse import unquote, urlsplit

from http_proxy import ForwardingHandler, serve

STALL: list = []
HELD = [0]
LOCK = threading.Lock()


class Proxy(ForwardingHandler):
    upstream_timeout = 120

    def _forward(self) -> None:
        body = self.read_body()
        if self.path == "/__stall__":
            with LOCK:
                STALL[:] = json.loads(body or b"[]")
            return self.answer(200, b"")
        if self.path == "/__stalled__":
            with LOCK:
                return self.answer(200, str(HELD[0]).encode())
        path = unquote(urlsplit(self.path).path)
        with LOCK:
            stall = self.command == "GET" and any(s in path for s in STALL)
            HELD[0] += stall
        if stall:  # read, never answered: the client's read timeout is what ends it
            while True:
                time.sleep(3600)
        self.forward(body)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


def main() -> None:
    up = urlsplit(sys.argv[1])
    Proxy.upstream = (up.hostname, up.port)
    serve(Proxy, sys.argv[2])


if __name__ == "__main__":
    main()
