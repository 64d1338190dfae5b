"""The S3 client ckptfs reads buckets with: botocore (boto3's core) configured as every AWS tool is, bounded in time,
with one-line errors that never carry a secret.

Credentials, region, endpoint and addressing style come from where boto3 finds them (the environment, ``~/.aws``
profiles, ``AWS_ENDPOINT_URL``…); ``S3Settings`` can name a profile and an endpoint URL on top (``--profile``,
``--endpoint-url``). One client per settings per process (botocore clients are thread-safe; a forked child makes its
own, since the parent's pooled connections cannot be shared). Every request has a connect and a read timeout and
is retried with exponential backoff and jitter (botocore's "standard" mode) a bounded number of times, so a
vanished or stalled endpoint makes a request fail within ``worst_case_seconds()``, never hang; for ``DOWN_SECONDS``
after that, requests fail at once (a read that needs many objects fails within one request's bound). An endpoint
that answers the others but not one object (a stalled or hostile key) is not taken for down: only that object's
requests fail at once for a while, until a second object is silent too (``_failed``).

Failures become ``StorageError(location, one line, kind)``: the bucket or key that is missing, access denied (naming
the IAM permission the refused call needed and what for: ``s3problems``), credentials refused, expired or absent,
the endpoint unreachable — never the server's raw message (which ckptfs does not control) and never a key, token or
signature. Only transient failures are asked again (botocore's standard mode: 5xx answers, throttling, timeouts, a
broken connection); an answer about the credentials or access never is: asking again cannot change it. A ranged
read of an object whose ETag changed since it was listed (``If-Match`` refused, HTTP 412) raises
``SourceChangedError``.
"""
from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..env import aws_environment
from ..errors import SourceChangedError, StorageError
from ckptfs.storage.etag import if_match, normal_etag, same_etag
from ckptfs.storage.s3problems import (CREDENTIAL_CODES, SSO_ERRORS, credentials_problem, denied_problem,
                                       profile_problem, sso_problem)
from .s3url import S3Settings, safe_endpoint

#: seconds to set up a connection, and to wait for any byte of an answer
CONNECT_TIMEOUT = 5.0
READ_TIMEOUT = 10.0
#: attempts per request (the first included), with botocore's exponential backoff between them
ATTEMPTS = 3
#: connections kept open to the endpoint (at least the parts in flight of all objects: ``s3object.MAX_IN_FLIGHT``)
POOL_CONNECTIONS = 16
#: an answer body that fails while streaming is asked for again this many times
BODY_RETRIES = 2
#: an answer is copied into the caller's buffers this many bytes at a time (what a read keeps besides them)
BODY_STEP = 1 << 20
#: after the endpoint could not be reached (or did not answer), requests fail at once for this many seconds instead
#: of each waiting out the timeouts again: a read needing many objects fails within one request's bound
DOWN_SECONDS = 5.0

_UNREACHABLE = ("EndpointConnectionError", "ConnectionClosedError", "ProxyConnectionError", "ConnectionError",
                "SSLError")
_TIMEOUT = ("ConnectTimeoutError", "ReadTimeoutError")


# boto3's own loggers say at DEBUG level what they send (headers, a session token among them): never into ckptfs's
# logs, whatever their level (``--debug``)
for _name in ("boto3", "botocore", "s3transfer", "urllib3"):
    logging.getLogger(_name).setLevel(logging.WARNING)


def worst_case_seconds() -> float:
    """The longest one request can take before it fails: every attempt timing out, plus botocore's backoff."""
    return ATTEMPTS * (CONNECT_TIMEOUT + READ_TIMEOUT) + 2.0 ** ATTEMPTS


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One object as a listing or a HEAD reports it."""

    key: str
    size: int
    etag: str
    mtime_ns: int


@dataclass
class Listing:
    """A prefix's objects and, with a delimiter, its sub-prefixes ("folders", each ending with ``/``)."""

    objects: list
    prefixes: list
    requests: int = 1  # list requests it took (pages)


@dataclass
class GetResult:
    """A GET's bytes (or the count written into the caller's buffer), the object and its user metadata."""

    data: bytes | None
    count: int
    info: ObjectInfo
    metadata: dict


def _mtime_ns(value) -> int:
    try:
        return int(value.timestamp() * 1e9)
    except (AttributeError, ValueError, OverflowError):
        return 0


def _etag(value) -> str:
    """Every ETag as ckptfs keeps it, however the endpoint spelled it (``storage.etag``)."""
    return normal_etag(value)


