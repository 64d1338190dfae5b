"""The params YAML of a checkpoint in S3, found beside it in the bucket as it is found beside a local checkpoint, and
fetched into ckptfs's cache folder so that everything that reads params reads it as a local file.

Candidates, in the order of a local checkpoint (``mapping.params.candidate_files``): ``<stem>.yaml`` and
``params*.yaml`` beside the checkpoint, ``train/params_train.yaml`` there and one level up, ``configs/*.yaml``. The
first one that exists is fetched (at most ``MAX_BYTES``, by its ETag) to ``<cache>/s3-params/<digest>/<its name>``,
where the digest names the endpoint, bucket, key and ETag: a mount of the same params finds the same file (and the
same content identity, which keys cached zip CRCs); another version gets another folder. Costs one listing of the
checkpoint's folder, at most two HEADs and the GET.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..errors import StorageError
from ..storage.s3client import client_for
from ..storage.s3url import S3Location, safe_endpoint

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
    if _own_regular_file(target):
        return target, loc
    data = client.get(loc.bucket, loc.key, etag=etag, max_bytes=MAX_BYTES).data
    _write_private(folder, target, data)
    return target, loc


def _own_regular_file(path: Path) -> bool:
    """A regular file (not a link) of this user's: a copy written before."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    import stat as stat_mod

    return stat_mod.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def _write_private(folder: Path, target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` in a folder of this user's only, never through a link (a new file renamed into
    place)."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(folder)
    except OSError as e:
        raise StorageError(folder, f"cannot create the params cache folder ({e.strerror or e})") from None
    import stat as stat_mod

    if not stat_mod.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise StorageError(folder, "the params cache folder is not a directory of this user's: not written")
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
        ckpt.warnings.append(f"params: {where} (fetched to {local})")
    return local
