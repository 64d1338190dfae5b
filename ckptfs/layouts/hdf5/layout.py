"""A format-0.5 Cerebras checkpoint (``.mdl``), served lazily: HDF5 metadata built once, tensor bytes on read.

Given a state tree (``Container`` nodes, leaves are the entries of ``hdf5_entries``) the layout builds a
*metadata-only* HDF5 skeleton with h5py (``hdf5_skeleton``), exactly as cerebras-pytorch 2.10 lays out a checkpoint
(global ``__spec__``/``__version__`` 0.5/``__cstorch_version__``/per-key ``<key>.__metadata__``
JSON/``__SUCCESS__``, dataset attributes ``__NUMPY__``, ``__TORCH__``, ``__TYPE__``, ``shapes``,
``dtypes``, ``rtfx_dtypes``, ``compressed``; bf16 stored as int16 bits, bool as the HDF5 enum over
int8, keys with ``/`` become groups, bytes objects as null-dataspace datasets with ``__BYTES__``).

The trade: cstorch writes every non-0-d dataset chunked with the LZ4 filter (32004). Here every
tensor dataset is CONTIGUOUS, allocated early, unfiltered and never filled, so its data is one
byte range at a fixed offset (``dset.id.get_offset()``). cstorch's loader reads any h5py dataset, so the file
loads the same; we give up LZ4 to gain laziness and O(#keys) memory. The skeleton is written through h5py's
file-object driver into an unlinked temporary file (``hdf5_buffers.ScratchBuffer``; in memory, ``SparseBuffer``,
when none can be made), sparse: the never-written data regions cost nothing, and the metadata (~2 KB per key,
mostly the ``__metadata__`` JSON) stays out of the server's memory. The file is served by one piece (``_Body``)
holding arrays: each tensor's region and the ranges HDF5 wrote; the bytes outside the tensors are read back from
the temporary file, and the tensors' bytes through the block cache. The skeleton may be built ahead in a forked
process (``fork_build``, ``hdf5_fork``).
One more difference from cstorch: the root group tracks creation order (HDF5 1.8 object header with
indexed attributes), because cstorch's compact root attributes make a build O(#keys²). Readers
see the same attributes and datasets. The file's bytes are a pure function of the tree and never change.
"""
from __future__ import annotations

import bisect
import logging
from array import array

from ...tensor.cache import BlockCache
from ...errors import CheckpointError, TensorReadError
from ...tensor.base import VirtualTensor
from ...upgrade.releases import CURRENT_VERSION
from . import fork as hdf5_fork, spec_attr as hdf5_spec
from .buffers import SkeletonBuffer, SparseBuffer, new_buffer
from .entries import RTFX_CODES, TensorEntry, resolve_entries
from .skeleton import Skeleton, build_skeleton
from ..pieces import PiecedFile, TensorBytes

log = logging.getLogger(__name__)

FORMAT_VERSION = 0.5
CSTORCH_VERSION = CURRENT_VERSION  # what the served .mdl says wrote it


