"""The .npy file layout: exact bytes of ``numpy.save`` for one virtual tensor.

File = ``b"\\x93NUMPY" + version + header length (u16 for 1.0, u32 for 2.0) + header``, where the
header is the ``repr`` of ``{'descr', 'fortran_order', 'shape'}`` plus numpy's 21-digit growth room,
padded with spaces and a final ``\\n`` so that the data starts at a multiple of 64 (so
``np.load(..., mmap_mode="r")`` works). Version 1.0 unless the header is too long for a u16 (then
2.0, or 3.0 if it is not latin-1), exactly as ``numpy.save`` chooses. The data is the tensor's
C-order little-endian bytes.

Types numpy cannot represent (bfloat16, float8_*) are written with their raw storage bits:
bfloat16 as ``<u2``, float8 as ``|u1``. Such files are named ``<name>.bf16.npy`` /
``<name>.float8_e4m3fn.npy`` … (``npy_suffix``) so users know to reinterpret them::

    torch.from_numpy(np.load("w.bf16.npy")).view(torch.bfloat16)
    np.load("w.bf16.npy").view(ml_dtypes.bfloat16)
"""
from __future__ import annotations

import struct

from ..tensor.cache import BlockCache
from ..dtypes import DType
from ..tensor.base import VirtualTensor
from .pieces import Literal, PiecedFile, TensorBytes

MAGIC = b"\x93NUMPY"
ARRAY_ALIGN = 64
GROWTH_AXIS_MAX_DIGITS = 21

_VERSIONS = (((1, 0), "<H", "latin1"), ((2, 0), "<I", "latin1"), ((3, 0), "<I", "utf8"))


def npy_suffix(dtype: DType) -> str:
    """``".npy"`` for numpy-native dtypes; ``".bf16.npy"``, ``".float8_e4m3fn.npy"`` … for raw-bit ones."""
    if dtype.npy_native:
        return ".npy"
    return ".bf16.npy" if dtype.name == "bfloat16" else f".{dtype.name}.npy"


def npy_header(descr, shape, fortran_order: bool = False) -> bytes:
    """Everything before the data, as ``numpy.save`` writes it (``descr`` is what ``dtype_to_descr`` gives)."""
    shape = tuple(int(n) for n in shape)
    d = {"descr": descr, "fortran_order": bool(fortran_order), "shape": shape}
    text = "{" + "".join(f"'{k}': {v!r}, " for k, v in sorted(d.items())) + "}"
    if shape:
        text += " " * (GROWTH_AXIS_MAX_DIGITS - len(repr(shape[-1 if fortran_order else 0])))
    for version, fmt, encoding in _VERSIONS:
        try:
            body = text.encode(encoding)
        except UnicodeEncodeError:
            continue
        hlen = len(body) + 1
        padlen = ARRAY_ALIGN - (len(MAGIC) + 2 + struct.calcsize(fmt) + hlen) % ARRAY_ALIGN
        if hlen + padlen >= 1 << (8 * struct.calcsize(fmt)):
            continue
        return MAGIC + bytes(version) + struct.pack(fmt, hlen + padlen) + body + b" " * padlen + b"\n"
    raise ValueError(f"npy header too long ({len(text)} characters)")


class NpyLayout(PiecedFile):
    """A virtual ``.npy`` file for one tensor: its header, then its bytes (``ckptfs.layouts.pieces``).

    Planned on first read, without a lock (the plan is cheap and pure): until then it holds its tensor, name, cache
    and header length only, in slots (a mount of 100,000 tensors has 100,000 .npy files)."""

    __slots__ = ("tensor", "data_start")

    def __init__(self, tensor: VirtualTensor, *, name: str | None = None, cache: BlockCache | None = None):
        self.tensor = tensor
        self.data_start: int = len(self.header_bytes)
        super().__init__(name=name or tensor.describe(), cache=cache)

    @property
    def header_bytes(self) -> bytes:
        return npy_header(self.tensor.dtype.storage.str, self.tensor.shape)

    @property
    def size(self) -> int:
        return self.data_start + self.tensor.nbytes

    def _own_pieces(self) -> list:
        return [Literal(self.header_bytes, "npy header"), TensorBytes(self.tensor, self.name)]
