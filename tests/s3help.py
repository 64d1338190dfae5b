"""A real S3-compatible endpoint on 127.0.0.1 for the tests (moto's server, in a thread of the test process), the
fixtures' objects uploaded into it with their user metadata, and the requests it served, counted at the server.

The server is moto's own WSGI application behind werkzeug's threaded server, wrapped only to count requests (method,
whether it is a listing, the key): what the endpoint saw, however the client sends it. ``stop()`` closes the listening
socket, so a client then gets "connection refused", as from an endpoint that went away.
"""
from __future__ import annotations

import json
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, unquote

FIXTURES_S3 = Path(__file__).parent / "fixtures" / "s3"
BUCKET = "ckpts"
#: credentials of the test endpoint (moto accepts any unless authentication is turned on)
ACCESS_KEY, SECRET_KEY = "AKIDCKPTFSTEST000001", "ckptfs-test-secret-never-printed"


@dataclass
class Request:
    method: str
    path: str
    query: dict
    range: str | None

    @property
    def is_list(self) -> bool:
        return self.method == "GET" and ("list-type" in self.query or self.path.count("/") <= 1 and "/" not in
                                         self.path.strip("/"))


@dataclass
class Counts:
    """Requests seen since ``reset``, thread-safe."""

    requests: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, r: Request) -> None:
        with self.lock:
            self.requests.append(r)

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()

    def snapshot(self) -> list:
        with self.lock:
            return list(self.requests)

    def by_kind(self) -> Counter:
        c = Counter()
        for r in self.snapshot():
            c["LIST" if r.is_list else r.method] += 1
        return c


class _Counting:
    def __init__(self, app, counts: Counts):
        self.app, self.counts = app, counts

    def __call__(self, environ, start_response):
        if not environ.get("PATH_INFO", "").startswith("/moto-api"):
            self.counts.add(Request(environ.get("REQUEST_METHOD", ""), unquote(environ.get("PATH_INFO", "")),
                                    parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True),
                                    environ.get("HTTP_RANGE")))
        return self.app(environ, start_response)


def _quiet_handler():
    from moto.moto_server.werkzeug_app import MotoRequestHandler

    class Quiet(MotoRequestHandler):
        def log_request(self, *args, **kw):  # the tests count requests; they need no access log
            pass

    return Quiet


class LocalS3:
    """moto's S3 on 127.0.0.1 (an unused port), started in a thread of this process."""

    def __init__(self):
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server

        self.counts = Counts()
        app = _Counting(DomainDispatcherApplication(create_backend_app), self.counts)
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=_quiet_handler())
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.running = True

    def stop(self) -> None:
        """Stop answering and close the port (clients get "connection refused")."""
        if self.running:
            self.running = False
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(10)

    def env(self, **extra) -> dict:
        """An environment for a ckptfs process using this endpoint (no AWS configuration of the machine)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ENDPOINT_URL=self.url, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                   AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
                   AWS_EC2_METADATA_DISABLED="true")
        env.update(extra)
        return env

    def client(self):
        """A boto3 client of the test itself (to upload, overwrite, delete)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1")


def upload_case(client, case: str, *, bucket: str = BUCKET, rename: tuple = ("", "")) -> int:
    """Put every object of fixture case ``case`` (``tests/fixtures/s3/<case>``) at its key with its user metadata;
    ``rename``: (old key prefix, new) to place it elsewhere. Returns the number of objects."""
    root = FIXTURES_S3 / case
    listing = json.loads((root / "objects.json").read_text())
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    old, new = rename
    for key, entry in listing.items():
        body = (root / "objects" / key).read_bytes()
        target = new + key[len(old):] if old and key.startswith(old) else key
        client.put_object(Bucket=bucket, Key=target, Body=body, Metadata=entry["metadata"])
    return len(listing)
