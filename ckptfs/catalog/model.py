"""What a checkpoint contains, independent of its on-disk format version: leaves plus nesting.

A ``Checkpoint`` has a ``root`` node (the original nesting rebuilt from the pytree spec) and
``leaves``, every flattened key in spec order. A link (``LinkedObject``, a hard-link alias, a
legacy ``link_to_self``) is the *same* Leaf object under two keys, so ties survive.

Leaves exist once per key (100,000 in a large checkpoint), containers up to once per key (an optimizer's state
per parameter), so their classes have slots and no ``__dict__``.
"""
from __future__ import annotations

import logging

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from ..tensor.base import VirtualTensor

log = logging.getLogger(__name__)


#: the kinds of checkpoint a catalog is read from (``Checkpoint.kind``): a Cerebras (PyTorch-era) checkpoint, a
#: TensorFlow-era Cerebras H5 file (the appliance's H5Saver layout, ``tf_h5``), a TensorFlow saver checkpoint
CEREBRAS, TF_H5, TF_SAVER = "cerebras", "tf-h5", "tf-saver"
#: how README.txt and ``info`` name a kind whose files have no Cerebras format version
KIND_FORMATS = {TF_H5: "TensorFlow-era Cerebras H5 (the appliance's H5Saver layout: quoted variable names at the "
                       "root, no __spec__)",
                TF_SAVER: "TensorFlow saver checkpoint (tensor bundle: .index and .data-* shards)"}


@dataclass(eq=False, slots=True)
class Leaf:
    key: str  # flattened key of its first occurrence


@dataclass(eq=False, slots=True)
class TensorLeaf(Leaf):
    tensor: VirtualTensor
    numpy: bool = False  # saved as a numpy array (NumpyArraySerializer / legacy 0.4 NumpyArrayH5Type)


@dataclass(eq=False, slots=True)
class ValueLeaf(Leaf):
    value: Any  # bool | int | float | str | None


@dataclass(eq=False, slots=True)
class OpaqueLeaf(Leaf):
    """A pickled Python object: its bytes, never unpickled."""

    data: bytes
    reason: str = "pickled Python object (not unpickled for safety)"


@dataclass(eq=False, slots=True)
class UnreadableLeaf(Leaf):
    """A leaf ckptfs cannot produce (e.g. a TorchScript graph tensor); ``reason`` says why."""

    reason: str
    shape: tuple | None = None
    dtype: str | None = None


@dataclass(eq=False, slots=True)
class Container:
    """dict / OrderedDict / defaultdict: ``keys`` holds the keys (str or int); sequences: ``keys`` is None."""

    kind: str  # "dict" | "OrderedDict" | "defaultdict" | "list" | "tuple" | "set" | "namedtuple" | "deque"
    keys: list | None
    children: list  # list[Node]
    extra: dict = field(default_factory=dict)  # namedtuple name, defaultdict factory, deque maxlen


Node = Union[Container, Leaf]


@dataclass(eq=False)
class Checkpoint:
    path: Path
    format_version: float | None  # None: not an HDF5 checkpoint (``format_name`` says what it is)
    release: str | None  # release that wrote it ("2.10.0"), from __cstorch_version__ / metadata / version map
    success: bool  # __SUCCESS__ present and true (legacy: True)
    root: Node
    leaves: dict  # dict[str, Leaf], every flat key in spec order
    links: dict = field(default_factory=dict)  # alias key -> target key
    warnings: list = field(default_factory=list)
    #: where things it is served with came from (a params file fetched from beside it in a bucket): README.txt and
    #: ``info`` show these as they are — facts, not problems (those are ``warnings``)
    notes: list = field(default_factory=list)
    #: the ``S3Location`` of the params file fetched from beside a checkpoint in S3 (None otherwise): where its
    #: tokenizer files are looked for too
    params_location: Any = None
    #: a checkpoint that is not a local file (S3): what names its stored version (a digest of its objects' ETags)
    #: and when it was written; None for a local file, whose identity comes from the file system
    version: str | None = None
    mtime_ns: int | None = None
    kind: str = CEREBRAS  # CEREBRAS, TF_H5 or TF_SAVER: a TF kind's state is flat, keyed by TF variable names
    #: the source's own files, for a view that serves them as they are (a TF saver checkpoint's: ``tf_saver.TfFiles``)
    source_files: Any = None
    #: what the format is called when it has no Cerebras format version (a legacy-mode ``torch.save`` zip; a TF kind's
    #: from ``kind`` when not given)
    format_name: str | None = None
    _closers: list = field(default_factory=list, repr=False)
    #: work a tree serving the checkpoint starts in the background once it serves (``warm``)
    _warmers: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        if self.format_name is None:
            self.format_name = KIND_FORMATS.get(self.kind)

    @property
    def is_tf(self) -> bool:
        """A TensorFlow-era H5 file or a TF saver checkpoint: a flat state keyed by TF variable names."""
        return self.kind in (TF_H5, TF_SAVER)

    def tensors(self) -> dict:
        """flat key -> TensorLeaf for every tensor key (aliases included, sharing the Leaf)."""
        return {k: v for k, v in self.leaves.items() if isinstance(v, TensorLeaf)}

    def subtree(self, top_key) -> Node | None:
        """The node under a top-level key of a dict root (e.g. "model"), or None."""
        r = self.root
        if isinstance(r, Container) and r.keys is not None and top_key in r.keys:
            return r.children[r.keys.index(top_key)]
        return None

    def warm(self, stopped) -> None:
        """Do the checkpoint's background work (a checkpoint in object storage reads its datasets' chunk indexes
        while the mount already serves); ``stopped`` (a ``threading.Event``) is set when the tree closes. Best
        effort: a failure is logged, the read that needs the work does it again."""
        for w in self._warmers:
            if stopped.is_set():
                return
            try:
                w(stopped)
            except Exception as e:  # noqa: BLE001 - background work: the reads report their own failures
                log.debug("background work for %s: %s: %s", self.path, type(e).__name__, e)

    def close(self) -> None:
        for c in self._closers:
            try:
                c()
            except Exception as e:  # noqa: BLE001 - one closer failing must not keep the others open
                log.warning("closing %s: %s: %s", self.path, type(e).__name__, e)
        self._closers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
