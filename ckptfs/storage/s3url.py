"""``s3://bucket/key`` locations and the settings that say how to reach them.

An ``S3Location`` names an object or a prefix of a bucket together with the ``S3Settings`` it is read with (an
endpoint URL and an AWS profile, each None to let boto3 find them as every AWS tool does: ``AWS_ENDPOINT_URL``,
``AWS_PROFILE``, ``~/.aws/config``). It offers the few things the rest of ckptfs asks of a checkpoint's path — its
``name``, ``stem``, ``parent`` and a child by ``/`` — and prints as the URL the user gave, never with a secret.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

SCHEME = "s3://"
#: bucket names S3 and the S3-compatible stores accept (a loose check: a bad name gets a clear line, not a request)
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,254}$")


@dataclass(frozen=True)
class S3Settings:
    """How to reach a bucket: ``endpoint_url`` (``--endpoint-url``; None: ``AWS_ENDPOINT_URL_S3``,
    ``AWS_ENDPOINT_URL`` or the profile's ``endpoint_url``, else AWS itself) and ``profile`` (``--profile``;
    None: ``AWS_PROFILE`` or the default profile)."""

    endpoint_url: str | None = None
    profile: str | None = None


def safe_endpoint(url: str | None) -> str:
    """An endpoint URL fit for a log or an error line: without user information, query or fragment."""
    if not url:
        return "AWS S3"
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(an endpoint URL that does not parse)"
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


@dataclass(frozen=True)
class S3Location:
    """An object (``key``) or a prefix (``key`` names a folder: its objects are ``key/...``) of ``bucket``.

    ``key`` never ends with ``/``; the empty key is the bucket's top."""

    bucket: str
    key: str
    settings: S3Settings = field(default_factory=S3Settings, compare=True)

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    def __fspath__(self):  # not a local path: os.* and open() refuse it instead of using "s3:/..."
        raise TypeError(f"{self} is an S3 location, not a local path")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        name = self.name
        i = name.rfind(".")
        return name[i:] if 0 < i < len(name) - 1 else ""

    @property
    def stem(self) -> str:
        name, suffix = self.name, self.suffix
        return name[: len(name) - len(suffix)] if suffix else name

    @property
    def parent(self) -> "S3Location":
        return S3Location(self.bucket, self.key.rsplit("/", 1)[0] if "/" in self.key else "", self.settings)

    @property
    def prefix(self) -> str:
        """The key prefix of the objects inside this location taken as a folder (``""`` for the bucket's top)."""
        return f"{self.key}/" if self.key else ""

    def __truediv__(self, name: str) -> "S3Location":
        name = str(name).strip("/")
        return S3Location(self.bucket, f"{self.prefix}{name}" if name else self.key, self.settings)

    def child_key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def absolute(self) -> "S3Location":
        return self


def is_s3_url(value) -> bool:
    """Whether ``value`` is an S3 location or a text naming one (``s3://…``)."""
    return isinstance(value, S3Location) or (isinstance(value, str) and value.startswith(SCHEME))


class BadS3Url(ValueError):
    """A text starting with ``s3://`` that does not name a bucket (and key)."""


def parse_s3_url(text: str, settings: S3Settings | None = None) -> S3Location:
    """``s3://bucket/key`` (a trailing ``/`` is dropped: the same location taken as a folder) -> ``S3Location``;
    ``BadS3Url`` saying why for anything else."""
    if not text.startswith(SCHEME):
        raise BadS3Url(f"{text!r} is not an s3:// URL")
    rest = text[len(SCHEME):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise BadS3Url(f"{text!r} names no bucket (s3://BUCKET/KEY)")
    if not _BUCKET.match(bucket):
        raise BadS3Url(f"{text!r}: {bucket!r} is not a valid bucket name")
    if any(ord(c) < 32 for c in key):
        raise BadS3Url(f"{text!r}: the key holds control characters")
    return S3Location(bucket, key.strip("/"), settings or S3Settings())