class _Body:
    """The whole file as one piece that finds its parts by bisecting arrays, instead of a piece per key: the tensors'
    regions ``[starts[i], ends[i])`` are read from ``tensors[i]`` through the cache; every other byte comes from the
    skeleton buffer — HDF5 metadata in the ranges HDF5 wrote (``meta_starts``/``meta_ends``), zeros (free space)
    elsewhere. About 40 B per tensor. ``prefetch`` lets the read engine's read-ahead reach the tensors."""

    __slots__ = ("layout", "buffer", "size", "starts", "ends", "tensors", "meta_starts", "meta_ends")

    def __init__(self, layout: "Hdf5Layout", skel: Skeleton):
        self.layout = layout  # names the tensors (explain, errors)
        self.buffer = skel.buffer
        regions = sorted(skel.regions, key=lambda r: r[0])
        self.starts = array("q", [o for o, _ in regions])
        self.ends = array("q", [o + t.nbytes for o, t in regions])
        self.tensors = [t for _, t in regions]
        self.meta_starts = array("q", [a for a, _ in skel.spans])
        self.meta_ends = array("q", [b for _, b in skel.spans])
        self.size = skel.size

    @property
    def what(self) -> str:
        return f"HDF5 file {self.layout.name}"

    def fill(self, out: memoryview, a: int, cache) -> int:
        starts, ends, n, pos = self.starts, self.ends, len(out), 0
        i = bisect.bisect_right(starts, a) - 1  # the last region starting at or before the position
        while pos < n:
            at = a + pos
            while i + 1 < len(starts) and starts[i + 1] <= at:
                i += 1
            if i >= 0 and at < ends[i]:
                k = min(n - pos, ends[i] - at)
                t = self.tensors[i]
                got = t.read_into(at - starts[i], out[pos:pos + k], cache)
                if got != k:
                    raise TensorReadError(self.layout.name, f"tensor {self.layout.key_of(t)} produced {got} bytes "
                                                            f"for its bytes [{at - starts[i]}, {at - starts[i] + k})")
            else:
                k = min(n - pos, (starts[i + 1] if i + 1 < len(starts) else self.size) - at)
                self.buffer.read_at(at, out[pos:pos + k])
            pos += k
        return pos

    def prefetch(self, a: int, b: int, cache, done=None) -> bool:
        """Queue the tensors' bytes under bytes ``[a, b)`` for the read-ahead (False: the queue refused some)."""
        i = max(bisect.bisect_right(self.starts, a) - 1, 0)
        while i < len(self.starts) and self.starts[i] < b:
            lo, hi = self.starts[i], self.ends[i]
            if a < hi and not self.tensors[i].prefetch(max(a, lo) - lo, min(b, hi) - lo, cache, done):
                return False
            i += 1
        return True

    def will_need(self, a: int, b: int, continuing: bool = False) -> None:
        """Announce the tensors' bytes under bytes ``[a, b)`` to their storage (``VirtualTensor.will_need``)."""
        i = max(bisect.bisect_right(self.starts, a) - 1, 0)
        while i < len(self.starts) and self.starts[i] < b:
            lo, hi = self.starts[i], self.ends[i]
            if a < hi:
                self.tensors[i].will_need(max(a, lo) - lo, min(b, hi) - lo, continuing)
            i += 1

    def _at(self, a: int) -> int:
        """The tensor region holding byte ``a``, or the first after it (a stream's tensors: ``Plan.tensor_from``)."""
        i = bisect.bisect_right(self.starts, a) - 1
        return i if i >= 0 and a < self.ends[i] else i + 1

    def explain(self, a: int) -> list:
        i = bisect.bisect_right(self.starts, a) - 1
        if i >= 0 and a < self.ends[i]:
            t = self.tensors[i]
            return TensorBytes(t, self.layout.key_of(t)).explain(a - self.starts[i])
        j = bisect.bisect_right(self.meta_starts, a) - 1
        if j >= 0 and a < self.meta_ends[j]:
            lo, hi = self.meta_starts[j], self.meta_ends[j]
            return [f"HDF5 metadata: file bytes [{lo}, {hi}), {hi - lo} bytes written when the file was planned"]
        lo = max(self.ends[i] if i >= 0 else 0, self.meta_ends[j] if j >= 0 else 0)
        hi = min(self.starts[i + 1] if i + 1 < len(self.starts) else self.size,
                 self.meta_starts[j + 1] if j + 1 < len(self.meta_starts) else self.size)
        return [f"HDF5 free space: file bytes [{lo}, {hi}), {hi - lo} zero bytes"]

    @property
    def metadata_bytes(self) -> int:
        return sum(self.meta_ends) - sum(self.meta_starts)


