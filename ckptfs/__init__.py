"""ckptfs: Cerebras checkpoints as a read-only filesystem of converted files, generated on read."""
__version__ = "0.1.0"
