"""A tensor that is one entry of a ``.safetensors`` file: a file region checked against the file's header."""
from __future__ import annotations

from pathlib import Path

from ckptfs.dtypes import DType
from ckptfs.guard.confine import Confinement, RefusedReference
from ckptfs.storage.local import FileIdentity
from ckptfs.tensor.regions import BlobRegionTensor, RegionFile, _shape_str


class SafetensorsTensor(BlobRegionTensor):
    """Tensor ``name`` of an external .safetensors file (DeferredSafeTensor). ``offset`` is where its data starts
    when the catalog read that from the header of the version ``identity`` names (every read checks the file is
    still that version); otherwise (-1) the header is read on first use and checked against the shape and dtype
    the catalog announced."""

    __slots__ = ("name",)

    def __init__(self, path: Path, name: str, shape, dtype: DType, key: str, checkpoint_path: Path,
                 referenced_as: str | None = None, *, identity: FileIdentity | None = None,
                 confinement: Confinement | None = None, offset: int = -1):
        super().__init__(RegionFile(path, confinement), offset, shape, dtype, key, checkpoint_path,
                         what="external safetensors file", identity=identity, referenced_as=referenced_as)
        self.name = name

    def describe(self) -> str:
        return f"safetensors {self.file_name}:{self.name} {_shape_str(self.shape)} {self.dtype.name}"

    def data_offset(self) -> int:
        if self.offset >= 0:
            return self.offset
        from .safetensors_ref import read_safetensors_header

        try:
            entry = read_safetensors_header(self.blob).get(self.name)
        except RefusedReference as e:
            raise self._fail(f"external reference refused: {e.problem}") from None
        except FileNotFoundError:
            raise self._missing() from None
        except (OSError, ValueError) as e:
            raise self._fail(f"safetensors file {self.file_name}: {e}") from e
        if entry is None:
            raise self._fail(f"safetensors file {self.file_name} has no tensor {self.name!r}")
        if entry.shape != self.shape or entry.dtype != self.dtype:
            raise self._fail(f"safetensors tensor {self.name!r} is {_shape_str(entry.shape)} {entry.dtype.name}, "
                             f"expected {_shape_str(self.shape)} {self.dtype.name}")
        self.offset = entry.offset
        return self.offset
