"""Opening objects of an HDF5 file without ever leaving that file.

HDF5 has its own indirections to other files, resolved by the HDF5 library against the *server's* working
directory and with no regard for where the checkpoint lives: external links (a name that opens an object of
another file), virtual datasets (data mapped from other files) and external raw storage (a dataset whose bytes
sit in named raw files). Cerebras never writes any of them; a crafted checkpoint could use them to serve any
file the mounting user can read, or to block the server on a FIFO. So:

* ``open_object(f, name)`` walks ``name`` one link at a time: hard links are followed, soft links are resolved
  inside the same file (a bounded number of times), and an external link anywhere on the way is refused before
  HDF5 would open its target;
* ``dataset_info(d)`` refuses virtual datasets and external raw storage, and reads the header facts that the
  catalog checks against the checkpoint's metadata (shape, element size and kind, chunk shape).

Refusals raise ``H5Refused`` with a one-line problem.
"""
from __future__ import annotations

from dataclasses import dataclass

import h5py
from h5py import h5d, h5g, h5l, h5o, h5s

from ...errors import one_line

#: soft links followed while resolving one name (HDF5's own default limit is 16)
MAX_SOFT_LINKS = 16


class H5Refused(Exception):
    """An HDF5 object reached through, or stored in, another file; ``problem`` is one line saying which."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem


def _parts(path: str) -> list:
    return [p for p in path.split("/") if p and p != "."]


def open_id(f: h5py.File, name: str):
    """The low-level id (``h5py.h5d.DatasetID``, ``h5py.h5g.GroupID``…) of the object named ``name`` (an absolute
    path in ``f``), or None when there is none; ``H5Refused`` when the name crosses an external link or soft links
    loop. Each link is looked up in its own group, so HDF5 never resolves a link that leaves the file."""
    root = f.id if isinstance(f.id, h5g.GroupID) else h5o.open(f.id, b"/")
    todo = _parts(name)
    loc, done, hops = root, [], 0
    while todo:
        part = todo.pop(0)
        if not isinstance(loc, h5g.GroupID):
            return None
        raw = part.encode("utf-8", "surrogateescape")
        try:
            kind = loc.links.get_info(raw).type
        except (KeyError, ValueError, RuntimeError):  # no such link
            return None
        if kind == h5l.TYPE_HARD:
            try:
                loc = h5o.open(loc, raw)
            except (KeyError, ValueError, OSError, RuntimeError):
                return None
            done.append(part)
            continue
        where = "/" + "/".join(done + [part])
        if kind == h5l.TYPE_SOFT:
            hops += 1
            if hops > MAX_SOFT_LINKS:
                raise H5Refused(f"HDF5 soft links from {name!r} loop or nest more than {MAX_SOFT_LINKS} deep")
            target = loc.links.get_val(raw).decode("utf-8", "surrogateescape")
            todo = ([] if target.startswith("/") else list(done)) + _parts(target) + todo
            loc, done = root, []
            continue
        if kind == h5l.TYPE_EXTERNAL:
            filename, path = (x.decode("utf-8", "replace") for x in loc.links.get_val(raw)[:2])
            raise H5Refused(f"HDF5 external link {where} -> {filename}:{path} refused (ckptfs reads only the "
                            f"checkpoint file itself)")
        raise H5Refused(f"HDF5 user-defined link {where} refused")
    return loc


def open_object(f: h5py.File, name: str):
    """Like ``open_id``, as an h5py ``Dataset`` / ``Group`` (None for anything else)."""
    oid = open_id(f, name)
    if isinstance(oid, h5d.DatasetID):
        return h5py.Dataset(oid)
    if isinstance(oid, h5g.GroupID):
        return h5py.Group(oid)
    return None


@dataclass(frozen=True)
class DatasetInfo:
    """Header facts of a dataset (no data read)."""

    shape: tuple | None  # None: null dataspace (no data)
    itemsize: int
    kind: str  # numpy dtype kind
    chunks: tuple | None


def dataset_info(d, name: str) -> DatasetInfo:
    """The header facts of dataset ``d`` (an h5py ``Dataset`` or ``DatasetID``); ``H5Refused`` for a virtual
    dataset or external raw storage."""
    did = d.id if isinstance(d, h5py.Dataset) else d
    try:
        dcpl = did.get_create_plist()
        layout = dcpl.get_layout()
        if layout == getattr(h5d, "VIRTUAL", -1):
            raise H5Refused(f"dataset {name!r} is an HDF5 virtual dataset (data mapped from other files): refused")
        n_ext = dcpl.get_external_count()
        if n_ext:
            files = ", ".join(repr(dcpl.get_external(i)[0].decode("utf-8", "replace")) for i in range(min(n_ext, 3)))
            raise H5Refused(f"dataset {name!r} keeps its bytes in external raw file(s) {files}: refused")
        space = did.get_space()
        shape = None if space.get_simple_extent_type() == h5s.NULL else tuple(int(n) for n in space.shape)
        dt = did.dtype
        chunks = tuple(int(c) for c in dcpl.get_chunk()) if layout == h5d.CHUNKED else None
    except H5Refused:
        raise
    except (OSError, ValueError, RuntimeError, TypeError) as e:
        raise H5Refused(f"dataset {name!r} header cannot be read ({one_line(e)})") from None
    return DatasetInfo(shape, int(dt.itemsize), dt.kind, chunks)


def dataset_header(f: h5py.File, name: str) -> DatasetInfo | None:
    """The ``DatasetInfo`` of dataset ``name`` without building h5py objects (None if absent / not a dataset)."""
    oid = open_id(f, name)
    return dataset_info(oid, name) if isinstance(oid, h5d.DatasetID) else None


def open_dataset(f: h5py.File, name: str):
    """``(dataset, DatasetInfo)`` for ``name``, or ``(None, None)`` if absent / not a dataset; ``H5Refused`` as above."""
    oid = open_id(f, name)
    if not isinstance(oid, h5d.DatasetID):
        return None, None
    return h5py.Dataset(oid), dataset_info(oid, name)
