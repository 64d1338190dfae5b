"""Tokenizer files beside a checkpoint in S3, found as a local checkpoint's are (``ckptfs.views.hf.overlay``) and served
from the bucket by range, exactly the version listed.

Places, in the order of a local checkpoint's: a location the params YAML names (an ``s3://`` URL, or a key relative
to the params file's folder), the checkpoint's folder (the prefix holding the ``.mdl`` object or the S3-layout
prefix), its ``tokenizer/`` folder, then the params file's folder and its ``tokenizer/`` folder. The first place
holding any of ``overlay.TOKENIZER_FILES`` gives them all.

* confinement: a place is read only when it lies in the checkpoint's folder or the params file's folder, in the
  checkpoint's bucket (S3 has no links to follow; a named location elsewhere, or with ``..`` in it, only gets a
  hint), and only objects named as tokenizer files directly in it are served;
* bounded: a listing of at most ``MAX_LISTED`` entries per place (a larger folder is asked for the tokenizer names
  one by one, a HEAD each), and files of at most ``MAX_FILE_BYTES`` (a larger one is left out with a note);
* read by range like every S3 file (``S3Object``: ranged GETs naming the ETag listed, ``If-Match``), never fetched
  whole — a file replaced since the mount fails its reads (EIO) instead of serving bytes of another version.
"""
from __future__ import annotations

from dataclasses import dataclass

from ckptfs.errors import CkptfsError, StorageError
from ckptfs.guard.safe_yaml import load_params_yaml
from ckptfs.storage.s3client import client_for
from ckptfs.storage.s3object import S3Object
from ckptfs.storage.s3url import BadS3Url, S3Location, is_s3_url, parse_s3_url
from ckptfs.layouts.file import VirtualFile
from ckptfs.views.hf.tokenizer_files import TOKENIZER_FILES, named_in_params

#: a tokenizer file in a bucket larger than this is not served (the largest published tokenizer.json files are a few
#: tens of MB)
MAX_FILE_BYTES = 128 << 20
#: places the params YAML names that are looked at, at most
MAX_NAMED = 8
#: entries listed per place at most; a larger folder is asked for each tokenizer file name instead
MAX_LISTED = 10_000


class S3TokenizerFile(VirtualFile):
    """One tokenizer object served by range: exactly the version (ETag) listed when the view was built."""

    def __init__(self, blob: S3Object, origin: str):
        self.blob = blob
        self.size = blob.size
        self.origin = origin  # where it came from, for README.txt
        self.stamp = f"{blob.name}@{blob.etag}"  # what an export record keys on (``tree.assemble.tree_identity``)

    @property
    def name(self) -> str:
        return self.blob.name

    def readinto(self, offset: int, out: memoryview, cursor=None) -> int:
        got, _ = self.blob.read_into(out, offset, len(out))
        if got != len(out):
            raise StorageError(self.blob.name, f"the object ended at byte {offset + got}, before the {self.size} "
                                               "listed: remount to serve the new version", "refused")
        return got


@dataclass(frozen=True)
class Place:
    """A folder (or, named by the params, one object) where tokenizer files are looked for, and how README.txt
    calls it."""

    location: S3Location
    where: str
    is_file: bool = False


def _inside(loc: S3Location, folders: list) -> bool:
    return any(loc.bucket == f.bucket and (f.key == "" or loc.key == f.key or loc.key.startswith(f.prefix))
               for f in folders)


def _named_places(params_local, params_location: S3Location | None, settings) -> tuple:
    """([Place], [hints]) of the tokenizer locations the params YAML (its local copy) names: an ``s3://`` URL, or a
    key relative to the params file's folder in the bucket (absolute local paths are the local discovery's)."""
    if params_local is None or params_location is None:
        return [], []
    try:
        doc = load_params_yaml(params_local)  # bounded: size, aliases
    except CkptfsError:
        return [], []
    named: list = []
    named_in_params(doc, named)
    places, hints = [], []
    for key, value in named:
        value = value.strip()
        if is_s3_url(value):
            try:
                loc = parse_s3_url(value, settings)
            except BadS3Url:
                continue
        elif value and not value.startswith(("/", "~", "$")):
            while value.startswith("./"):
                value = value[2:]
            loc = params_location.parent / value
        else:
            continue
        if ".." in loc.key.split("/") or "." in loc.key.split("/"):
            hints.append(f"params {key} names {value!r}: a key with '.' or '..' in it is not followed in a bucket")
            continue
        places.append(Place(loc, f"{loc} (params {key})", is_file=loc.name in TOKENIZER_FILES))
    return places[:MAX_NAMED], hints


def _files_in(client, place: Place) -> dict:
    """{tokenizer file name: ObjectInfo} directly in ``place`` (a folder), or the one object it names."""
    loc = place.location
    if place.is_file:
        info = client.head(loc.bucket, loc.key)
        return {} if info is None else {loc.name: info}
    listing = client.list(loc.bucket, loc.prefix, delimiter="/", max_keys=MAX_LISTED)
    if len(listing.objects) + len(listing.prefixes) < MAX_LISTED:
        n = len(loc.prefix)
        return {o.key[n:]: o for o in listing.objects if o.key[n:] in TOKENIZER_FILES}
    found = {}
    for name in TOKENIZER_FILES:  # a folder too large to list: ask for each name
        info = client.head(loc.bucket, loc.child_key(name))
        if info is not None:
            found[name] = info
    return found


def discover_s3_tokenizer(ckpt: S3Location, params_local=None, params_location: S3Location | None = None,
                          parts=None) -> tuple:
    """({file name: S3TokenizerFile}, where, hints) for the checkpoint at ``ckpt`` (see the module docstring);
    ``params_local``: the local copy of its params file, fetched from ``params_location`` in the bucket. ``where`` is
    None when no place has any. ``parts``: the tree's pool (``storage.s3object.PartPool``) the files read through."""
    client = client_for(ckpt.settings)
    here = ckpt.parent
    roots = [here] + ([params_location.parent] if params_location is not None else [])
    places, hints = _named_places(params_local, params_location, ckpt.settings)
    places += [Place(here, f"{here}/ (the checkpoint's folder in the bucket)"),
               Place(here / "tokenizer", f"{here / 'tokenizer'}/")]
    if params_location is not None and params_location.parent != here:
        there = params_location.parent
        places += [Place(there, f"{there}/ (the params file's folder in the bucket)"),
                   Place(there / "tokenizer", f"{there / 'tokenizer'}/")]
    for place in places:
        if not _inside(place.location, roots):
            hints.append(f"tokenizer location {place.where} lies outside the checkpoint's and the params file's "
                         "folders: not read; give it with --overlay DIR")
            continue
        try:
            infos = _files_in(client, place)
        except StorageError as e:
            hints.append(f"tokenizer files in {place.where} not looked for: {e}")
            continue
        files = {}
        for name, info in sorted(infos.items()):
            key = place.location.key if place.is_file else place.location.child_key(name)
            if info.size > MAX_FILE_BYTES:
                hints.append(f"s3://{place.location.bucket}/{key} is larger than {MAX_FILE_BYTES >> 20} MiB "
                             f"({info.size:,} bytes): not served; give it with --overlay DIR")
                continue
            blob = S3Object(client, place.location.bucket, key, info.size, info.etag, info.mtime_ns, pool=parts)
            files[name] = S3TokenizerFile(blob, blob.name)
        if files:
            return files, place.where, hints
    return {}, None, hints
