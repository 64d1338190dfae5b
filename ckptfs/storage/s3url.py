"""``s3://bucket/key`` locations and the settings that say how to reach them.

An ``S3Location`` names an object or a prefix of a bucket together with the ``S3Settings`` it is read with (an
endpoint URL and an AWS profile, each None to let boto3 find them as every AWS tool does: ``AWS_ENDPOINT_URL``,
``AWS_PROFILE``, ``~/.aws/config``). It offers the few things the rest of ckptfs asks of a checkpoint's path — its
``name``, ``stem``, ``parent`` and a child by ``/`` — and prints as the URL the user gave, never with a secret.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
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
    region: str | None = None  # from an AWS https URL naming it (``s3.REGION.amazonaws.com``); None: boto3's own


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
    """Whether ``value`` is an S3 location or a text naming one: ``s3://…``, or a spelling ``s3_spelling`` takes."""
    if isinstance(value, S3Location):
        return True
    return isinstance(value, str) and (value.startswith(SCHEME) or s3_spelling(value) is not None)


#: other spellings of the ``s3://`` scheme that name the same object (cstorch.load takes ``S3://``; Hadoop tools
#: write ``s3a://`` and ``s3n://``)
_SCHEME_ALIASES = re.compile(r"^(?:[sS]3|[sS]3[aAnN])://")
#: AWS's https addresses of an object: virtual-hosted (``BUCKET.s3[.-]REGION].amazonaws.com/KEY``) and path-style
#: (``s3[.-]REGION.amazonaws.com/BUCKET/KEY``)
_VIRTUAL_HOST = re.compile(r"^(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])\.s3(?:[.-](?P<region>[a-z0-9-]+))?"
                           r"(?:\.dualstack)?\.amazonaws\.com$")
_PATH_HOST = re.compile(r"^s3(?:[.-](?:dualstack\.)?(?P<region>[a-z0-9-]+))?\.amazonaws\.com$")


@dataclass(frozen=True)
class Spelling:
    """What another spelling of an S3 address means: its ``s3://`` URL and the region it names (or None)."""

    url: str
    region: str | None = None


def s3_spelling(text: str) -> Spelling | None:
    """The ``s3://`` URL another unambiguous spelling of an S3 address means (``S3://``, ``s3a://``, ``s3n://``;
    AWS's virtual-hosted and path-style https URLs, with their region), or None for anything else (``s3://`` itself
    included: it needs no translation)."""
    if not isinstance(text, str) or text.startswith(SCHEME):
        return None
    m = _SCHEME_ALIASES.match(text)
    if m:
        return Spelling(SCHEME + text[m.end():])
    if not text.lower().startswith(("https://", "http://")):
        return None
    try:
        parts = urlsplit(text)
        host = (parts.hostname or "").lower()
    except ValueError:
        return None
    if parts.query or parts.fragment or parts.username:
        return None  # a presigned URL or one with credentials: not a location ckptfs lists
    path = parts.path.lstrip("/")
    v = _VIRTUAL_HOST.match(host)
    if v:
        return Spelling(f"{SCHEME}{v.group('bucket')}/{path}", _region(v.group("region")))
    p = _PATH_HOST.match(host)
    if p and path:
        return Spelling(f"{SCHEME}{path}", _region(p.group("region")))
    return None


def _region(name: str | None) -> str | None:
    return None if name in (None, "external-1", "accelerate") else name


def url_problem(text: str) -> str | None:
    """For a text that looks like a URL ckptfs does not take (``SCHEME://…``, not an S3 spelling), one line saying
    what would work; None for anything else."""
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", text) if isinstance(text, str) else None
    if m is None or is_s3_url(text):
        return None
    scheme = m.group(1).lower()
    if scheme in ("http", "https"):
        try:
            parts = urlsplit(text)
            host = parts.hostname or "?"
            if parts.port:
                host = f"{host}:{parts.port}"
        except ValueError:
            host = "?"
        if host.split(":")[0].endswith("amazonaws.com"):
            return (f"an https URL of {host} that names no S3 bucket and key (presigned or not an S3 address): give "
                    "s3://BUCKET/KEY")
        return (f"an https URL of {host}, which is not AWS S3: for an S3-compatible store give s3://BUCKET/KEY with "
                f"--endpoint-url {urlunsplit((scheme, host, '', '', ''))} (ckptfs does not download files)")
    if scheme in ("hf", "huggingface"):
        return "a Hugging Face URL: give the repository id (ORG/NAME) of a model in the local Hub cache, or its folder"
    return f"a {scheme}:// URL: ckptfs reads local paths, s3:// locations and Hub repository ids in the local cache"


class BadS3Url(ValueError):
    """A text starting with ``s3://`` that does not name a bucket (and key)."""


def parse_s3_url(text: str, settings: S3Settings | None = None) -> S3Location:
    """``s3://bucket/key`` (a trailing ``/`` is dropped: the same location taken as a folder) -> ``S3Location``;
    ``BadS3Url`` saying why for anything else."""
    spelled = s3_spelling(text)
    if spelled is not None:
        text = spelled.url
        if spelled.region and (settings is None or settings.region is None):
            settings = replace(settings or S3Settings(), region=spelled.region)
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
