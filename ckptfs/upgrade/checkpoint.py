"""One-pass upgrade of an opened checkpoint and its params from the source release to 2.10.

``upgrade_checkpoint(checkpoint, options)`` copies the state tree (containers only; leaves shared),
then, in Model Zoo's order (``BaseCheckpointConverter_CS_CS``):

1. dataloader state from 1.9 data-iterator files, when the *source* params name
   ``cerebras.save_iter_state_path`` or ``options.data_iter_dir`` is given (``dataloader.py``);
2. the state rules of every release hop (``state_rules.py``) and the params rules
   (``params_rules.py``), hop by hop from ``Checkpoint.release`` to 2.10;
3. when at least one hop applied, a history entry appended to ``__metadata__`` as Cerebras does:
   ``{"version": "2.10.0", "model_name": params.get("model_name", ""), "params": <upgraded params>}``.

A checkpoint already at 2.10 (or of an unknown or newer release) is copied unchanged. Unlike Model
Zoo, the top-level key order is kept (Model Zoo moves ``model`` after the other keys).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CkptfsError
from ..catalog.model import Container
from ..storage.locate import local_folder
from . import releases, state_tree as T
from .dataloader import PROCESSOR_STYLE, convert_data_iter_dir, data_processor
from .params_rules import ParamsEdit, upgrade_params
from .params_source import ParamsDoc, find_params_doc
from .state_rules import StateEdit, upgrade_state


@dataclass
class UpgradeResult:
    root: object  # the upgraded state tree (Container nodes, catalog leaves)
    params: dict | None  # the upgraded params document, None when no params were found
    params_doc: ParamsDoc | None  # where the (source) params came from
    source_release: str | None
    hops: list
    notes: list = field(default_factory=list)


def _model_name(checkpoint, options) -> str | None:
    if getattr(options, "model", None):
        return options.model
    try:
        from ..mapping.detect import detect_family

        return detect_family(checkpoint, getattr(options, "config", None), None,
                             trainer_index=getattr(options, "trainer_index", None)).model_name
    except (CkptfsError, ImportError):
        return None


def add_dataloader(root, params: dict | None, options, ckpt_dir: Path | None, params_dir: Path | None, notes: list) -> None:
    """Step 1: the ``dataloader`` key from 1.9 data-iterator files, if asked for."""
    explicit = getattr(options, "data_iter_dir", None)
    from_yaml = None
    if isinstance(params, dict) and isinstance(params.get("cerebras"), dict):
        from_yaml = params["cerebras"].get("save_iter_state_path") or None
    if not explicit and not from_yaml:
        return
    if not T.is_dict(root):
        notes.append("dataloader state not added: the state is not a dict")
        return
    if T.has(root, "dataloader"):
        notes.append("dataloader state already in the checkpoint; 1.9 data-iterator files not injected")
        return
    proc = data_processor(params)
    style = PROCESSOR_STYLE.get(proc)
    if style is None:
        if not explicit:
            notes.append(f"dataloader state not added: train_input.data_processor is {proc!r}, not "
                         f"GptHDF5DataProcessor or GptHDF5MapDataProcessor")
            return
        style = "map"
        notes.append(f"dataloader style assumed map-style (data_processor {proc!r})")
    d = Path(explicit if explicit else from_yaml)
    if not d.is_absolute():
        for base in [b for b in (params_dir, ckpt_dir, Path.cwd()) if b is not None]:
            if (base / d).is_dir():
                d = base / d
                break
    seed = getattr(options, "shuffle_seed", None) or 0
    try:
        dl = convert_data_iter_dir(d, style, seed)
    except CkptfsError as e:
        notes.append(f"dataloader state not added: {e}")
        return
    for name in dl.ignored:
        notes.append(f"dataloader: ignored {name} (not a worker file of data step {dl.data_step})")
    T.put(root, "dataloader", T.from_python(dl.state, "dataloader", notes))
    notes.append(f"dataloader state ({dl.style}-style, data step {dl.data_step}, {len(dl.workers)} workers) "
                 f"from {d}")


def append_history(root, upgraded_params: dict | None, notes: list) -> None:
    """Step 3: the ``__metadata__`` entry of this upgrade."""
    if not T.is_dict(root):
        notes.append("__metadata__ history not added: the state is not a dict")
        return
    params = upgraded_params if upgraded_params is not None else {}
    entry = {"version": releases.CURRENT_VERSION, "model_name": params.get("model_name", ""), "params": params}
    node = T.from_python(entry, "__metadata__", notes)
    meta = T.get(root, "__metadata__")
    if meta is None:
        T.put(root, "__metadata__", Container("list", None, [node]))
    elif T.is_seq(meta):
        meta.children.append(node)
        meta.kind = "list" if meta.kind == "tuple" else meta.kind
    else:
        notes.append("__metadata__ is not a list; history entry not added")


def upgrade_checkpoint(checkpoint, options=None, *, params_doc: ParamsDoc | None = None) -> UpgradeResult:
    """The checkpoint's state and params as release 2.10 would have them (see the module docstring)."""
    notes: list = []
    release = checkpoint.release
    hop_list = releases.hops(release)
    if release is None:
        notes.append("source release unknown: no release upgrade applied")
    elif releases.parse(release) is not None and releases.parse(release) > releases.parse(releases.CURRENT):
        notes.append(f"source release {release} is newer than {releases.CURRENT}: no upgrade applied")

    problems: list = []
    if params_doc is None:
        try:
            params_doc, problems = find_params_doc(checkpoint, getattr(options, "config", None))
        except CkptfsError as e:
            params_doc, problems = None, [str(e)]
    params = params_doc.params if params_doc else None
    if params_doc is None:
        notes.append("no Cerebras params found (" + ("; ".join(problems) if problems else
                     "no <stem>.yaml, params*.yaml, train/params_train.yaml or configs/*.yaml "
                                                       "next to the checkpoint and no __metadata__ params") + ")")

    root = T.copy_tree(checkpoint.root)
    ckpt_dir = local_folder(checkpoint.path)  # None for a checkpoint in S3
    add_dataloader(root, params, options, ckpt_dir, params_doc.path.parent if params_doc and params_doc.path else None,
                   notes)

    edit = StateEdit(root, params, notes)
    upgrade_state(edit, hop_list)

    upgraded = None
    if params is not None:
        pe = ParamsEdit(model_name=_model_name(checkpoint, options) if ("2.3", "2.4") in hop_list else None,
                        notes=notes)
        upgraded = upgrade_params(params, hop_list, pe)
    if hop_list:
        append_history(root, upgraded, notes)
        notes.insert(0, f"upgraded from release {release} to {releases.CURRENT_VERSION} "
                        f"({' -> '.join([hop_list[0][0]] + [b for _, b in hop_list])})")
    return UpgradeResult(edit.root, upgraded, params_doc, release, hop_list, notes)
