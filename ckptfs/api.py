"""The Python API: everything the mount shows, without FUSE.

    import ckptfs
    tree = ckptfs.open("checkpoint_1000.mdl")             # same files as `ckptfs mount`
    tree.listdir("")                                       # ['README.txt', 'config.json', ..., 'cs', 'tensors', 'torch']
    head = tree.read("model.safetensors", 0, 8)            # any byte range of any file, computed on demand
    ckptfs.export("checkpoint_1000.mdl", "bin/pytorch_model.bin", "out.bin")
    state = ckptfs.load("checkpoint_1000.mdl")             # the state dict as torch objects, nothing unpickled
    tree = ckptfs.open("hf_model/")                        # a Hugging Face folder: checkpoint.mdl, params.yaml…
    run = ckptfs.open_run("model_dir")                     # a whole run: checkpoint_<step>/…, latest, README.txt
"""
from __future__ import annotations


from .views.options import from_kwargs as _options
from .tree.base import Tree


def open(ckpt, **options) -> Tree:  # noqa: A001 - mirrors the file-system verb
    """The virtual tree of a checkpoint (a .mdl file or a model_dir), a ``ckptfs.tree.base.Tree``: ``listdir``,
    ``attr``, ``read``, ``iter_blocks``, ``walk``. A Hugging Face model folder (or Hub cache snapshot) gives the tree
    of the Cerebras checkpoint planned from it (``checkpoint.mdl``, ``params.yaml``, ``tensors/``, README.txt).

    Options are the fields of ``ckptfs.views.options.MountOptions`` (config, model, views, max_shard_size, zip_crc,
    cache_size, …); a text is parsed as its command-line flag's value (``max_shard_size="5GB"``, ``views="hf,cs"``).
    """
    from .tree.assemble import build_tree

    return build_tree(ckpt, _options(**options))


def open_run(model_dir, **options) -> Tree:
    """The live tree of a training run, as ``ckptfs mount MODEL_DIR`` shows it (``ckptfs.tree.run.RunTree``):
    ``checkpoint_<step>/…`` for every complete checkpoint, ``latest`` (``readlink``; ``latest/…`` paths are
    followed), README.txt. Options as for ``open``; close it when done."""
    from .tree.run import open_run as _open_run

    return _open_run(model_dir, _options(**options))


def export(ckpt, virtual_path: str, dest, **options) -> int:
    """Write one virtual file to ``dest`` (a file path, an existing directory, or "-" for stdout); returns its size."""
    from .commands.export import export_file

    tree = open(ckpt, **options)
    try:
        return export_file(tree, virtual_path, dest)
    finally:
        tree.close()


def load(ckpt, *, allow_partial: bool = False, allow_external=(), model: str | None = None,
         endpoint_url: str | None = None, profile: str | None = None):
    """The checkpoint's state as torch objects — a safe ``cstorch.load``: pickled objects stay ``Opaque`` bytes, and
    files it refers to are read only from its own folder and the ``allow_external`` folders. A Hugging Face model
    folder gives the state of the Cerebras checkpoint planned from it (``model``: a converter name, where the
    config is ambiguous). ``ckpt`` may be an ``s3://`` location (``endpoint_url``, ``profile``: as
    ``--endpoint-url``, ``--profile``)."""
    from .readers import open_checkpoint, resolve_checkpoint
    from .readers.kind import classify
    from .catalog.materialize import to_torch
    from .storage.s3url import S3Settings
    from ckptfs.catalog.materialize import require_torch

    require_torch()  # before anything is opened: without torch, say so at once
    src = classify(ckpt, settings=S3Settings(endpoint_url, profile), allow_external=allow_external).require()
    where = src.path
    if src.is_hf:
        from .mapping.hf_checkpoint import open_hf_checkpoint

        hc = open_hf_checkpoint(where, _options(allow_external=tuple(allow_external), model=model))
        try:
            return to_torch(hc.checkpoint)
        finally:
            hc.close()
    if src.kind == "run":
        where = resolve_checkpoint(where, allow_external)
    with open_checkpoint(where, allow_partial=allow_partial, allow_external=allow_external) as c:
        return to_torch(c)
