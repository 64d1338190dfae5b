"""The tf view: every tensor of the checkpoint in one TensorFlow saver checkpoint, ``tf/model.ckpt.index`` +
``tf/model.ckpt.data-00000-of-00001`` + ``tf/checkpoint``, readable by ``tf.train.load_checkpoint`` and by
``tf.compat.v1.train.Saver().restore`` (the bytes TF's own Saver writes for the same variables:
``ckptfs.layouts.tfsaver``).

Names: the catalog's keys as they are (a PyTorch-era checkpoint's ``model.layers.0.…``; a TF-era file's TF names).
Order: sorted by name, as a TF1 Saver adds them. Prefix: ``model.ckpt``, or ``model.ckpt-<step>`` when the
checkpoint's file name ends in ``_<step>`` / ``-<step>`` (``checkpoint_100.mdl`` → ``model.ckpt-100``, as a Saver
names the step), and ``tf/checkpoint`` names it, so ``tf.train.latest_checkpoint("MNT/tf")`` finds it.
Sharding: ``--tf-max-shard-size`` splits the data with TF's ``MaxShardSizePolicy`` (tensors cut into slices as TF
cuts them); ``--tf-shard-by N`` gives each group of names sharing their first N components (separated by ``/`` or
``.``) shards of its own. Tensors of a dtype TF has no type for are left out, with a README note.
"""
from __future__ import annotations

import re

from ckptfs.layouts.tfsaver import TFSaverLayout, tf_dtype
from ckptfs.views.base import ViewResult

_STEP = re.compile(r".*?[_-](\d+)$")


def prefix_for(stem: str) -> str:
    """``model.ckpt-<step>`` when ``stem`` ends in ``_<digits>`` or ``-<digits>``, else ``model.ckpt``."""
    m = _STEP.match(stem)
    return f"model.ckpt-{int(m.group(1))}" if m else "model.ckpt"


def _utf8(key: str) -> bytes | None:
    try:
        return key.encode("utf-8")
    except UnicodeEncodeError:
        return None


def build(ctx) -> ViewResult:
    if getattr(ctx.checkpoint, "source_files", None) is not None:  # a TF saver checkpoint: its own files, as they are
        from ckptfs.views.tf_source import source_files

        return source_files(ctx)
    named, notes = [], []
    for key, leaf in ctx.checkpoint.tensors().items():
        t = leaf.tensor
        if tf_dtype(t) is None:
            notes.append(f"tf: {key} left out: dtype {t.dtype.name} has no TensorFlow type")
        elif key == "" or _utf8(key) is None:
            notes.append(f"tf: key {key!r} left out: a saver checkpoint names tensors with non-empty UTF-8 text")
        else:
            named.append((key, t))
    if not named:
        return ViewResult(missing="the checkpoint holds no tensor a TensorFlow checkpoint can carry", notes=notes)
    named.sort(key=lambda nt: _utf8(nt[0]))
    opts = ctx.options
    layout = TFSaverLayout(named, prefix_for(ctx.stem), max_shard_size=getattr(opts, "tf_max_shard_size", None),
                           shard_by=getattr(opts, "tf_shard_by", None), cache=ctx.cache, crc_store=ctx.crc_store,
                           identity=f"{ctx.identity}:tf" if ctx.identity else None)
    return ViewResult(files=layout.files(), notes=notes)
