"""The h5 view: a TensorFlow checkpoint as the Cerebras H5 file ``tensorflow-to-h5`` writes (``h5/<prefix>.h5``, the
appliance's H5Saver layout: ``ckptfs.layouts.h5saver``), generated on read.

Every numeric variable is in it, under its TF name. What H5Saver cannot hold is left out and named in README.txt:
string tensors (TF2's ``_CHECKPOINTABLE_OBJECT_GRAPH`` among them) and bfloat16 ones (numpy has no bfloat16; the
``tensors/`` view serves them as their bits, the ``tf/`` view as they are).
"""
from __future__ import annotations

from ckptfs.errors import CheckpointError
from ckptfs.layouts.h5saver import H5SaverLayout, why_not_h5saver
from ckptfs.catalog.model import TensorLeaf, UnreadableLeaf
from ckptfs.views.base import DeferredFile, ViewResult


def h5saver_items(ckpt) -> tuple:
    """``([(variable, tensor)], [note])``: the variables of the flat state ``ckpt`` an H5Saver file holds, in the
    checkpoint's order, and a README.txt note for each one left out (and why). ``CheckpointError`` when a numeric
    variable cannot be read: a file without it would load as a different model."""
    items, notes = [], []
    for key, leaf in ckpt.leaves.items():
        if key in ckpt.links:
            target = ckpt.links[key]
            notes.append(f"h5: {key}: left out (an alias of {target}, which is in the file)")
            continue
        if isinstance(leaf, TensorLeaf):
            why = why_not_h5saver(leaf.tensor)
            if why is None:
                items.append((key, leaf.tensor))
                continue
        elif isinstance(leaf, UnreadableLeaf) and leaf.dtype == "string":
            why = "string: no H5Saver representation"
        elif isinstance(leaf, UnreadableLeaf):
            raise CheckpointError(None, f"{ckpt.path.stem}.h5 not generated: variable {key} cannot be read "
                                        f"({leaf.reason})")
        else:
            why = f"a {type(leaf).__name__}, not a tensor"
        notes.append(f"h5: {key}: left out ({why})")
    return items, notes


def build(ctx) -> ViewResult:
    items, notes = h5saver_items(ctx.checkpoint)
    if not items:
        return ViewResult(missing="the checkpoint holds no variable an H5Saver file can hold", notes=notes)
    name = f"{ctx.stem}.h5"
    lay = H5SaverLayout(items, cache=ctx.cache, path=ctx.ckpt_path.with_name(name))

    def skeleton():
        lay.size  # lays the HDF5 metadata out once
        return lay

    about = (f"h5: {name} holds {len(items)} variable(s) as tensorflow-to-h5 writes them (the appliance's H5Saver "
             "layout, uncompressed); H5Saver().load() reads it")
    return ViewResult(files={f"h5/{name}": DeferredFile(skeleton)}, notes=[about, *notes])
