"""Fault injection for the storage layer, without a server (as mountpoint-s3's failure client wraps its mock client):

* ``FaultyBlob`` wraps any ``Blob`` and misbehaves on chosen reads: an ``OSError``, a short read, latency, or the
  stored version changing after a given read.
* ``FakeS3`` is an in-memory stand-in for the boto3 S3 client (``head_object``, ``get_object``, ``list_objects_v2``,
  ``head_bucket``) answering as an endpoint does — ranges, ``If-Match``, ETags, botocore's ``ClientError`` — with
  faults of its own: error codes for chosen requests, bodies cut short, latency, an endpoint that ignores
  ``If-Match``, an object replaced between two requests. ``s3_client(fake)`` gives ckptfs's ``S3Client`` over it, so
  the S3 read path (``S3Client`` and ``S3Object``: parts, merging, retries, ETag checks) runs without an endpoint.
"""
from __future__ import annotations

import hashlib
import io
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from ckptfs.storage.base import Blob


class FaultyBlob(Blob):
    """``inner`` with faults: ``fail_on`` (read numbers, from 1, that raise ``OSError``), ``short_on`` (reads that
    return half of what they could), ``latency`` (seconds before every read), ``change_after`` (after that many
    reads, ``current_version()`` reports another version)."""

    def __init__(self, inner: Blob, *, fail_on=(), short_on=(), latency: float = 0.0, change_after: int | None = None):
        self.inner = inner
        self.name = inner.name
        self.fail_on, self.short_on = set(fail_on), set(short_on)
        self.latency, self.change_after = latency, change_after
        self.reads = 0
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def version(self):
        return self.inner.version

    def current_version(self):
        if self.change_after is not None and self.reads >= self.change_after:
            return ("changed", self.inner.version)
        return self.inner.current_version()

    def read_into(self, view: memoryview, offset: int, need: int) -> tuple[int, bool]:
        with self._lock:
            self.reads += 1
            k = self.reads
        if self.latency:
            time.sleep(self.latency)
        if k in self.fail_on:
            raise OSError(5, f"{self.name}: injected read error (read {k})")
        if k in self.short_on:
            need = need // 2
        return self.inner.read_into(view, offset, need)

    def close(self) -> None:
        self.inner.close()


def _etag(data: bytes) -> str:
    return '"' + hashlib.md5(data).hexdigest() + '"'  # noqa: S324 - what S3 uses for a single-part object


class _Body:
    """A streaming body that may end early (``cut`` bytes sent of ``len(data)``)."""

    def __init__(self, data: bytes, cut: int | None = None):
        self._f = io.BytesIO(data if cut is None else data[:cut])

    def read(self, n: int = -1) -> bytes:
        return self._f.read(n)

    def readinto(self, b) -> int:
        return self._f.readinto(b)

    def close(self) -> None:
        self._f.close()


