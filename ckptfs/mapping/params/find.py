"""Find a checkpoint's Cerebras params YAML and extract its model section.

Search order: an explicit path; next to the checkpoint ``<stem>.yaml``, ``params*.yaml``; the ModelZoo
run layout ``train/params_train.yaml`` in the checkpoint's folder and its parent; ``configs/*.yaml``.
A YAML is either the legacy layout (``model:`` at the top) or the trainer layout
(``trainer.init.model``; a list of trainers needs ``trainer_index``). When no YAML is found the model
section stored in the checkpoint's own ``__metadata__`` entries (trainer checkpoints) is used.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import ConfigError
from ...storage.locate import local_folder
from ...guard.safe_yaml import load_params_yaml

if TYPE_CHECKING:  # the source layer (h5py, numpy) is imported when a checkpoint is read, not with the CLI parser
    from ...catalog.model import Checkpoint


class TrainerChoiceError(ConfigError):
    """The params hold several trainers (or the chosen index does not exist): the user must choose."""


@dataclass
class CSParams:
    """The CS model section and where it came from."""

    model: dict
    path: Path | None  # the YAML file; None when taken from the checkpoint's __metadata__
    origin: str  # one line for messages: "params.yaml next to the checkpoint", "checkpoint __metadata__[0]"
    callbacks: list = field(default_factory=list)  # the trainer's init.callbacks (trainer layout; [] for legacy)


def candidate_files(checkpoint_path: Path) -> list:
    """Params YAML files that may belong to ``checkpoint_path``, most specific first (none for a checkpoint in S3:
    those beside it in the bucket are fetched when it is mounted, ``source.s3params``)."""
    here = local_folder(checkpoint_path)
    if here is None:
        return []
    ckpt = Path(checkpoint_path)
    out = [here / f"{ckpt.stem}.yaml"]
    params = sorted(here.glob("params*.yaml"), key=lambda p: (p.name != "params.yaml", p.name))
    out += params
    out += [here / "train" / "params_train.yaml", here.parent / "train" / "params_train.yaml"]
    out += sorted((here / "configs").glob("*.yaml"))
    seen, uniq = set(), []
    for p in out:
        if p.is_file() and p.resolve() not in seen:
            seen.add(p.resolve())
            uniq.append(p)
    return uniq


def model_section(doc, path, trainer_index: int | None = None) -> dict | None:
    """The CS model dict of a params document (legacy or trainer layout); None when it has none."""
    if not isinstance(doc, dict):
        return None
    if isinstance(doc.get("model"), dict):
        return doc["model"]
    trainer = _trainer(doc, path, trainer_index)
    if trainer is None:
        return None
    model = trainer.get("init", {}).get("model") if isinstance(trainer, dict) else None
    if not isinstance(model, dict):
        raise ConfigError(path, "params have a 'trainer' section without 'init.model'")
    return model


def trainer_callbacks(doc, path, trainer_index: int | None = None) -> list:
    """The ``init.callbacks`` list of a trainer-layout params document ([] for the legacy layout)."""
    if not isinstance(doc, dict) or isinstance(doc.get("model"), dict):
        return []
    trainer = _trainer(doc, path, trainer_index)
    init = trainer.get("init") if isinstance(trainer, dict) else None
    callbacks = init.get("callbacks") if isinstance(init, dict) else None
    return copy.deepcopy(callbacks) if isinstance(callbacks, list) else []


def _trainer(doc: dict, path, trainer_index: int | None):
    """The chosen trainer of a trainer-layout document (None without a ``trainer`` key)."""
    trainer = doc.get("trainer")
    if trainer is None:
        return None
    if isinstance(trainer, list):
        entries = [t.get("trainer", t) if isinstance(t, dict) else t for t in trainer]
        if trainer_index is None:
            if len(entries) != 1:
                raise TrainerChoiceError(path, f"params hold {len(entries)} trainers; choose one with --trainer-index "
                                        f"(0..{len(entries) - 1})")
            trainer_index = 0
        if not 0 <= trainer_index < len(entries):
            raise TrainerChoiceError(path, f"--trainer-index {trainer_index} out of range: params hold {len(entries)} trainers")
        trainer = entries[trainer_index]
    elif trainer_index not in (None, 0):
        raise TrainerChoiceError(path, f"--trainer-index {trainer_index} given but params hold a single trainer")
    return trainer


def load_params_file(path: Path, trainer_index: int | None = None) -> CSParams:
    path = Path(path)
    doc = load_params_yaml(path)  # bounded: size, aliases (safe_yaml)
    model = model_section(doc, path, trainer_index)
    if model is None:
        raise ConfigError(path, "params YAML has no 'model' section (legacy) or 'trainer.init.model' (trainer layout)")
    return CSParams(copy.deepcopy(model), path, path.name, trainer_callbacks(doc, path, trainer_index))


def node_value(node):
    """A catalog node as plain Python (dicts, lists, scalars); tensors and opaque leaves as None."""
    from ...catalog.model import Container, ValueLeaf

    if isinstance(node, Container):
        children = [node_value(c) for c in node.children]
        if node.keys is not None:
            return dict(zip(node.keys, children))
        return children
    if isinstance(node, ValueLeaf):
        return node.value
    return None


def metadata_params(checkpoint: Checkpoint, trainer_index: int | None = None) -> CSParams | None:
    """The model section stored in the checkpoint's ``__metadata__`` (newest entry that has one)."""
    node = checkpoint.subtree("__metadata__")
    entries = node_value(node) if node is not None else None
    if isinstance(entries, dict):
        entries = [entries[k] for k in sorted(entries, key=str)]
    if not isinstance(entries, list):
        return None
    for i in range(len(entries) - 1, -1, -1):
        entry = entries[i]
        params = entry.get("params") if isinstance(entry, dict) else None
        try:
            model = model_section(params, checkpoint.path, trainer_index)
        except ConfigError as e:
            raise type(e)(checkpoint.path, f"__metadata__[{i}].params: {e.problem}") from None
        if model is not None:
            return CSParams(copy.deepcopy(model), None, f"checkpoint __metadata__[{i}]",
                            trainer_callbacks(params, checkpoint.path, trainer_index))
    return None


def find_params(checkpoint: Checkpoint, explicit: Path | str | None = None,
                trainer_index: int | None = None) -> CSParams:
    """The CS model section for ``checkpoint``; ConfigError saying where it looked when there is none."""
    if explicit is not None:
        return load_params_file(Path(explicit), trainer_index)
    candidates = candidate_files(checkpoint.path)
    problems = []
    for path in candidates:
        try:
            return load_params_file(path, trainer_index)
        except TrainerChoiceError:
            raise
        except ConfigError as e:
            problems.append(f"{path.name}: {e.problem}")
    meta = metadata_params(checkpoint, trainer_index)
    if meta is not None:
        return meta
    looked = (f"<stem>.yaml, params*.yaml, train/params_train.yaml (here and in the parent folder), configs/*.yaml"
              f" next to the checkpoint, and the checkpoint's __metadata__")
    detail = f" ({'; '.join(problems)})" if problems else ""
    raise ConfigError(checkpoint.path, f"no Cerebras params YAML found: looked for {looked}{detail}; "
                                       f"pass --config PARAMS.yaml")


__all__ = ["CSParams", "TrainerChoiceError", "find_params", "load_params_file", "metadata_params",
           "candidate_files", "model_section", "trainer_callbacks"]
