"""What an ``s3://bucket/key`` location is — an object, a checkpoint in Cerebras' S3 layout, or a run — told apart by
what is there, at the cost of one HEAD and one listing at most (``classify``; ``open.py`` says what each is and how it
is read).

Nothing here imports the readers of what it finds (h5py, numpy): a command learns what a location is with the
storage layer alone, so its first request leaves as soon as the S3 client is made (docs/measurements.md, "An S3
command's start").
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import CheckpointError, StorageError
from ...storage.s3client import ObjectInfo, client_for
from ...storage.s3url import S3Location, parse_s3_url
from ..run.resolve import checkpoint_name
from ..run.scan import parse_name

#: the object of a checkpoint in Cerebras' S3 layout that holds everything but the tensors (written last)
METADATA = "__METADATA__"

OBJECT, LAYOUT, RUN = "object", "layout", "run"


@dataclass
class S3Target:
    """What a location holds: ``kind`` (OBJECT, LAYOUT or RUN), the object (OBJECT) or the prefix's objects by name
    (LAYOUT), and the checkpoint entries of a run (RUN: names of ``checkpoint_*`` objects and prefixes)."""

    kind: str
    location: S3Location
    info: ObjectInfo | None = None
    objects: dict | None = None
    requests: int = 0


def as_location(path) -> S3Location:
    if isinstance(path, S3Location):
        return path
    try:
        return parse_s3_url(str(path))
    except ValueError as e:
        raise CheckpointError(path, str(e)) from None


def classify(path) -> S3Target:
    """What ``path`` (an ``s3://`` location) is; ``CheckpointError`` when it is nothing ckptfs reads, or the
    endpoint refuses (one line: missing bucket, access denied, credentials, unreachable)."""
    loc = as_location(path)
    client = client_for(loc.settings)
    try:
        requests, denied = 0, None
        if loc.key:
            requests += 1
            try:
                info = client.head(loc.bucket, loc.key)
            except StorageError as e:  # a HEAD's 403 has no body to say why: the listing below will
                if e.kind != "denied":
                    raise
                info, denied = None, e
            if info is not None:
                return S3Target(OBJECT, loc, info=info, requests=requests)
        listing = client.list(loc.bucket, loc.prefix, delimiter="/")
        if denied is not None and not listing.objects and not listing.prefixes:
            raise denied
        requests += listing.requests
        direct = {o.key[len(loc.prefix):]: o for o in listing.objects}
        subs = [p[len(loc.prefix):].rstrip("/") for p in listing.prefixes]
        if METADATA in direct:
            if listing.prefixes:  # keys with '/' in their names: list the prefix whole
                whole = client.list(loc.bucket, loc.prefix, delimiter=None)
                requests += whole.requests
                direct = {o.key[len(loc.prefix):]: o for o in whole.objects}
            return S3Target(LAYOUT, loc, objects=direct, requests=requests)
        if any(_is_checkpoint_name(n) for n in list(direct) + subs):
            return S3Target(RUN, loc, requests=requests)
        if direct or subs:
            if checkpoint_name(loc.name) is not None:  # tensor objects without __METADATA__: a save in progress
                return S3Target(LAYOUT, loc, objects=direct, requests=requests)
            raise CheckpointError(loc, "neither a checkpoint (an object, or a prefix holding __METADATA__) nor a "
                                       "run (a prefix holding checkpoint_<step>.mdl)")
        client.check_bucket(loc.bucket)
    except StorageError as e:
        raise CheckpointError(e.path, e.problem) from None
    raise CheckpointError(loc, "no such object or prefix")


def _is_checkpoint_name(name: str) -> bool:
    return parse_name(name) is not None
