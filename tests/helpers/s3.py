"""A real S3-compatible endpoint on 127.0.0.1 for the tests (moto's server, started by the tests in a process of its
own: ``s3server.py``), the fixtures' objects uploaded into it with their user metadata, and the requests it served,
counted at the server: what the endpoint saw, however the client sends it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

FIXTURES_S3 = Path(__file__).parent.parent / "fixtures" / "s3"
BUCKET = "ckpts"
#: credentials of the test endpoint (moto accepts any unless authentication is turned on)
ACCESS_KEY, SECRET_KEY = "AKIDCKPTFSTEST000001", "ckptfs-test-secret-never-printed"


@dataclass
class Request:
    """One request the endpoint served."""

    method: str
    path: str
    query: dict
    range: str | None

    @property
    def is_list(self) -> bool:
        return self.method == "GET" and "list-type" in self.query

    @property
    def kind(self) -> str:
        return "LIST" if self.is_list else self.method


class LocalS3:
    """moto's S3 on 127.0.0.1 (an unused port), in a process of its own (``s3server.py``)."""

    def __init__(self, tmp: Path):
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        port_file = self.tmp / "s3-port"
        port_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("s3server.py")), str(port_file)],
                                     stdout=subprocess.DEVNULL, stderr=open(self.tmp / "s3-server.log", "wb"))
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the local S3 server did not start: {(self.tmp / 's3-server.log').read_text()}")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        self.url = f"http://127.0.0.1:{self.port}"
        self.running = True

    def stop(self) -> None:
        """Stop the endpoint (clients then get "connection refused", as from an endpoint that went away)."""
        if self.running:
            self.running = False
            self.proc.terminate()
            self.proc.wait(10)

    def _call(self, method: str, path: str, data: bytes | None = None) -> bytes:
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/octet-stream"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read()

    def reset(self) -> None:
        """Forget the requests counted so far."""
        self._call("POST", "/__reset__", b"")

    def requests(self) -> list:
        """Every request served since the last ``reset``."""
        lines = self._call("GET", "/__counts__").decode().splitlines()
        return [Request(**json.loads(line)) for line in lines if line]

    def counts(self) -> Counter:
        """Requests since the last ``reset`` by kind: GET, HEAD, LIST, PUT…"""
        return Counter(r.kind for r in self.requests())

    def put_many(self, bucket: str, objects: list) -> None:
        """Put ``[(key, body, user metadata)]`` straight into the endpoint's store (thousands per second; the bucket
        must exist)."""
        import base64

        spec = {"bucket": bucket, "objects": [[k, base64.b64encode(b).decode(), m] for k, b, m in objects]}
        self._call("POST", "/__put_many__", json.dumps(spec).encode())

    def set_auth(self, on: bool) -> None:
        """Make the endpoint check credentials (moto's IAM emulation) or accept any."""
        self._call("POST", "/moto-api/reset-auth", b"0" if on else b"inf")

    def env(self, **extra) -> dict:
        """An environment for a ckptfs process using this endpoint (no AWS configuration of the machine)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ENDPOINT_URL=self.url, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                   AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE=str(self.tmp / "no-aws-config"),
                   AWS_SHARED_CREDENTIALS_FILE=str(self.tmp / "no-aws-credentials"), AWS_EC2_METADATA_DISABLED="true")
        env.update(extra)
        return env

    def client(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY):
        """A boto3 client of the test itself (to upload, overwrite, delete)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id=access_key, aws_secret_access_key=secret_key,
                            region_name="us-east-1")


def case_objects(case: str, rename: tuple = ("", "")) -> list:
    """``[(key, body, user metadata)]`` of fixture case ``case`` (``tests/fixtures/s3/<case>``: bodies stored by
    content, ``BLOBS.md``); ``rename``: (old key prefix, new) to place it elsewhere."""
    root = FIXTURES_S3 / case
    listing = json.loads((root / "objects.json").read_text())
    old, new = rename
    return [(new + key[len(old):] if old and key.startswith(old) else key, (root / "blobs" / e["sha256"]).read_bytes(),
             e["metadata"]) for key, e in listing.items()]


