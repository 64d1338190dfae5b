"""Where a checkpoint argument points: a local path or an ``s3://`` location (with the settings to reach it)."""
from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from .s3url import BadS3Url, S3Location, S3Settings, is_s3_url, parse_s3_url


def locate(value, settings: S3Settings | None = None) -> Path | S3Location:
    """``value`` (a text, a path or a location) as a ``Path`` or an ``S3Location`` read with ``settings``;
    ``CheckpointError`` for an ``s3://`` text that names no bucket."""
    if isinstance(value, S3Location):
        return value
    if is_s3_url(value):
        try:
            return parse_s3_url(value, settings)
        except BadS3Url as e:
            raise CheckpointError(value, str(e)) from None
    return Path(value)


def folder_of(location, allowed=()):
    """The storage folder of a local directory (links out of it refused unless into ``allowed`` folders) or an S3
    prefix."""
    if isinstance(location, S3Location):
        from .s3folder import S3Folder

        return S3Folder(location)
    from .local import LocalFolder

    return LocalFolder(location, allowed)


def local_folder(path) -> Path | None:
    """The local folder holding the checkpoint at ``path``; None for a checkpoint in S3 (it has no local folder)."""
    return None if is_s3_url(path) else Path(path).parent
