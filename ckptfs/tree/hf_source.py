"""The tree of a Hugging Face model folder mounted as a Cerebras checkpoint (``ckptfs mount HF_DIR MNT``).

::

    README.txt          what was mounted, the model chosen, what ckptfs added or could not carry, and why
    checkpoint.mdl      the Cerebras checkpoint (format 0.5, as cstorch 2.10's save writes it), generated on read
    params.yaml         the params' model section, as Model Zoo's converter writes it
    tensors/<key>.npy   every tensor of checkpoint.mdl, by its key (``tensors`` view)

The ``.mdl`` is the same HDF5 layout as the ``cs/`` view of a Cerebras checkpoint (``ckptfs.layouts.hdf5.layout``): its
metadata is built once (sized exactly on the first ``stat``), its tensor bytes are computed from the HF files'
bytes only when read. The ``cs`` view of ``--views`` gives ``checkpoint.mdl`` and ``params.yaml``, ``tensors``
gives ``tensors/``; ``hf`` and ``torch`` have nothing to add to an HF source.
"""
from __future__ import annotations

import logging
from pathlib import Path

from ..tensor.cache import BlockCache
from ..errors import UsageError
from ..views.options import MountOptions, check_options
from ..units import human_size
from ..views.base import README_NAME, BytesFile, ViewContext
from ..views.cs import mdl_file, params_yaml
from ..mapping.hf_checkpoint import MDL_NAME, PARAMS_NAME, HFCheckpoint, open_hf_checkpoint
from .memory import tree_cache
from .virtual import VirtualTree

log = logging.getLogger("ckptfs.tree.hf_source")

#: the views an HF source serves
HF_SOURCE_VIEWS = ("cs", "tensors", "tf")


def readme_text(hc: HFCheckpoint, files: dict, missing: list, notes: list) -> str:
    m, plan = hc.model, hc.plan
    lines = ["ckptfs: a Hugging Face model served as a Cerebras checkpoint; every file is generated on read.", ""]
    lines.append(f"source:      {m.path}")
    if m.hub is not None:
        lines.append(f"             Hugging Face Hub cache snapshot of {m.hub.repo_id}, revision {m.hub.revision}")
    for folder, c in m.components.items():
        n = len(c.tensors)
        size = sum(t.nbytes for t in c.tensors.values())
        lines.append(f"  {(folder + '/') if folder else '(root)':<12} {c.format}: {', '.join(c.files)} "
                     f"({n} tensors, {human_size(size)})")
    lines.append(f"model:       {plan.model_name} (family {plan.family})")
    keys = len(hc.checkpoint.leaves)
    if MDL_NAME in files:
        lines.append(f"{MDL_NAME}: the Cerebras checkpoint, format 0.5 as cstorch 2.10 writes it ({keys} tensors "
                     f"under model.*); point a Model Zoo run's checkpoint path at it")
    if PARAMS_NAME in files:
        lines.append(f"{PARAMS_NAME}: the params' model section, as Model Zoo's converter writes it")
    if MDL_NAME in files and PARAMS_NAME in files:
        lines.append(f"back to HF:  ckptfs mount <this folder>/{MDL_NAME} DIR --config <this folder>/{PARAMS_NAME} "
                     f"--model {plan.model_name}")
    if any(p.startswith("tensors/") for p in files):
        lines.append(f"tensors/:    every tensor of {MDL_NAME} as .npy, by its key (dots become folders)")
    if any(p.startswith("tf/") for p in files):
        lines.append(f"tf/:         every tensor of {MDL_NAME} in a TensorFlow saver checkpoint, by its key")
    for why in missing:
        lines.append(f"missing:     {why}")
    if getattr(plan, "added", None):
        lines.append(f"added:       {len(plan.added)} tensor(s) the HF model does not hold (see notes; "
                     "--added-tensors omit leaves them out)")
    if notes:
        lines += ["", "notes:"] + [f"  {n}" for n in notes]
    return "\n".join(lines) + "\n"


def build_hf_tree(path, options: MountOptions | None = None, *, cache: BlockCache | None = None,
                  fork_builds: bool = False, planner=None) -> VirtualTree:
    """Open the HF model at ``path`` and assemble its tree (see the module docstring). ``CheckpointError`` when the
    folder cannot be read or mapped; ``planner`` replaces the mapping core's ``to_cs`` (tests)."""
    options = options or MountOptions()
    check_options(options)
    views = [v for v in options.views if v in HF_SOURCE_VIEWS]
    if not views:
        raise UsageError(path, f"--views {','.join(options.views)}: a Hugging Face model serves "
                               f"{', '.join(HF_SOURCE_VIEWS[:-1])} and {HF_SOURCE_VIEWS[-1]}")
    cache = cache if cache is not None else tree_cache(options.cache_size, path)
    hc = open_hf_checkpoint(path, options, planner)
    files: dict = {}
    notes = list(hc.notes)
    missing: list = []
    dirs = []
    if "cs" in views:
        files[PARAMS_NAME] = BytesFile(params_yaml(hc.plan.params))
        mdl, why = mdl_file(hc.checkpoint.root, Path(MDL_NAME).stem, hc.model.path, cache, fork_builds, notes)
        if mdl is not None:
            files[MDL_NAME] = mdl
        else:
            missing.append(why)
    if "tensors" in views:
        from ..views import tensors as tensors_view

        ctx = ViewContext(checkpoint=hc.checkpoint, ckpt_path=hc.model.path, stem=Path(MDL_NAME).stem,
                          options=options, cache=cache)
        r = tensors_view.build(ctx)
        files.update(r.files)
        notes += r.notes
        if r.missing:
            missing.append(f"tensors/: {r.missing}")
        dirs.append("tensors")
    if "tf" in views:
        from ..views import tf as tf_view

        ctx = ViewContext(checkpoint=hc.checkpoint, ckpt_path=hc.model.path, stem=Path(MDL_NAME).stem,
                          options=options, cache=cache)
        r = tf_view.build(ctx)
        files.update({f"tf/{name}": vf for name, vf in r.files.items()})
        notes += r.notes
        if r.missing:
            missing.append(f"tf/: {r.missing}")
        dirs.append("tf")
    files[README_NAME] = BytesFile(readme_text(hc, files, missing, notes))
    return VirtualTree(files, dirs=dirs, mtime_ns=hc.model.mtime_ns, closers=[hc.close], cache=cache)
