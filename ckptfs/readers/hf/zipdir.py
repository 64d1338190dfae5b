"""The directory of a zip file (a ``torch.save`` archive), decoded from its bytes: pure functions, no I/O.

Only what reading a stored (uncompressed) member by byte range needs: the end-of-central-directory record (zip64
included), the central directory's entries (name, method, sizes, flags, local header offset; zip64 extra fields
honoured) and a local header (where the member's data starts: torch pads local headers so that data is 64-byte
aligned). Every count, size and offset is checked against the file's size, so a crafted directory cannot claim
more entries or bytes than the file holds.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

EOCD_SIG = 0x06054B50
EOCD64_SIG = 0x06064B50
LOCATOR64_SIG = 0x07064B50
CENTRAL_SIG = 0x02014B50
LOCAL_SIG = 0x04034B50

EOCD_SIZE = 22
LOCATOR64_SIZE = 20
EOCD64_SIZE = 56
CENTRAL_SIZE = 46
LOCAL_SIZE = 30
#: the bytes at the end of a file that can hold the end record (its comment is at most 65,535 bytes)
TAIL_SIZE = EOCD_SIZE + 0xFFFF + LOCATOR64_SIZE + EOCD64_SIZE

#: bounds on what a directory may claim (a 100,000-tensor checkpoint has ~8 MB of directory)
MAX_ENTRIES = 2_000_000
MAX_DIRECTORY_BYTES = 512 << 20


class ZipFormatError(ValueError):
    """Bytes that are not the zip structure they should be; one line."""


@dataclass(frozen=True)
class DirectoryLocation:
    offset: int  # of the central directory in the file
    size: int
    entries: int


@dataclass(frozen=True)
class CentralEntry:
    name: str
    method: int  # 0 = stored
    flags: int
    crc32: int
    compressed_size: int
    size: int
    header_offset: int  # of the member's local header


def locate_directory(tail: bytes, file_size: int) -> DirectoryLocation:
    """Where the central directory is, from the last ``len(tail)`` bytes of a ``file_size``-byte file (``tail``
    should be ``min(TAIL_SIZE, file_size)`` bytes)."""
    base = file_size - len(tail)
    i = tail.rfind(struct.pack("<I", EOCD_SIG))
    while i >= 0 and len(tail) - i >= EOCD_SIZE:
        (_, disk, cd_disk, n_here, n_total, cd_size, cd_off, comment_len) = struct.unpack_from("<IHHHHIIH", tail, i)
        if i + EOCD_SIZE + comment_len == len(tail):  # the record whose comment ends the file
            break
        i = tail.rfind(struct.pack("<I", EOCD_SIG), 0, i)
    else:
        raise ZipFormatError("not a zip file (no end-of-central-directory record)")
    if disk or cd_disk or n_here != n_total:
        raise ZipFormatError("a multi-disk zip file")
    if 0xFFFF in (n_total,) or 0xFFFFFFFF in (cd_size, cd_off):
        j = i - LOCATOR64_SIZE
        if j < 0:
            raise ZipFormatError("zip64 locator missing")
        sig, _, eocd64_off, _ = struct.unpack_from("<IIQI", tail, j)
        if sig != LOCATOR64_SIG:
            raise ZipFormatError("zip64 locator missing")
        k = eocd64_off - base
        if k < 0 or k + EOCD64_SIZE > j:
            raise ZipFormatError(f"zip64 end record at {eocd64_off} lies outside the file's tail")
        (sig, _, _, _, disk, cd_disk, n_here, n_total, cd_size, cd_off) = struct.unpack_from("<IQHHIIQQQQ", tail, k)
        if sig != EOCD64_SIG:
            raise ZipFormatError("zip64 end record has a bad signature")
        if disk or cd_disk or n_here != n_total:
            raise ZipFormatError("a multi-disk zip file")
    if n_total > MAX_ENTRIES:
        raise ZipFormatError(f"{n_total} entries (at most {MAX_ENTRIES})")
    if cd_size > MAX_DIRECTORY_BYTES or cd_off + cd_size > file_size or cd_size < n_total * CENTRAL_SIZE:
        raise ZipFormatError(f"central directory of {cd_size} bytes at {cd_off} does not fit the "
                             f"{file_size}-byte file and its {n_total} entries")
    return DirectoryLocation(cd_off, cd_size, n_total)


def _zip64_extra(extra: bytes, size: int, csize: int, offset: int) -> tuple:
    """The real sizes and offset of an entry whose 32-bit fields say 0xFFFFFFFF (zip64 extra field 0x0001)."""
    p = 0
    while p + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, p)
        body = extra[p + 4:p + 4 + n]
        p += 4 + n
        if tag != 1:
            continue
        q = 0
        vals = []
        for v in (size, csize, offset):
            if v == 0xFFFFFFFF:
                if q + 8 > len(body):
                    raise ZipFormatError("zip64 extra field is too short")
                vals.append(struct.unpack_from("<Q", body, q)[0])
                q += 8
            else:
                vals.append(v)
        return tuple(vals)
    if 0xFFFFFFFF in (size, csize, offset):
        raise ZipFormatError("zip64 sizes without a zip64 extra field")
    return size, csize, offset


def parse_directory(data: bytes, loc: DirectoryLocation, file_size: int) -> list[CentralEntry]:
    """The entries of the central directory ``data`` (``loc.size`` bytes read at ``loc.offset``)."""
    if len(data) != loc.size:
        raise ZipFormatError("central directory is truncated")
    out = []
    p = 0
    for _ in range(loc.entries):
        if p + CENTRAL_SIZE > len(data):
            raise ZipFormatError("central directory ends inside an entry")
        (sig, _, _, flags, method, _, _, crc, csize, size, name_len, extra_len, comment_len, _, _, _,
         offset) = struct.unpack_from("<IHHHHHHIIIHHHHHII", data, p)
        if sig != CENTRAL_SIG:
            raise ZipFormatError(f"central directory entry at {loc.offset + p} has a bad signature")
        end = p + CENTRAL_SIZE + name_len + extra_len + comment_len
        if end > len(data):
            raise ZipFormatError("central directory ends inside an entry")
        raw_name = data[p + CENTRAL_SIZE:p + CENTRAL_SIZE + name_len]
        extra = data[p + CENTRAL_SIZE + name_len:p + CENTRAL_SIZE + name_len + extra_len]
        size, csize, offset = _zip64_extra(extra, size, csize, offset)
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            name = raw_name.decode("cp437")
        if offset + LOCAL_SIZE > loc.offset:
            raise ZipFormatError(f"member {name!r}: local header at {offset} overlaps the central directory")
        out.append(CentralEntry(name, method, flags, crc, csize, size, offset))
        p = end
    return out


def local_data_offset(header: bytes, entry: CentralEntry) -> int:
    """Where ``entry``'s data starts, from the first ``LOCAL_SIZE + len(name)`` bytes of its local header."""
    if len(header) < LOCAL_SIZE:
        raise ZipFormatError(f"member {entry.name!r}: local header is truncated")
    sig, _, flags, method, _, _, _, _, _, name_len, extra_len = struct.unpack_from("<IHHHHHIIIHH", header, 0)
    if sig != LOCAL_SIG:
        raise ZipFormatError(f"member {entry.name!r}: local header has a bad signature")
    if method != entry.method:
        raise ZipFormatError(f"member {entry.name!r}: local and central headers disagree on the method")
    name = header[LOCAL_SIZE:LOCAL_SIZE + name_len]
    if name != entry.name.encode("utf-8") and name != entry.name.encode("cp437", "replace"):
        raise ZipFormatError(f"member {entry.name!r}: local header names {name[:80]!r}")
    return entry.header_offset + LOCAL_SIZE + name_len + extra_len