@dataclass
class FakeS3:
    """An in-memory endpoint (see the module docstring). ``objects``: ``{(bucket, key): bytes}``; ``errors``:
    ``{request number (from 1): error code}`` answered instead (``"SlowDown"``, ``"InternalError"``,
    ``"AccessDenied"``, ``"ExpiredToken"``, ``"NoSuchKey"``…); ``cut``: GET numbers whose body ends at half;
    ``latency``: seconds per request; ``ignore_if_match``: answer whatever is stored; ``replace_after``: ``(n, bucket,
    key, bytes)`` — the object is replaced once n requests were answered."""

    objects: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    cut: set = field(default_factory=set)
    latency: float = 0.0
    ignore_if_match: bool = False
    replace_after: tuple | None = None
    requests: list = field(default_factory=list)
    in_flight: int = 0  # requests being answered now
    most_in_flight: int = 0  # the most answered at once
    _lock: threading.Lock = field(default_factory=threading.Lock)

    class meta:
        endpoint_url = "http://fake-s3.invalid"

    def _next(self, op: str, **kw) -> int:
        with self._lock:
            self.requests.append((op, kw))
            n = len(self.requests)
            if self.replace_after is not None and n > self.replace_after[0]:
                _, bucket, key, data = self.replace_after
                self.objects[(bucket, key)] = data
                self.replace_after = None
        if self.latency:
            with self._lock:
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
            time.sleep(self.latency)
            with self._lock:
                self.in_flight -= 1
        code = self.errors.get(n)
        if code:
            self._raise(code, op)
        return n

    @staticmethod
    def _raise(code: str, op: str, status: int | None = None):
        from botocore.exceptions import ClientError

        status = status or {"NoSuchKey": 404, "NoSuchBucket": 404, "AccessDenied": 403, "ExpiredToken": 400,
                            "PreconditionFailed": 412, "InvalidRange": 416, "SlowDown": 503}.get(code, 500)
        raise ClientError({"Error": {"Code": code, "Message": code},
                           "ResponseMetadata": {"HTTPStatusCode": status}}, op)

    def _get_object(self, bucket: str, key: str, op: str) -> bytes:
        data = self.objects.get((bucket, key))
        if data is None:
            self._raise("NoSuchKey", op)
        return data

    def head_bucket(self, Bucket):  # noqa: N803 - boto3's names
        self._next("HeadBucket", Bucket=Bucket)
        if not any(b == Bucket for b, _ in self.objects):
            self._raise("NoSuchBucket", "HeadBucket")
        return {}

    def head_object(self, Bucket, Key):  # noqa: N803
        self._next("HeadObject", Bucket=Bucket, Key=Key)
        data = self._get_object(Bucket, Key, "HeadObject")
        return {"ContentLength": len(data), "ETag": _etag(data), "LastModified": datetime(2026, 1, 1, tzinfo=timezone.utc),
                "Metadata": {}}

    def get_object(self, Bucket, Key, Range=None, IfMatch=None):  # noqa: N803
        n = self._next("GetObject", Bucket=Bucket, Key=Key, Range=Range)
        data = self._get_object(Bucket, Key, "GetObject")
        if IfMatch and not self.ignore_if_match and IfMatch.strip('"') != _etag(data).strip('"'):
            self._raise("PreconditionFailed", "GetObject")
        out, rng = data, None
        if Range:
            lo, hi = (int(x) for x in Range[len("bytes="):].split("-"))
            if lo >= len(data):
                self._raise("InvalidRange", "GetObject")
            hi = min(hi, len(data) - 1)
            out, rng = data[lo:hi + 1], f"bytes {lo}-{hi}/{len(data)}"
        r = {"ContentLength": len(out), "ETag": _etag(data), "LastModified": datetime(2026, 1, 1, tzinfo=timezone.utc),
             "Metadata": {}, "Body": _Body(out, len(out) // 2 if n in self.cut else None)}
        if rng:
            r["ContentRange"] = rng
        return r

    def list_objects_v2(self, Bucket, Prefix="", Delimiter=None, MaxKeys=1000, ContinuationToken=None):  # noqa: N803
        self._next("ListObjectsV2", Bucket=Bucket, Prefix=Prefix)
        keys = sorted(k for b, k in self.objects if b == Bucket and k.startswith(Prefix))
        contents, prefixes = [], set()
        for k in keys:
            rest = k[len(Prefix):]
            if Delimiter and Delimiter in rest:
                prefixes.add(Prefix + rest.split(Delimiter, 1)[0] + Delimiter)
            else:
                d = self.objects[(Bucket, k)]
                contents.append({"Key": k, "Size": len(d), "ETag": _etag(d),
                                 "LastModified": datetime(2026, 1, 1, tzinfo=timezone.utc)})
        return {"Contents": contents, "CommonPrefixes": [{"Prefix": p} for p in sorted(prefixes)],
                "IsTruncated": False}

    def count(self, op: str) -> int:
        return sum(1 for o, _ in self.requests if o == op)


def s3_client(fake: FakeS3):
    """ckptfs's ``S3Client`` talking to ``fake`` instead of an endpoint."""
    import os

    from ckptfs.storage.s3client import S3Client
    from ckptfs.storage.s3url import S3Settings

    c = S3Client(S3Settings())
    c._client, c._pid = fake, os.getpid()
    return c


def s3_object(fake: FakeS3, bucket: str, key: str):
    """An ``S3Object`` over ``fake``'s object ``bucket``/``key`` as ckptfs opens one (its size and ETag from a HEAD)."""
    from ckptfs.storage.s3object import S3Object

    client = s3_client(fake)
    info = client.head(bucket, key)
    return S3Object(client, bucket, key, info.size, info.etag, info.mtime_ns)
