"""The ``checkpoint`` text file (a ``CheckpointState`` proto in text format) that a Saver writes beside a bundle."""
from __future__ import annotations

__all__ = ["checkpoint_state"]


def _quote(text: str) -> str:
    """protobuf text-format string escaping (C-style, as ``CEscape``)."""
    out = []
    for b in text.encode("utf-8"):
        ch = chr(b)
        if ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ch in "\"'\\":
            out.append("\\" + ch)
        elif b < 0x20 or b >= 0x7F:
            out.append(f"\\{b:03o}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def checkpoint_state(prefix_name: str) -> bytes:
    """What ``tf.train.Saver`` / ``tf.train.Checkpoint.save`` write to ``checkpoint`` for one kept checkpoint
    whose prefix, relative to the folder, is ``prefix_name``."""
    q = _quote(prefix_name)
    return f"model_checkpoint_path: {q}\nall_model_checkpoint_paths: {q}\n".encode("utf-8")