class Hdf5Layout(PiecedFile):
    """The bytes of a lazily generated format-0.5 ``.mdl``: ``size`` and ``read(offset, n)``.

    ``root``: a ``Container`` tree whose leaves are entries (``TensorEntry`` … ``LinkEntry``); the same
    entry object under two keys is written once and linked, like cstorch does for repeated objects.
    The skeleton is built (the file planned) on first use of ``size`` or ``read``. What stays in memory per key is
    the entry tree and the arrays of one ``_Body`` piece; the metadata bytes stay in the skeleton's temporary file.
    """

    def __init__(self, root, *, cstorch_version: str = CSTORCH_VERSION, format_version: float = FORMAT_VERSION,
                 cache: BlockCache | None = None, path=None):
        self.root = root
        self.path = path
        self.cstorch_version = cstorch_version
        self.format_version = format_version
        items = resolve_entries(root, path)  # raises for what cannot be laid out, before anything is built
        self.notes = [f"{k}: dtype {e.tensor.dtype.name} has no RtFx code; cstorch 2.10 cannot write it"
                      for k, e in items if isinstance(e, TensorEntry) and not e.numpy
                      and e.tensor.dtype.name not in RTFX_CODES]
        self._child: hdf5_fork.ChildBuild | None = None
        super().__init__(name=str(path) if path is not None else "HDF5 file", cache=cache, plan=self._plan_file)

    def fork_build(self) -> bool:
        """Start building the skeleton now in a forked child process, on another CPU and outside this process's GIL;
        the first use of the file (``size``, ``read``) then only waits for the child and adopts its result. The
        child makes the same calls as a build in this process, so the bytes are the same; if it fails, the first
        use builds here (and raises what the child met).

        Only while this process has a single thread (a fork copies no other thread, and any lock another thread
        held would stay held in the child): otherwise, and without ``os.fork`` or a scratch file, nothing is
        started and False is returned (the skeleton is built on first use, as without this call)."""
        if self._child is not None:
            return False
        items = self.items
        self._child = hdf5_fork.start(lambda buf: self._build(items, buf))
        return self._child is not None

    @property
    def build_pid(self) -> int | None:
        """The process building the skeleton (``fork_build``) until the file adopts its result; else None."""
        return self._child.pid if self._child is not None else None

    @property
    def items(self) -> list:
        """``[(flat key, entry)]`` in spec order, recomputed from ``root`` on each use (a string and a tuple per key
        are not worth keeping for the build and ``explain``)."""
        return resolve_entries(self.root, self.path)

    def key_of(self, tensor: VirtualTensor) -> str:
        """The first flat key whose entry holds ``tensor`` (its description if none does)."""
        for key, entry in self.items:
            if isinstance(entry, TensorEntry) and entry.tensor is tensor:
                return key
        return tensor.describe()

    def _build(self, items: list, buffer: SkeletonBuffer) -> Skeleton:
        return build_skeleton(items, cstorch_version=self.cstorch_version, format_version=self.format_version,
                              spec_text=hdf5_spec.spec_attr(self.root), buffer=buffer)

    def _plan_file(self) -> list:
        items = self.items
        child, self._child = self._child, None
        if child is not None:
            skel = child.result([e.tensor for _, e in items if isinstance(e, TensorEntry) and e.tensor.nbytes])
            if skel is not None:
                return [_Body(self, skel)]
            log.warning("%s: the HDF5 skeleton's build process failed: building it here", self.name)
        buf = new_buffer()
        try:
            try:
                skel = self._build(items, buf)
            except Exception:
                if getattr(buf, "error", None) is None:
                    raise
                log.warning("temporary file of the HDF5 skeleton failed (%s): built in memory", buf.error)
                skel = self._build(items, SparseBuffer())
        except (ValueError, KeyError, OSError) as e:
            raise CheckpointError(self.path, f"cannot lay out the HDF5 file: {e}") from e
        return [_Body(self, skel)]

    @property
    def metadata_bytes(self) -> int:
        """Bytes of HDF5 metadata (no tensor data), kept in the skeleton's buffer."""
        return self.plan().pieces[0].metadata_bytes
