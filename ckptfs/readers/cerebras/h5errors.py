"""HDF5's own error messages turned into the project's one line: what was found, and what would work.

h5py raises HDF5's internal wording (``Unable to synchronously open file (truncated file: eof = 351560,
sblock->base_addr = 0, stored_eof = 1152921504606846976)``). ``open_problem`` says the same thing for a user — the
file holds N bytes but says it is M; HDF5's own reason in brackets for what it does not recognise — and what to do
about it. Used for a local ``.mdl`` (``h5store.open_h5``), one stored as an S3 object (``s3open.BlobH5Store``) and a
run's probes (``rundir.probe``). Pure: text in, text out.
"""
from __future__ import annotations

import re

_TRUNCATED = re.compile(r"truncated file: eof = (\d+).*?stored_eof = (\d+)")
_WRAPPER = re.compile(r"^(?:Unable to (?:synchronously )?open file|Unable to open file) \((.*)\)$")
#: HDF5 reasons that mean damaged bytes where HDF5 structures should be
_DAMAGED = ("bad superblock version", "bad object header", "signature", "checksum", "bad version number",
            "bad symbol table", "bad heap", "address overflow", "addr overflow", "invalid", "corrupt", "unable to load",
            "not a valid", "bad B-tree", "wrong B-tree", "unsupported")
AGAIN = "copy the whole checkpoint again from where it was saved (or save it again)"


def hdf5_reason(message) -> str:
    """HDF5's reason, one line, without h5py's ``Unable to open file (…)`` wrapper."""
    text = " ".join(str(message).split())
    m = _WRAPPER.match(text)
    return m.group(1) if m else text


def open_problem(message, kind: str = "file") -> str:
    """The one-line problem for an HDF5 open that failed with ``message``: what was found and what would work
    (``kind``: "file" or "object")."""
    reason = hdf5_reason(message)
    m = _TRUNCATED.search(reason)
    if m:
        have, claimed = int(m.group(1)), int(m.group(2))
        return (f"truncated or damaged HDF5 {kind}: it holds {have} bytes but its superblock says it ends at "
                f"{claimed}; {AGAIN}")
    if "file signature not found" in reason:
        return f"not an HDF5 {kind} (no HDF5 signature), not a Cerebras checkpoint"
    low = reason.lower()
    if any(word.lower() in low for word in _DAMAGED):
        return f"damaged HDF5 {kind} (HDF5: {reason}); {AGAIN}"
    return f"cannot be opened as an HDF5 {kind} (HDF5: {reason}); a checkpoint h5py opens is what works: {AGAIN}"
