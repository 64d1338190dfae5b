"""The whole Cerebras params document of a checkpoint, found the way the mapping core finds its model section.

Order (``ckptfs.mapping.params.find.candidate_files``): ``--config``; ``<stem>.yaml``, ``params*.yaml``,
``train/params_train.yaml`` (here and in the parent folder), ``configs/*.yaml`` next to the checkpoint;
else the ``params`` of the newest ``__metadata__`` entry stored in the checkpoint. Unlike the mapping
core this keeps every section (runconfig, optimizer, train_input, trainer…), which the upgrade needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..mapping.params.find import candidate_files, node_value
from ..guard.safe_yaml import load_params_yaml


@dataclass
class ParamsDoc:
    params: dict
    path: Path | None  # the YAML file; None when taken from the checkpoint's __metadata__
    origin: str  # for notes: "params.yaml next to the checkpoint", "checkpoint __metadata__[0]"
    release: str | None = None  # release the params were written for, when known (metadata "version")


def load_yaml(path: Path) -> dict:
    doc = load_params_yaml(Path(path))  # bounded: size, aliases (mapping.safe_yaml)
    if not isinstance(doc, dict):
        raise ConfigError(path, "params YAML is not a mapping")
    return doc


def metadata_entries(checkpoint) -> list:
    node = checkpoint.subtree("__metadata__")
    entries = node_value(node) if node is not None else None
    if isinstance(entries, dict):
        entries = [entries[k] for k in sorted(entries, key=str)]
    return entries if isinstance(entries, list) else []


def find_params_doc(checkpoint, explicit=None) -> tuple[ParamsDoc | None, list]:
    """``(ParamsDoc or None, problems)``: the params for ``checkpoint`` and why candidates were skipped."""
    if explicit is not None:
        return ParamsDoc(load_yaml(Path(explicit)), Path(explicit), f"{Path(explicit).name} (--config)"), []
    problems = []
    for path in candidate_files(checkpoint.path):
        try:
            return ParamsDoc(load_yaml(path), path, f"{path.name} next to the checkpoint"), problems
        except ConfigError as e:
            problems.append(f"{path.name}: {e.problem}")
    entries = metadata_entries(checkpoint)
    for i in range(len(entries) - 1, -1, -1):
        e = entries[i]
        if isinstance(e, dict) and isinstance(e.get("params"), dict):
            version = e.get("version") if isinstance(e.get("version"), str) else None
            return ParamsDoc(e["params"], None, f"checkpoint __metadata__[{i}]", version), problems
    return None, problems
