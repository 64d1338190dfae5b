"""The Hugging Face weight formats, one row each: what ``--hf-format`` calls it, its file names (one file, shards,
index), the folder it goes to when every format is served, and the layout that writes a shard.

``views/hf.py`` builds every row's files, ``views/hf_dir.py`` keeps the chosen ones in each model folder, and
``ckptfs.views.options`` takes its ``--hf-format`` choices from here: a new weight format is a layout module
(``ckptfs/layouts/``) and one row of ``FORMATS``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

#: the ``--hf-format`` value that serves every format: the first row's in the model folder itself, each other in its
#: own sub-folder (a complete HF folder of its own, so that a loader finds one format per folder)
ALL = "both"


@dataclass(frozen=True)
class WeightFormat:
    """One HF weight format (see the module docstring)."""

    name: str  # its --hf-format value
    stem: str  # file names: <stem><suffix>, or <stem>-00001-of-00003<suffix> … when sharded
    suffix: str
    folder: str  # where it goes under --hf-format both: "" (the model folder) or a sub-folder
    about: str  # what README.txt calls its files
    #: ``layout(named, file name, cache=, zip_crc=, crc_store=, identity=)`` → the file of one shard, ``named`` being
    #: ``[(HF name, tensor)]``
    layout: Callable
    untie: bool = False  # every name needs a tensor object of its own (no bytes shared between names)

    @property
    def index(self) -> str:
        """The index file of a sharded model (``model.safetensors.index.json``)."""
        return f"{self.stem}{self.suffix}.index.json"

    def is_shard(self, name: str) -> bool:
        """Whether ``name`` is one of this format's weight files (one file or a shard)."""
        return re.fullmatch(re.escape(self.stem) + r"(-\d{5}-of-\d{5})?" + re.escape(self.suffix), name) is not None


def _safetensors(named: list, name: str, *, cache=None, **_):
    from ...layouts.safetensors import SafetensorsLayout

    return SafetensorsLayout(named, metadata={"format": "pt"}, cache=cache, name=name)


def _torch_zip(named: list, name: str, *, cache=None, zip_crc: str = "exact", crc_store=None,
               identity: str | None = None):
    from collections import OrderedDict

    from ...layouts.torchzip.layout import TorchZipLayout

    return TorchZipLayout(OrderedDict(named), name.rsplit(".", 1)[0], crc=zip_crc, crc_store=crc_store,
                          identity=f"{identity}:{name}" if identity else None, cache=cache)


FORMATS: tuple = (
    WeightFormat("safetensors", "model", ".safetensors", "", "safetensors", _safetensors, untie=True),
    WeightFormat("bin", "pytorch_model", ".bin", "bin", ".bin files", _torch_zip),
)


def choices() -> tuple:
    """The ``--hf-format`` values: every format's name, then ``ALL``."""
    return tuple(f.name for f in FORMATS) + (ALL,)


def primary() -> WeightFormat:
    """The format served in the model folder itself under ``ALL``."""
    return next(f for f in FORMATS if not f.folder)


def option_help() -> str:
    """The ``--hf-format`` help text."""
    each = ", ".join(f"{f.name} ({f.stem}*{f.suffix})" for f in FORMATS)
    others = "; ".join(f"the {f.suffix} files in its complete HF folder {f.folder}/" for f in FORMATS if f.folder)
    return f"HF weight files: {each} or {ALL} ({primary().name} in each HF folder, {others})"


def loading_lines(root: str = "MOUNT", folder: str = "") -> list:
    """How ``from_pretrained`` loads each format of a model served under ``--hf-format both`` at ``root``
    (``folder``: the model folder inside it): the primary format from the folder itself, each other from its own
    sub-folder — ``use_safetensors=False`` on the model folder finds no ``.bin`` there."""
    where = f"{root}/{folder}".rstrip("/")
    first = primary()
    lines = [f"from_pretrained({where}) loads the {first.about} ({first.stem}{first.suffix})"]
    for f in FORMATS:
        if f.folder:
            lines.append(f"from_pretrained({where}/{f.folder}, use_safetensors=False) loads the {f.about} "
                         f"({f.stem}{f.suffix}): {where} itself has none, so use_safetensors=False on it fails")
    return lines