def upload_case(s3: LocalS3, case: str, *, bucket: str = BUCKET, rename: tuple = ("", ""), client=None) -> int:
    """Put every object of fixture case ``case`` at its key with its user metadata (into the endpoint's store at
    once; with ``client``, by one PUT request each, as a writer does). Returns the number of objects."""
    objects = case_objects(case, rename)
    c = client or s3.client()
    try:
        c.create_bucket(Bucket=bucket)
    except c.exceptions.BucketAlreadyOwnedByYou:
        pass
    if client is None:
        s3.put_many(bucket, objects)
    else:
        for key, body, metadata in objects:
            client.put_object(Bucket=bucket, Key=key, Body=body, Metadata=metadata)
    return len(objects)


def generated_checkpoint(folder: Path, ffn: int) -> tuple:
    """A generated bf16 llama-shaped checkpoint (the bench's generator; MiB-sized tensors, ``ffn`` wide) written to
    ``folder``: ``(checkpoint_0.mdl, params.yaml)``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "scripts"))
    from benchlib import gen

    dims = gen.LlamaDims(hidden=1024, layers=2, heads=8, kv_heads=4, ffn=ffn, vocab=6144, max_positions=64)
    folder.mkdir(parents=True)
    gen.write_checkpoint(folder / "checkpoint_0.mdl", dims, "bf16")
    return folder / "checkpoint_0.mdl", gen.write_params(folder / "params.yaml", dims)


def mdl_object(srv: "LocalS3", monkeypatch, tmp: Path, mdl: Path, params: Path) -> str:
    """``mdl`` and its ``params`` stored as the objects ``run/checkpoint_0.mdl`` and ``run/params.yaml`` of a new
    bucket of ``srv``, this process pointed at ``srv`` (and at a cache folder of ``tmp``): the checkpoint's URL."""
    for k, v in srv.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CKPTFS_CACHE_DIR", str(tmp / "cache"))
    c = srv.client()
    c.create_bucket(Bucket=BUCKET)
    c.put_object(Bucket=BUCKET, Key="run/checkpoint_0.mdl", Body=Path(mdl).read_bytes())
    c.put_object(Bucket=BUCKET, Key="run/params.yaml", Body=Path(params).read_bytes())
    return f"s3://{BUCKET}/run/checkpoint_0.mdl"


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream`` (an endpoint URL), in a process of its own
    (``s3faults.py``), answering the calls ``set_faults`` names with an S3 error: a real endpoint, botocore parsing
    a real answer."""

    def __init__(self, upstream: str, tmp: Path):
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.rules = self.tmp / "faults.json"
        self.rules.write_text("[]")
        port_file = self.tmp / "proxy-port"
        port_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("s3faults.py")), upstream,
                                      str(port_file), str(self.rules)],
                                     stdout=subprocess.DEVNULL, stderr=open(self.tmp / "proxy.log", "wb"))
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fault proxy did not start: {(self.tmp / 'proxy.log').read_text()}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"

    def set_faults(self, *rules: dict) -> None:
        """Answer these calls with these errors from now on: ``{"call", "status", "code", "key": suffix}``."""
        tmp = self.rules.with_suffix(".tmp")
        tmp.write_text(json.dumps(list(rules)))
        os.replace(tmp, self.rules)

    def faults(self) -> dict:
        """How many times each call was answered with an error so far."""
        with urllib.request.urlopen(self.url + "/__faults__", timeout=30) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def endpoint_with(tmp: Path, *cases: str):
    """A ``LocalS3`` in ``tmp`` holding the fixture cases ``cases``, stopped when the generator closes (a module
    fixture's body: ``yield from endpoint_with(tmp_path_factory.mktemp("s3"), "s3_llama")``)."""
    srv = LocalS3(tmp)
    try:
        for case in cases:
            upload_case(srv, case)
        yield srv
    finally:
        srv.stop()
