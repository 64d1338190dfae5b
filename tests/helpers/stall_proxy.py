"""A fault-injecting HTTP proxy in front of the tests' S3 endpoint, run as its own process (``python stallproxy.py
UPSTREAM PORT_FILE``): every request is passed on to ``UPSTREAM`` as it came, except a GET whose path holds one of
the substrings set with ``POST /__stall__`` (a JSON list): that one is read and never answered (the connection stays
open and silent until the client gives up), as a stalled or hostile endpoint treats one object. ``GET /__stalled__``
answers how many requests were held so far. The chosen port is written to PORT_FILE.
"""
from __future__ import annotations

import http.client
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

STALL: list = []
HELD = [0]
LOCK = threading.Lock()


class Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    def _answer(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        if self.path == "/__stall__":
            with LOCK:
                STALL[:] = json.loads(body or b"[]")
            return self._answer(200, b"")
        if self.path == "/__stalled__":
            with LOCK:
                return self._answer(200, str(HELD[0]).encode())
        path = unquote(urlsplit(self.path).path)
        with LOCK:
            stall = self.command == "GET" and any(s in path for s in STALL)
            HELD[0] += stall
        if stall:  # read, never answered: the client's read timeout is what ends it
            while True:
                time.sleep(3600)
        up = urlsplit(sys.argv[1])
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=120)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
            conn.request(self.command, self.path, body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
            self.send_response(r.status, r.reason)
            for k, v in r.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            head = self.command == "HEAD" and r.getheader("Content-Length")
            self.send_header("Content-Length", head or str(len(data)))  # a HEAD says the object's size
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            conn.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    server.daemon_threads = True
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    server.serve_forever()


if __name__ == "__main__":
    main()
