"""A local S3-compatible endpoint for the tests, run as its own process (``python s3server.py PORT_FILE``): moto's
server application behind werkzeug's threaded server, counting every request it serves.

It runs apart from the test process on purpose: a test that reads a mount through an mmap (``from_pretrained``)
holds its interpreter's lock during the page faults, so an endpoint served by a thread of the test process could not
answer the mount's server (a deadlock until the timeouts). ``GET /__counts__`` answers the requests seen (method,
path, query, range) as JSON lines; ``POST /__reset__`` forgets them; ``POST /__put_many__`` puts objects in bulk
(test data only: not counted). The chosen port is written to PORT_FILE.
"""
from __future__ import annotations

import json
import sys
import threading
from urllib.parse import parse_qs, unquote


class Counting:
    def __init__(self, app):
        self.app = app
        self.seen: list = []
        self.lock = threading.Lock()

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/__counts__":
            with self.lock:
                body = "".join(json.dumps(r) + "\n" for r in self.seen).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if path == "/__reset__":
            with self.lock:
                self.seen.clear()
            start_response("200 OK", [("Content-Length", "0")])
            return [b""]
        if path == "/__put_many__":  # test data in bulk: {"bucket", "objects": [[key, base64 body, metadata]]}
            n = self._put_many(json.loads(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))))
            body = str(n).encode()
            start_response("200 OK", [("Content-Length", str(len(body)))])
            return [body]
        if not path.startswith("/moto-api"):
            with self.lock:
                self.seen.append({"method": environ.get("REQUEST_METHOD", ""), "path": unquote(path),
                                  "query": parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True),
                                  "range": environ.get("HTTP_RANGE")})
        return self.app(environ, start_response)


    @staticmethod
    def _put_many(spec: dict) -> int:
        """Objects put straight into moto's backend (as a PUT would leave them, user metadata included): a
        thousand objects in a fraction of a second, where as many PUT requests take many seconds."""
        import base64

        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
        for key, body, metadata in spec["objects"]:
            obj = backend.put_object(spec["bucket"], key, base64.b64decode(body))
            obj.set_metadata({f"x-amz-meta-{k}": v for k, v in metadata.items()})
        return len(spec["objects"])


def main() -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class Quiet(MotoRequestHandler):
        def log_request(self, *args, **kw):  # requests are counted; no access log
            pass

    server = make_server("127.0.0.1", 0, Counting(DomainDispatcherApplication(create_backend_app)), threaded=True,
                         request_handler=Quiet)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    import os

    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    server.serve_forever()


if __name__ == "__main__":
    main()
