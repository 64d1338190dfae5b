"""ckptfs: Cerebras checkpoints as a read-only filesystem of converted files, generated on read.

Python API: ``ckptfs.open`` (the virtual tree), ``ckptfs.open_run`` (a training run's live tree), ``ckptfs.export``
(one file), ``ckptfs.load`` (the state dict).
"""
__version__ = "0.1.0"

#: the API's names, imported on first use: the CLI (``python -m ckptfs``) imports this package first, and a command
#: that reads an S3 location must not wait for modules it does not need before its first request
__all__ = ["export", "load", "open", "open_run"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import api

    value = getattr(api, name)
    globals()[name] = value
    return value
