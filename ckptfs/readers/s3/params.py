"""The params YAML of a checkpoint in S3, found beside it in the bucket as it is found beside a local checkpoint, and
fetched into ckptfs's cache folder so that everything that reads params reads it as a local file.

Candidates, in the order of a local checkpoint (``mapping.params.candidate_files``): ``<stem>.yaml`` and
``params*.yaml`` beside the checkpoint, ``train/params_train.yaml`` there and one level up, ``configs/*.yaml``. The
first one that exists is fetched (at most ``MAX_BYTES``, by its ETag) and kept as ``<cache>/s3-params/<digest>/<its
name>``, where the digest names the endpoint, bucket, key and ETag: a mount of the same params uses the same file
(and so the same content identity, which keys cached zip CRCs). The file is trusted for nothing: it is used only when
its bytes equal what was just fetched, else written again (in a folder of the user's own, never through a link).
Costs one listing of the checkpoint's folder, at most two HEADs and the GET.
"""
from __future__ import annotations

import hashlib
import os
import stat as stat_mod
from pathlib import Path

from ...errors import StorageError
from ...storage.s3client import client_for
from ...storage.s3url import S3Location, safe_endpoint

#: largest params file fetched (Model Zoo params are a few KB)
MAX_BYTES = 16 << 20


def candidates(location: S3Location) -> list:
    """``[(S3Location, ETag)]`` of the params files beside the checkpoint at ``location``, most specific first."""
    client = client_for(location.settings)
    here = location.parent
    listing = client.list(here.bucket, here.prefix, delimiter="/")
    files = {o.key[len(here.prefix):]: o for o in listing.objects}
    subs = {p[len(here.prefix):].rstrip("/") for p in listing.prefixes}
    names = [f"{location.stem}.yaml"] if f"{location.stem}.yaml" in files else []
    names += sorted((n for n in files if n.startswith("params") and n.endswith(".yaml")),
                    key=lambda n: (n != "params.yaml", n))
    out = [(here / n, files[n].etag) for n in dict.fromkeys(names)]
    tries = [here / "train" / "params_train.yaml"] if "train" in subs else []
    if here.key:
        tries.append(here.parent / "train" / "params_train.yaml")
    for loc in tries:
        info = client.head(loc.bucket, loc.key)
        if info is not None:
            out.append((loc, info.etag))
    if "configs" in subs:
        configs = client.list(here.bucket, (here / "configs").prefix, delimiter="/")
        out += [(S3Location(here.bucket, o.key, here.settings), o.etag) for o in sorted(configs.objects,
                                                                                     key=lambda o: o.key)
                if o.key.endswith(".yaml")]
    return out


def fetch_params(location: S3Location, cache: Path) -> tuple:
    """``(local copy, its S3 location)`` of the first params file beside the checkpoint at ``location``, or
    ``(None, None)``; ``StorageError`` when the bucket cannot be read."""
    found = candidates(location)
    if not found:
        return None, None
    loc, etag = found[0]
    client = client_for(location.settings)
    digest = hashlib.sha256("\0".join([safe_endpoint(client.settings.endpoint_url), loc.bucket, loc.key,
                                       etag]).encode()).hexdigest()[:32]
    folder = cache / "s3-params" / digest
    target = folder / loc.name
    data = client.get(loc.bucket, loc.key, etag=etag, max_bytes=MAX_BYTES).data
    if _private_chain(cache, folder) and _holds(target, data):
        return target, loc
    _write_private(folder, target, data)
    if not _private_chain(cache, folder):
        raise StorageError(folder, "the params cache folder can be changed by other users (a folder on the way is "
                                   "theirs, or writable by them without the sticky bit): not used")
    return target, loc


def _private_chain(cache: Path, folder: Path) -> bool:
    """Whether nobody but this user can replace what lies in ``folder`` below ``cache``: every folder from ``cache``
    down is a directory (not a link) of this user's that others cannot write to, and ``cache`` itself, if others
    can write to it, has the sticky bit (they cannot rename this user's entries)."""
    try:
        st = os.lstat(cache)
        if not stat_mod.S_ISDIR(st.st_mode) or (st.st_mode & 0o022 and not st.st_mode & stat_mod.S_ISVTX):
            return False
        for d in (cache / "s3-params", folder):
            st = os.lstat(d)
            if not stat_mod.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
                return False
    except OSError:
        return False
    return True


def _holds(path: Path, data: bytes) -> bool:
    """Whether ``path`` is a regular file of this user's (not a link) holding exactly ``data``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != len(data):
            return False
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(len(data) + 1) == data
    finally:
        os.close(fd)


def _write_private(folder: Path, target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` in a folder of this user's only, never through a link (a new file renamed into
    place)."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(folder)
    except OSError as e:
        raise StorageError(folder, f"cannot create the params cache folder ({e.strerror or e})") from None
    if not stat_mod.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise StorageError(folder, "the params cache folder is not a directory of this user's that only they can "
                                   "write to: not written")
    tmp = folder / f".{target.name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def params_for(ckpt, cache: Path) -> Path | None:
    """The local copy of the params file beside the S3 checkpoint ``ckpt`` (None when there is none, or the bucket
    cannot be read for it); a line in the checkpoint's warnings says where it came from, or why not."""
    try:
        local, where = fetch_params(ckpt.path, cache)
    except StorageError as e:
        ckpt.warnings.append(f"params beside the checkpoint not fetched: {e}")
        return None
    if local is not None:
        ckpt.notes.append(f"params: {where} (fetched to {local})")
        ckpt.params_location = where
    return local
