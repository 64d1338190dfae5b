"""The registered views: one record each (name, folder in the mount, builder). ``--views`` names come from here,
``tree/assemble.py`` runs these builders, and tests/views/test_view_conformance.py requires a conformance check over
fixtures for every record. This module imports nothing: the options (``--views``) read it without importing what
building a view needs.

Adding a view: write a module of ``ckptfs/views/`` with ``build(ctx: ViewContext) -> ViewResult`` (files relative
to its folder), add its ``View`` to ``VIEWS`` below with the module's full name (the layer test reads these names as
imports of ``tree/assemble.py``, which imports them; ``kinds``: the checkpoints it is made for by default), and add
its check to tests/views/test_view_conformance.py.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class View:
    """A view of a checkpoint: its ``--views`` name, where its files go (``""`` = the mount's root, else
    ``"<name>/"``), and the module whose ``build(ctx: ViewContext) -> ViewResult`` (both of ``views/base.py``)
    builds its files. Only names: listing the views (``--views``, the CLI's option defaults) imports nothing that
    building them needs (h5py, numpy), and the module that runs the builders (``tree/assemble.py``) imports them."""

    name: str
    folder: str
    module: str  # the full name of the module whose ``build(ctx)`` makes the view's files, imported when it runs
    about: str = ""
    #: the kinds of checkpoint (``source.catalog.Checkpoint.kind``) it is built for when ``--views`` is not given;
    #: another kind gets it only when ``--views`` names it
    kinds: tuple = ("cerebras",)
    #: ``((kind, why), …)``: kinds it cannot be built for, and the one line README.txt says about it
    not_for: tuple = ()

    @property
    def default(self) -> bool:
        """Generated for a Cerebras checkpoint when ``--views`` is not given."""
        return "cerebras" in self.kinds


#: the checkpoint kinds (``catalog.model``) of TensorFlow variables: a TensorFlow-era H5 file, a TF saver checkpoint
TF_KINDS = ("tf-h5", "tf-saver")
_NO_HF = ("not applicable: TensorFlow variable names (bert/encoder/…) follow no Model Zoo naming, so no Hugging Face "
          "mapping reads them")

VIEWS: tuple = (
    View("hf", "", "ckptfs.views.hf.view", "Hugging Face model directory (config.json, safetensors and .bin weights)",
         not_for=tuple((k, _NO_HF) for k in TF_KINDS)),
    View("cs", "cs/", "ckptfs.views.cs", "the checkpoint upgraded to Cerebras 2.10 (.mdl and params .yaml)"),
    View("torch", "torch/", "ckptfs.views.torch", "the whole state as torch.save files"),
    View("tensors", "tensors/", "ckptfs.views.tensors", "every source tensor as a .npy file",
         kinds=("cerebras", *TF_KINDS)),
    View("tf", "tf/", "ckptfs.views.tf", "every tensor in a TensorFlow saver checkpoint (.index, .data, checkpoint)",
         kinds=TF_KINDS),
    View("h5", "h5/", "ckptfs.views.h5saver", "a TensorFlow checkpoint as the Cerebras H5 file tensorflow-to-h5 "
                                              "writes (the appliance's H5Saver layout)", kinds=("tf-saver",)),
)


def names() -> tuple:
    """Every registered view's name, in mount order."""
    return tuple(v.name for v in VIEWS)


def default_names() -> tuple:
    """The views generated for a Cerebras checkpoint when ``--views`` is not given, in mount order (a TensorFlow
    one gets those built for its kind: ``views_for``)."""
    return tuple(v.name for v in VIEWS if v.default)


def view(name: str) -> View:
    """The registered view called ``name`` (``KeyError`` if none is)."""
    for v in VIEWS:
        if v.name == name:
            return v
    raise KeyError(name)


def views_for(kind: str, requested: tuple, explicit: bool) -> list:
    """``[(view name, why it is missing or None)]`` of the views a checkpoint of ``kind`` gets from the requested
    ones (``--views``): a view that cannot serve the kind is missing with its reason; one not built for the kind by
    default is left out unless ``explicit`` (``--views`` was given)."""
    out = []
    for name in requested:
        try:
            v = view(name)
        except KeyError:
            out.append((name, None))  # the builder's runner says it is unknown
            continue
        why = dict(v.not_for).get(kind)
        if why is not None:
            out.append((name, why))
        elif explicit or kind in v.kinds:
            out.append((name, None))
    return out


def folder_of(name: str) -> str:
    """Where a view's files go, as its record says: the hf view at the mount's root (so
    ``from_pretrained(mountpoint)`` works), every other view under ``<name>/`` (an unknown name too)."""
    try:
        return view(name).folder
    except KeyError:
        return name + "/"
