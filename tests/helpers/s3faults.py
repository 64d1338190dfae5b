"""An HTTP proxy in front of an S3 endpoint that answers chosen calls with an S3 error, for the tests (``python
s3faults.py UPSTREAM_URL PORT_FILE RULES_FILE``): what a real endpoint answers when a permission is missing or the
session token expired, without the IAM emulation the endpoint may lack.

Every request is forwarded to UPSTREAM_URL as it came, except those a rule of RULES_FILE (JSON, read again for every
request) matches: ``[{"call": "ListObjectsV2" | "HeadObject" | "GetObject" | "HeadBucket", "key": optional suffix of
the key, "status": 403, "code": "AccessDenied"}]``, answered with that status and S3's error XML (no body for a
HEAD, as S3 answers). ``GET /__faults__`` answers how many times each call was answered with a fault, as JSON.
"""
from __future__ import annotations

import http.client
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade", "te", "trailer"}


def call_of(method: str, path: str, query: dict) -> tuple:
    """(S3 call, key) of a path-style request."""
    parts = unquote(path).lstrip("/").split("/", 1)
    key = parts[1] if len(parts) > 1 else ""
    if method == "HEAD":
        return ("HeadObject" if key else "HeadBucket"), key
    if method == "GET" and not key:
        return ("ListObjectsV2" if "list-type" in query else "ListObjects"), key
    return ("GetObject" if method == "GET" else method), key


class Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream: tuple = ("127.0.0.1", 0)
    rules_file = ""
    faults: dict = {}
    lock = threading.Lock()

    def log_message(self, *args):
        pass

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
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else None
        call, key = call_of(self.command, url.path, parse_qs(url.query, keep_blank_values=True))
        rule = self._rule(call, key)
        if rule is not None:
            with self.lock:
                self.faults[call] = self.faults.get(call, 0) + 1
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{rule["code"]}</Code><Message>injected '
                    f'{rule["code"]}</Message><RequestId>FAULT</RequestId></Error>').encode()
            self.send_response(rule["status"])
            self.send_header("Content-Type", "application/xml")
            self.send_header("x-amz-request-id", "FAULT")
            self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            return
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            conn.request(self.command, self.path, body=data, headers=headers)
            r = conn.getresponse()
            payload = r.read()
            self.send_response(r.status, r.reason)
            for k, v in r.getheaders():
                if k.lower() not in HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
        finally:
            conn.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle


def main() -> None:
    upstream = urlsplit(sys.argv[1])
    Proxy.upstream = (upstream.hostname, upstream.port)
    Proxy.rules_file = sys.argv[3]
    server = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    server.daemon_threads = True
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    server.serve_forever()


if __name__ == "__main__":
    main()