class S3Client:
    """Requests to one endpoint with one set of credentials (see the module docstring). Thread-safe."""

    def __init__(self, settings: S3Settings):
        self.settings = settings
        self._client = None
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._down: tuple | None = None  # (monotonic time until which requests fail at once, the failure)
        self._silent: dict = {}  # location -> (monotonic time until which its requests fail at once, the failure)

    # -- the botocore client -----------------------------------------------------------------------------------
    @property
    def client(self):
        c = self._client
        if c is not None and self._pid == os.getpid():
            return c
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                self._client, self._pid = self._make(), os.getpid()
            return self._client

    def _make(self):
        # botocore's own session, not boto3's: a low-level client is all ckptfs uses, and boto3's import (its
        # resources, s3transfer) is a good part of a cold ``ckptfs info s3://…``'s start (docs/measurements.md).
        # The session finds credentials, region, profile and endpoint exactly as boto3's does (boto3 wraps it)
        import botocore.session
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError

        from .s3models import use_model_loader

        where = self.endpoint
        try:
            session = botocore.session.Session(profile=self.settings.profile)
            use_model_loader(session)
            return session.create_client(
                "s3", endpoint_url=self.settings.endpoint_url, region_name=self.settings.region,
                config=Config(connect_timeout=CONNECT_TIMEOUT, read_timeout=READ_TIMEOUT,
                              retries={"mode": "standard", "total_max_attempts": ATTEMPTS},
                              max_pool_connections=POOL_CONNECTIONS, tcp_keepalive=True))
        except BotoCoreError as e:
            name = type(e).__name__
            if name == "ProfileNotFound":
                raise StorageError(where, profile_problem(self.settings.profile), "credentials") from None
            if name in ("InvalidEndpointConfigurationError", "ValueError") or "endpoint" in name.lower():
                raise StorageError(where, "the endpoint URL is not usable", "failed") from None
            raise StorageError(where, f"cannot set up the S3 client ({name})", "failed") from None
        except ValueError:
            raise StorageError(where, "the endpoint URL is not valid", "failed") from None

    @property
    def endpoint(self) -> str:
        """The endpoint, fit for messages (no user information)."""
        url = self.settings.endpoint_url
        if url is None and self._client is not None:
            url = self._client.meta.endpoint_url
        return safe_endpoint(url) if url else "the S3 endpoint"

    # -- requests ------------------------------------------------------------------------------------------------
    def _check_up(self, where: str) -> None:
        """Fail at once while the endpoint is known to be down, or the object ``where`` silent (``DOWN_SECONDS``
        after it last was)."""
        for got in (self._down, self._silent.get(where)):
            if got is not None:
                until, why = got
                if time.monotonic() < until:
                    raise StorageError(where, f"{why}; not asked again for {until - time.monotonic():.0f} s",
                                       "unreachable")
        if self._down is not None and time.monotonic() >= self._down[0]:
            self._down = None

    def _failed(self, err: Exception, cause: Exception | None = None) -> Exception:
        """Remember an unreachable or silent endpoint (``_check_up``); returns ``err``.

        The endpoint is down when it cannot be connected to (``cause`` a connection failure or a connect timeout),
        or when a second object within ``DOWN_SECONDS`` got no answer. An answer that does not come for one object
        (a read timeout) makes only that object's requests fail at once: a stalled or hostile key must not fail
        the reads of every other file of a mount."""
        if not isinstance(err, StorageError) or err.kind not in ("unreachable", "timeout"):
            return err
        now = time.monotonic()
        until = now + DOWN_SECONDS
        if err.kind == "unreachable" or type(cause).__name__ != "ReadTimeoutError":
            self._down = (until, err.problem)
            return err
        with self._lock:
            silent = {w: got for w, got in self._silent.items() if got[0] > now and w != err.path}
            if silent:  # a second silent object: the endpoint itself does not answer
                self._down = (until, err.problem)
            silent[err.path] = (until, err.problem)
            self._silent = silent
        return err

    def head(self, bucket: str, key: str) -> ObjectInfo | None:
        """The object's size, ETag and time; None when there is no such object."""
        where = f"s3://{bucket}/{key}"
        self._check_up(where)
        try:
            r = self.client.head_object(Bucket=bucket, Key=key)
        except Exception as e:  # noqa: BLE001 - every botocore failure is translated
            err = self._failed(self._translate(e, where, bucket, key=key), e)
            if isinstance(err, StorageError) and err.kind == "missing" and "bucket" not in err.problem:
                return None
            if _status(e) in (400, 403) and _code(e) in ("", "400", "403", "BadRequest", "Forbidden"):
                err = self._why_head_failed(bucket, key, err)
            raise err from None
        return ObjectInfo(key, int(r.get("ContentLength", 0)), _etag(r.get("ETag")), _mtime_ns(r.get("LastModified")))

    def _why_head_failed(self, bucket: str, key: str, err: Exception) -> Exception:
        """A HEAD's error answer has no body, so no error code (an expired token reads "400" or "403"): the error of
        a GET of the object's first byte, which has one, when it is about the credentials; else ``err``."""
        try:
            r = self.client.get_object(Bucket=bucket, Key=key, Range="bytes=0-0")
        except Exception as e:  # noqa: BLE001
            why = self._translate(e, f"s3://{bucket}/{key}", bucket, key=key)
            return why if isinstance(why, StorageError) and why.kind == "credentials" else err
        r["Body"].close()
        return err

    def get(self, bucket: str, key: str, *, start: int | None = None, end: int | None = None,
            etag: str | None = None, into: memoryview | list | None = None, max_bytes: int | None = None,
            on_filled: Callable[[int], None] | None = None) -> GetResult:
        """Bytes ``[start, end)`` of an object (all of it without a range), only if its ETag is still ``etag``
        (``SourceChangedError`` otherwise): into ``into`` when given (a buffer, or a list of buffers filled end to end;
        the count is returned), else as bytes. ``on_filled(k)``: buffer ``into[k]`` of a ranged read's list is whole,
        called as soon as it is (the caller may hand it out while the rest arrives); a body cut short and asked for
        again is asked for from the first buffer not whole, so a buffer handed out is never written again.

        Every body is read with a bound known before reading it: a range's length, or ``max_bytes`` for a whole object
        (required: a whole object is never read without one). An answer whose ``Content-Length`` is over the bound is
        refused before its body is read; one without ``Content-Length`` (chunked) is read ``BODY_STEP`` bytes at a
        time and refused as soon as it passes the bound."""
        where = f"s3://{bucket}/{key}"
        kw = {"Bucket": bucket, "Key": key}
        if start is not None:
            if end is None or end <= start:
                raise ValueError(f"empty range [{start}, {end})")
            kw["Range"] = f"bytes={start}-{end - 1}"
        elif max_bytes is None:
            raise ValueError(f"{where}: a whole object is read only with a bound (max_bytes)")
        if etag:
            etag = normal_etag(etag)
            kw["IfMatch"] = if_match(etag)
        bufs = into if isinstance(into, list) and start is not None else None
        whole = [0, 0]  # buffers of a ranged read's list filled whole (never written again), and their bytes

        def filled(k: int) -> None:
            whole[0], whole[1] = k + 1, whole[1] + len(memoryview(bufs[k]).cast("B"))
            if on_filled is not None:
                on_filled(k)
        for attempt in range(BODY_RETRIES + 1):
            if whole[0]:  # asked again: from the first buffer not whole (only a ranged read's list counts them)
                kw["Range"] = f"bytes={start + whole[1]}-{end - 1}"
            self._check_up(where)
            try:
                r = self.client.get_object(**kw)
            except Exception as e:  # noqa: BLE001
                raise self._failed(self._translate(e, where, bucket, etag, key=key), e) from None
            length = int(r["ContentLength"]) if r.get("ContentLength") is not None else -1  # -1: chunked
            want = None if start is None else end - start - whole[1]
            if want is not None and length != want:
                r["Body"].close()
                raise StorageError(where, f"the endpoint answered {length} bytes for a range of {want}", "refused")
            if max_bytes is not None and length > max_bytes:
                r["Body"].close()
                raise StorageError(where, f"object of {length} bytes, more than the {max_bytes} read whole",
                                   "refused")
            info = ObjectInfo(key, _total_size(r, max(length, 0)), _etag(r.get("ETag")), _mtime_ns(r.get("LastModified")))
            if etag and info.etag and not same_etag(info.etag, etag):  # an endpoint that ignores If-Match
                r["Body"].close()
                raise SourceChangedError(where, f"the object changed since it was opened (ETag {etag} is now "
                                                f"{info.etag}); remount to serve the new version")
            try:
                if into is None:
                    bound = want if want is not None else max_bytes
                    held = _read_bounded(r["Body"], bound)  # joined only once known to be within the bound
                    got = sum(map(len, held))
                    if got > bound:
                        raise StorageError(where, f"the endpoint sent more than {bound} bytes (no Content-Length): "
                                                  "refused, not read further", "refused")
                    data = b"".join(held)
                    del held
                    if length < 0:
                        length = got
                else:
                    first, skip = whole
                    got = skip + _read_into(r["Body"], bufs[first:] if bufs is not None else into, length,
                                            (lambda k: filled(first + k)) if bufs is not None else None)
                    data, length = None, length + skip
            except StorageError:
                r["Body"].close()
                raise
            except Exception as e:  # noqa: BLE001 - a body cut short: ask again (bounded)
                if attempt < BODY_RETRIES:
                    time.sleep(min(2.0, 0.1 * 2 ** attempt) * random.random())
                    continue
                raise self._failed(self._translate(e, where, bucket, etag, key=key), e) from None
            if got != length:
                if attempt < BODY_RETRIES:
                    continue
                raise StorageError(where, f"the endpoint sent {got} of {length} bytes", "failed")
            return GetResult(data, length, info, r.get("Metadata") or {})
        raise AssertionError("unreachable")

    def list(self, bucket: str, prefix: str, *, delimiter: str | None = "/", max_keys: int | None = None) -> Listing:
        """Every object under ``prefix`` (one request per 1,000 keys) and, with ``delimiter``, the sub-prefixes;
        ``max_keys``: stop after that many entries (one page when it is at most 1,000)."""
        where = f"s3://{bucket}/{prefix}"
        kw = {"Bucket": bucket, "Prefix": prefix}
        if delimiter:
            kw["Delimiter"] = delimiter
        if max_keys is not None:
            kw["MaxKeys"] = min(1000, max_keys)
        objects, prefixes, pages = [], [], 0
        while True:
            self._check_up(where)
            try:
                r = self.client.list_objects_v2(**kw)
            except Exception as e:  # noqa: BLE001
                raise self._failed(self._translate(e, where, bucket), e) from None
            pages += 1
            for o in r.get("Contents") or ():
                objects.append(ObjectInfo(o["Key"], int(o.get("Size", 0)), _etag(o.get("ETag")),
                                          _mtime_ns(o.get("LastModified"))))
            prefixes += [p["Prefix"] for p in r.get("CommonPrefixes") or ()]
            token = r.get("NextContinuationToken")
            if not r.get("IsTruncated") or not token or (max_keys is not None
                                                          and len(objects) + len(prefixes) >= max_keys):
                return Listing(objects, prefixes, pages)
            kw["ContinuationToken"] = token

    def check_bucket(self, bucket: str) -> None:
        """``StorageError`` when the bucket does not exist or cannot be read with these credentials."""
        self._check_up(f"s3://{bucket}")
        try:
            self.client.head_bucket(Bucket=bucket)
        except Exception as e:  # noqa: BLE001
            raise self._failed(self._translate(e, f"s3://{bucket}", bucket), e) from None

    # -- errors --------------------------------------------------------------------------------------------------
    def _translate(self, e: Exception, where: str, bucket: str, etag: str | None = None, *,
                   key: str | None = None) -> Exception:
        """A botocore failure as one line (``StorageError``, or ``SourceChangedError`` for a refused If-Match);
        ``key``: the object the call was about (None: the bucket), for the permission an access denied names."""
        if isinstance(e, (StorageError, SourceChangedError)):
            return e
        name = type(e).__name__
        response = getattr(e, "response", None)
        if isinstance(response, dict):  # the endpoint answered with an error
            err = response.get("Error") or {}
            code = str(err.get("Code") or "")
            status = int((response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
            if code in ("PreconditionFailed", "412") or status == 412:
                return SourceChangedError(where, f"the object changed since it was opened (its ETag is no longer "
                                                 f"{etag}); remount to serve the new version")
            if code == "NoSuchBucket":
                return StorageError(f"s3://{bucket}", "no such bucket", "missing")
            if code in ("NoSuchKey", "NotFound", "404") or status == 404:
                return StorageError(where, "no such object", "missing")
            if code in CREDENTIAL_CODES:
                return StorageError(where, credentials_problem(code, self.settings.profile), "credentials")
            if code in ("AccessDenied", "AllAccessDisabled", "403", "Forbidden") or status == 403:
                return StorageError(where, denied_problem(getattr(e, "operation_name", None), bucket, key,
                                                          code or str(status)), "denied")
            if code == "InvalidRange" or status == 416:
                return StorageError(where, "the endpoint refused the byte range (the object is shorter than "
                                           "listed)", "refused")
            attempts = int((response.get("ResponseMetadata") or {}).get("RetryAttempts") or 0) + 1
            return StorageError(where, f"the endpoint answered {status or '?'} {code or 'with an error'}"
                                       + (f" (after {attempts} attempts)" if attempts > 1 else ""), "failed")
        if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                    "UnknownCredentialError"):
            return StorageError(where, "no usable AWS credentials (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                                       "or name a profile of ~/.aws with --profile or AWS_PROFILE)", "credentials")
        if name == "ProfileNotFound":
            return StorageError(where, profile_problem(self.settings.profile), "credentials")
        if name in SSO_ERRORS:
            return StorageError(where, sso_problem(self.settings.profile), "credentials")
        if name in _TIMEOUT:
            return StorageError(where, f"no answer from {self.endpoint} within the timeouts "
                                       f"({ATTEMPTS} attempts)", "timeout")
        if name in _UNREACHABLE or isinstance(e, ConnectionError):
            return StorageError(where, f"cannot reach {self.endpoint} ({ATTEMPTS} attempts)", "unreachable")
        if name in ("ResponseStreamingError", "IncompleteReadError", "ProtocolError"):
            return StorageError(where, f"the connection to {self.endpoint} broke while reading", "unreachable")
        if name == "ParamValidationError":
            return StorageError(where, "not a valid bucket or key for S3", "refused")
        return StorageError(where, f"S3 request failed ({name})", "failed")


def _status(e: Exception) -> int:
    """The HTTP status of a botocore error answer (0 for a failure without one)."""
    response = getattr(e, "response", None)
    return int(((response or {}).get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0) \
        if isinstance(response, dict) else 0


def _code(e: Exception) -> str:
    """The error code of a botocore error answer ('' without one)."""
    response = getattr(e, "response", None)
    return str(((response or {}).get("Error") or {}).get("Code") or "") if isinstance(response, dict) else ""


def _read_into(body, into, length: int, filled: Callable[[int], None] | None = None) -> int:
    """Copy an answer's first ``length`` bytes into ``into`` (a buffer or a list of buffers, end to end),
    ``BODY_STEP`` bytes at a time: the bytes that arrived (fewer when the answer was cut short); ``filled(k)`` once
    buffer ``k`` of a list is whole. Reading the body whole first would hold the answer twice (and, for a part cut
    out of it, three times) at its peak."""
    got = 0
    for k, buf in enumerate(into if isinstance(into, list) else [into]):
        view = memoryview(buf).cast("B")
        part = view[:max(0, length - got)]
        pos = 0
        while pos < len(part):
            n = body.readinto(part[pos:pos + BODY_STEP])
            if not n:
                return got + pos
            pos += n
        got += pos
        if filled is not None and pos == len(view):
            filled(k)
    return got


def _read_bounded(body, bound: int) -> list:
    """At most ``bound + 1`` bytes of an answer's body, as the pieces read (``BODY_STEP`` bytes at a time; a growing
    buffer would be copied as it grows): one byte more than ``bound`` tells the caller that the body is over it,
    without reading (or holding) the rest."""
    pieces, got = [], 0
    while got <= bound:
        piece = body.read(min(BODY_STEP, bound + 1 - got))
        if not piece:
            break
        pieces.append(piece)
        got += len(piece)
    return pieces


def _total_size(r: dict, length: int) -> int:
    """The whole object's size: from ``Content-Range`` (``bytes a-b/total``) for a ranged answer."""
    rng = r.get("ContentRange")
    if isinstance(rng, str) and "/" in rng:
        tail = rng.rsplit("/", 1)[1]
        if tail.isdigit():
            return int(tail)
    return length


_clients: dict = {}
_clients_lock = threading.Lock()


def client_for(settings: S3Settings) -> S3Client:
    """The process's client for ``settings`` and the ``AWS_*`` environment boto3 reads (endpoint, profile,
    credentials): made once for each, its botocore client on first use. A program that points the environment at another
    endpoint between two opens gets a client for that endpoint, not the first one's."""
    key = (settings, aws_environment())
    with _clients_lock:
        c = _clients.get(key)
        if c is None:
            c = _clients[key] = S3Client(settings)
        return c
