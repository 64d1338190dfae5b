"""The registered views: one record each (name, folder in the mount, builder). ``--views`` names come from here,
``vfs.build_tree`` runs these builders, and tests/test_view_conformance.py requires a conformance check over
fixtures for every record.

Adding a view: write ``ckptfs/views/<name>.py`` with ``build(ctx: ViewContext) -> ViewResult`` (files relative to
its folder), add its ``View`` to ``VIEWS`` below, and add its check to tests/test_view_conformance.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import cs, hf, tensors, torch
from .base import ViewContext, ViewResult


@dataclass(frozen=True)
class View:
    """A view of a checkpoint: its ``--views`` name, where its files go (``""`` = the mount's root, else
    ``"<name>/"``), and the function that builds its files."""

    name: str
    folder: str
    build: Callable[[ViewContext], ViewResult]
    about: str = ""


VIEWS: tuple = (
    View("hf", "", hf.build, "Hugging Face model directory (config.json, safetensors and .bin weights)"),
    View("cs", "cs/", cs.build, "the checkpoint upgraded to Cerebras 2.10 (.mdl and params .yaml)"),
    View("torch", "torch/", torch.build, "the whole state as torch.save files"),
    View("tensors", "tensors/", tensors.build, "every source tensor as a .npy file"),
)


def names() -> tuple:
    """Every registered view's name, in mount order."""
    return tuple(v.name for v in VIEWS)


def view(name: str) -> View:
    """The registered view called ``name`` (``KeyError`` if none is)."""
    for v in VIEWS:
        if v.name == name:
            return v
    raise KeyError(name)
