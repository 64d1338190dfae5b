"""ETags as S3 clients compare them: one spelling for every ETag ckptfs keeps, whatever the endpoint sent.

S3 sends an ETag in quotes (``"d9586e…"``) in a HEAD's and a GET's ``ETag`` header and in a listing's ``<ETag>``;
S3-compatible servers differ (``rclone serve s3`` lists it bare and sends it quoted on a GET; a proxy may mark it weak,
``W/"…"``). Two spellings of one ETag name the same version: ``normal_etag`` keeps the opaque part only (no
surrounding spaces, no ``W/`` prefix, no quotes), which is what ckptfs stores, shows and digests; ``same_etag`` is the
one comparison; ``if_match`` spells an ETag for an ``If-Match`` header (quoted, as HTTP wants it).
"""
from __future__ import annotations


def normal_etag(value) -> str:
    """The opaque part of an ETag however it is spelled: ``W/"abc"``, ``"abc"``, ``abc`` -> ``abc`` ('' for None)."""
    text = str(value or "").strip()
    if text[:2] in ("W/", "w/"):
        text = text[2:].lstrip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        text = text[1:-1]
    return text


def same_etag(a, b) -> bool:
    """Whether two ETags name the same version (``normal_etag`` of both equal)."""
    return normal_etag(a) == normal_etag(b)


def if_match(etag) -> str:
    """``etag`` as an ``If-Match`` header value: the opaque part in quotes."""
    return f'"{normal_etag(etag)}"'
