"""The LZ4 HDF5 filter (id 32004, every Cerebras tensor uses it): hdf5plugin's build of it, registered alone.

``import hdf5plugin`` registers all of its dozen filters, loading ~190 MB of shared libraries (0.13 s on a cold
disk, a fifth of a cold ``ckptfs mount``); a checkpoint needs one. ``register_lz4()`` loads hdf5plugin's
``libh5lz4`` only and registers it with h5py's HDF5 the way hdf5plugin does (``init_filter`` with h5py's library,
then ``H5Zregister`` of ``H5PLget_plugin_info()``); when that library cannot be found by name, it falls back to
``import hdf5plugin``. ``lz4_library()`` is the same loaded library, for ``ckptfs.readers.cerebras.lz4chunks``' own decoding.
"""
from __future__ import annotations

import ctypes
import threading
from importlib.util import find_spec
from pathlib import Path

LZ4_FILTER_ID = 32004

_lock = threading.Lock()
_library: list = []  # [] = not tried; [lib] = loaded; [None] = not found


def plugin_file() -> Path | None:
    """hdf5plugin's LZ4 filter library, found without importing hdf5plugin; None if not installed like that."""
    spec = find_spec("hdf5plugin")
    for where in (spec.submodule_search_locations or []) if spec else []:
        found = sorted((Path(where) / "plugins").glob("libh5lz4.*")) + sorted((Path(where) / "plugins").glob("h5lz4.*"))
        if found:
            return found[0]
    return None


def lz4_library() -> ctypes.CDLL | None:
    """hdf5plugin's LZ4 filter library, loaded once (None if it cannot be found or loaded)."""
    if _library:
        return _library[0]
    with _lock:
        if not _library:
            lib = None
            path = plugin_file()
            if path is not None:
                try:
                    lib = ctypes.CDLL(str(path))
                except OSError:
                    lib = None
            _library.append(lib)
    return _library[0]


def register_lz4() -> None:
    """Make h5py's HDF5 able to read LZ4-filtered datasets (idempotent, thread-safe)."""
    import h5py

    if h5py.h5z.filter_avail(LZ4_FILTER_ID):
        return
    lib = lz4_library()
    with _lock:
        if h5py.h5z.filter_avail(LZ4_FILTER_ID):
            return
        if lib is None or not _register(h5py, lib):
            import hdf5plugin  # noqa: F401  (registers every filter it has, LZ4 among them)


def _register(h5py, lib: ctypes.CDLL) -> bool:
    """Register ``lib``'s filter with h5py's HDF5, as ``hdf5plugin.register_filter`` does; False if it cannot."""
    try:
        init = getattr(lib, "init_filter", None)
        if init is not None:  # the plugin resolves its HDF5 calls in h5py's own library
            init.argtypes, init.restype = [ctypes.c_char_p], ctypes.c_int
            if init(h5py.h5z.__file__.encode()) < 0:
                return False
        info = lib.H5PLget_plugin_info
        info.restype = ctypes.c_void_p
        h5py.h5z.register_filter(info())
    except (AttributeError, OSError, RuntimeError, ValueError):
        return False
    return bool(h5py.h5z.filter_avail(LZ4_FILTER_ID))
