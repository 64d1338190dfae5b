"""What the tests' fault-injecting HTTP proxies share (``s3faults.py``, ``stall_proxy.py``, each run as its own
process): a handler that passes a request on to the upstream endpoint as it came and relays the answer, and the
serving loop that writes the chosen port to a file."""
from __future__ import annotations

import http.client
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: hop-by-hop headers, never passed on (nor ``Content-Length``, set from the body relayed)
HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade", "te", "trailer"}


class ForwardingHandler(BaseHTTPRequestHandler):
    """A quiet HTTP/1.1 handler that ``forward``s to ``upstream`` (``(host, port)``); subclasses decide what to
    answer themselves."""

    protocol_version = "HTTP/1.1"
    upstream: tuple = ("127.0.0.1", 0)
    upstream_timeout = 60

    def log_message(self, *args):  # quiet
        pass

    def answer(self, code: int, body: bytes, headers: dict | None = None, length: int | None = None) -> None:
        """Answer ``code`` with ``body`` (none for a HEAD, whose ``Content-Length`` is ``length`` if given)."""
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def forward(self, body: bytes | None) -> None:
        """Pass the request (its ``body`` already read) on upstream and relay the answer; a HEAD's answer keeps the
        upstream's ``Content-Length`` (the object's size)."""
        conn = http.client.HTTPConnection(*self.upstream, timeout=self.upstream_timeout)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            conn.request(self.command, self.path, body=body, headers=headers)
            r = conn.getresponse()
            data = r.read()
            relayed = [(k, v) for k, v in r.getheaders() if k.lower() not in HOP and k.lower() != "content-length"]
            head = self.command == "HEAD" and r.getheader("Content-Length")
            self.send_response(r.status, r.reason)
            for k, v in relayed:
                self.send_header(k, v)
            self.send_header("Content-Length", head or str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            conn.close()

    def read_body(self) -> bytes | None:
        """The request's body (None without one)."""
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else None


def serve(handler: type, port_file: str) -> None:
    """Serve ``handler`` on a free port of 127.0.0.1 (one thread per connection), the port written to ``port_file``
    (atomically: a reader never sees it half written)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(port_file + ".tmp", port_file)
    server.serve_forever()
