"""ckptfs: Cerebras checkpoints as a read-only filesystem of converted files, generated on read.

Python API: ``ckptfs.open`` (the virtual tree), ``ckptfs.open_run`` (a training run's live tree), ``ckptfs.export``
(one file), ``ckptfs.load`` (the state dict).
"""
__version__ = "0.1.0"

from .api import export, load, open, open_run  # noqa: E402,F401
