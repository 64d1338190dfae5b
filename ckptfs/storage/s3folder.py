"""A prefix of an S3 bucket as a ``Folder``: its objects and sub-prefixes listed (one request per 1,000 entries),
an object stat'ed (HEAD), opened as an ``S3Object`` or read as a small text.

Entries are the objects directly under the prefix (``is_file``, with size, time and ETag as ``version``) and its
sub-prefixes (``is_file`` False, nothing else known without listing them). Failures are ``OSError`` with the one-line
problem (the ``Folder`` interface's contract), never a credential.
"""
from __future__ import annotations

from ..errors import StorageError
from .base import Folder, FolderEntry
from .s3client import ObjectInfo, client_for
from .s3object import PartPool, S3Object
from .s3url import S3Location


def _entry(name: str, o: ObjectInfo) -> FolderEntry:
    return FolderEntry(name, True, o.size, o.mtime_ns, o.etag)


class S3Folder(Folder):
    """The objects of ``location`` taken as a folder (``location.prefix``); the objects it opens read their parts
    through ``parts`` (its owner's pool; None: each object its own)."""

    def __init__(self, location: S3Location, parts: PartPool | None = None):
        self.location = location
        self.parts = parts
        self.name = str(location)
        self.client = client_for(location.settings)

    def entries(self, match=None) -> list:
        try:
            listing = self.client.list(self.location.bucket, self.location.prefix, delimiter="/")
        except StorageError as e:
            raise OSError(str(e)) from None
        n = len(self.location.prefix)
        out = [_entry(o.key[n:], o) for o in listing.objects if o.key[n:]]
        out += [FolderEntry(p[n:].rstrip("/"), False) for p in listing.prefixes if p[n:].rstrip("/")]
        return [e for e in out if match is None or match(e.name)]

    def all_entries(self) -> list:
        """Every object under the prefix, those in sub-prefixes too (named by their path below it)."""
        try:
            listing = self.client.list(self.location.bucket, self.location.prefix, delimiter=None)
        except StorageError as e:
            raise OSError(str(e)) from None
        n = len(self.location.prefix)
        return [_entry(o.key[n:], o) for o in listing.objects if o.key[n:]]

    def stat(self, name: str) -> FolderEntry | None:
        try:
            info = self.client.head(self.location.bucket, self.location.child_key(name))
        except StorageError as e:
            raise OSError(str(e)) from None
        return None if info is None else _entry(name, info)

    def open(self, name: str) -> S3Object:
        entry = self.stat(name)
        if entry is None:
            raise FileNotFoundError(f"{self.location / name}: no such object")
        return S3Object(self.client, self.location.bucket, self.location.child_key(name), entry.size, entry.version,
                        entry.mtime_ns, pool=self.parts)

    def read_text(self, name: str, limit: int = 1 << 16) -> str:
        blob = self.open(name)
        try:
            return blob.read(0, min(limit, blob.size)).decode("utf-8", "replace")
        except StorageError as e:
            raise OSError(str(e)) from None

    def folder(self, name: str) -> "S3Folder":
        return S3Folder(self.location / name, self.parts)
