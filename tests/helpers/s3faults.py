"""An HTTP proxy in front of an S3 endpoint that answers chosen calls with an S3 error, for the tests (``python
s3faults.py UPSTREAM_URL PORT_FILE RULES_FILE``): what a real endpoint answers when a permission is missing or the
session token expired, without the IAM emulation the endpoint may lack.

Every request is forwarded to UPSTREAM_URL as it came, except those a rule of RULES_FILE (JSON, read again for every
request) matches: ``[{"call": "ListObjectsV2" | "HeadObject" | "GetObject" | "HeadBucket", "key": optional suffix of
the key, "status": 403, "code": "AccessDenied"}]``, answered with that status and S3's error XML (no body for a
HEAD, as S3 answers). ``GET /__faults__`` answers how many times each call was answered with a fault, as JSON.
"""
from __future__ import annotations

import json
import sys
import threading
from urllib.parse import parse_qs, unquote, urlsplit

from http_proxy import ForwardingHandler, serve


def call_of(method: str, path: str, query: dict) -> tuple:
    """(S3 call, key) of a path-style request."""
    parts = unquote(path).lstrip("/").split("/", 1)
    key = parts[1] if len(parts) > 1 else ""
    if method == "HEAD":
        return ("HeadObject" if key else "HeadBucket"), key
    if method == "GET" and not key:
        return ("ListObjectsV2" if "list-type" in query else "ListObjects"), key
    return ("GetObject" if method == "GET" else method), key


class Proxy(ForwardingHandler):
    rules_file = ""
    faults: dict = {}
    lock = threading.Lock()

    def _rule(self, call: str, key: str):
        try:
            with open(self.rules_file) as f:
                rules = json.load(f)
        except (OSError, ValueError):
            rules = []
        return next((r for r in rules if r["call"] == call and key.endswith(r.get("key", ""))), None)

    def _handle(self):
        url = urlsplit(self.path)
        if url.path == "/__faults__":
            with self.lock:
                body = json.dumps(self.faults).encode()
            return self.answer(200, body)
        data = self.read_body()
        call, key = call_of(self.command, url.path, parse_qs(url.query, keep_blank_values=True))
        rule = self._rule(call, key)
        if rule is None:
            return self.forward(data)
        with self.lock:
            self.faults[call] = self.faults.get(call, 0) + 1
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{rule["code"]}</Code><Message>injected '
                f'{rule["code"]}</Message><RequestId>FAULT</RequestId></Error>').encode()
        self.answer(rule["status"], body, {"Content-Type": "application/xml", "x-amz-request-id": "FAULT"},
                    length=0 if self.command == "HEAD" else None)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle


def main() -> None:
    upstream = urlsplit(sys.argv[1])
    Proxy.upstream = (upstream.hostname, upstream.port)
    Proxy.rules_file = sys.argv[3]
    serve(Proxy, sys.argv[2])


if __name__ == "__main__":
    main()
