"""A fault-injecting HTTP proxy in front of the test endpoint (``s3help.LocalS3``): every request is passed on to the
endpoint and its answer passed back, except the GETs of keys a test names, which get an answer of its choosing —
a body streamed without ``Content-Length`` (chunked) that goes on for a given number of bytes, made up as it is
sent (nothing that large is stored or held). It runs on 127.0.0.1 in a thread of the test process; the ckptfs
process under test (a subprocess) uses it as its endpoint.

Also: ``peak_rss`` runs the ckptfs command line in a subprocess and reports its peak resident memory.
"""
from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class FaultProxy:
    """``http://127.0.0.1:<port>`` passing requests on to ``upstream`` (``LocalS3.url``); ``chunked[key] = n``
    makes a GET of ``/<bucket>/<key>`` answer 200 with ``n`` bytes of zeros sent chunked (no Content-Length).
    ``served[key]``: the bytes actually sent for it (the client stopping early shows here)."""

    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream)
        self.chunked: dict = {}
        self.served: dict = {}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _relay(self):
                path = unquote(urlsplit(self.path).path)
                if self.command == "GET":
                    for key, n in proxy.chunked.items():
                        if path.endswith("/" + key):
                            return self._chunked(key, n)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    r = conn.getresponse()
                    data = r.read()
                    self.send_response(r.status)
                    for k, v in r.getheaders():
                        if k.lower() not in _HOP and k.lower() != "content-length":
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            def _chunked(self, key: str, n: int):
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                step = b"\0" * (1 << 20)
                sent = 0
                try:
                    while sent < n:
                        piece = step[:min(len(step), n - sent)]
                        self.wfile.write(b"%x\r\n" % len(piece) + piece + b"\r\n")
                        sent += len(piece)
                        proxy.served[key] = sent
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


_RSS_MAIN = """
import json, sys
from ckptfs.cli import main
code = 1
try:
    code = main(sys.argv[2:])
finally:
    # VmHWM: this process's own peak (ru_maxrss would count the test process it was forked from, before exec)
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    with open(sys.argv[1], "w") as f:
        json.dump({"code": code, "maxrss": hwm * 1024}, f)
sys.exit(code)
"""


def peak_rss(args: list, env: dict, tmp: Path, timeout: float = 300) -> tuple:
    """Run ``ckptfs ARGS`` in a subprocess: ``(CompletedProcess, its peak resident memory in bytes)``."""
    out = Path(tmp) / "rss.json"
    out.unlink(missing_ok=True)
    r = subprocess.run([sys.executable, "-c", _RSS_MAIN, str(out), *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    peak = json.loads(out.read_text())["maxrss"] if out.exists() else 0
    return r, peak
