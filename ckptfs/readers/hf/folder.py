"""A Hugging Face model folder opened lazily: each component's ``config.json`` and its tensors, read by region.

``open_hf_model(path)`` takes what ``save_pretrained`` writes — ``config.json`` with ``model.safetensors`` or
``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``, or ``pytorch_model.bin`` (with or without
``pytorch_model.bin.index.json``) — chosen in the order transformers chooses (safetensors first, a single file
before an index); a Hub cache snapshot (``models--org--name/snapshots/<rev>/``, or the ``models--org--name`` folder
itself: the revision ``refs/main`` names), whose files are links into the repository's own ``blobs/``; and the
multi-folder models of Cerebras' converter (``image_model/`` + ``text_model/``, ``q_encoder/`` + ``ctx_encoder/``).

Only metadata is read here: configs, indexes, safetensors headers, a ``.bin``'s zip directory and ``data.pkl``
(decoded by ``safepickle``, nothing unpickled). Every tensor is a ``BlobRegionTensor`` over its bytes (bf16 and
every other dtype kept), read on demand, checked against the file's version at every read.

Confinement: every file is opened only when, all links resolved, it is a regular file inside the folder given (for
a Hub snapshot, also its repository's ``blobs/``), or inside an ``--allow-external`` folder. In a Hub cache every
component below the ``models--org--name`` folder — ``snapshots/``, the snapshot, ``refs/`` and ``refs/main`` (a
file, not a link), ``blobs/`` — must itself resolve inside that folder (``hf_layout.inside_repository``). Index entries must
be plain file names (no ``/``, no ``..``). FIFOs, devices, sockets and directories are refused before they are
opened; metadata files are read only up to a bound, and a model holds at most ``MAX_MODEL_TENSORS`` tensors
(a safetensors header at most ``safetensors_ref.MAX_HEADER_ENTRIES``).
"""
from __future__ import annotations

import json
import os
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import CheckpointError
from ...guard.confine import Confinement, RefusedReference, open_regular_file
from ...guard.safepickle import PickleRefused
from ...guard.watch import FileIdentity
from ...tensor.regions import BlobRegionTensor, RegionFile
from ..safetensors_ref import read_safetensors_header
from .names import (
    BIN_INDEX,
    BIN_SINGLE,
    CONFIG,
    SAFE_INDEX,
    SAFE_SINGLE,
    UNREAD_WEIGHTS,
    HubSnapshot,
    component_folders,
    hub_blobs,
    hub_repo_snapshot,
    hub_snapshot_of,
)
from .torch_bin import TorchZipError, read_torch_zip

MAX_CONFIG_BYTES = 4 << 20
#: an index names each tensor once (~60 bytes each): 16 MiB is far more than any genuine model's
MAX_INDEX_BYTES = 16 << 20
#: the most tensors a model (all its shards and components) may hold: each costs about 1 KiB of metadata in memory
#: (the largest genuine models hold under 100,000)
MAX_MODEL_TENSORS = 150_000


@dataclass
class HFComponent:
    """One HF model folder: its config and tensors (HF names, in the files' order)."""

    folder: str  # "" for a single-folder model, else "text_model", "q_encoder"…
    path: Path
    config: dict
    tensors: dict  # name -> VirtualTensor
    files: tuple  # the weight files read (names inside ``path``)
    format: str  # "safetensors" | "bin"


@dataclass
class HFFolder:
    """An HF model as read from its folder (or Hub snapshot): each component's config and lazily read tensors."""

    path: Path  # the folder given (a Hub repository folder is replaced by its snapshot)
    components: dict  # folder -> HFComponent, in folder order
    confinement: Confinement
    hub: HubSnapshot | None = None
    notes: list = field(default_factory=list)
    mtime_ns: int | None = None  # the newest of the files read

    @property
    def single(self) -> HFComponent | None:
        return self.components.get("")

    def close(self) -> None:
        """Nothing stays open between reads (every tensor read opens its file)."""


# -- confined reads ---------------------------------------------------------------------------------------------

class _Reader:
    """Opens files of the model only inside its confinement; remembers their newest mtime."""

    def __init__(self, root: Path, confinement: Confinement, hub: HubSnapshot | None, user_allowed: bool):
        self.root = root
        self.confinement = confinement
        self.where = confinement.folder + (f" and {hub.repo.name}/blobs/" if hub is not None else "")
        self.hint = "" if user_allowed else " (to allow a folder, mount with --allow-external DIR)"
        self.mtime_ns = 0
        self.tensors = 0

    def count(self, path: Path, n: int) -> None:
        """Count ``n`` more tensors (from ``path``); CheckpointError past ``MAX_MODEL_TENSORS``."""
        self.tensors += n
        if self.tensors > MAX_MODEL_TENSORS:
            raise CheckpointError(path, f"brings the model to {self.tensors} tensors, more than the "
                                        f"{MAX_MODEL_TENSORS} ckptfs takes")

    def resolve(self, path: Path) -> Path:
        real = os.path.realpath(path)
        if not self.confinement.contains(real):
            raise CheckpointError(path, f"leads to {real}, outside the model folder {self.where}{self.hint}")
        return Path(real)

    def identity(self, real: Path) -> FileIdentity:
        st = os.stat(real)
        self.mtime_ns = max(self.mtime_ns, st.st_mtime_ns)
        return FileIdentity.of_stat(st)

    def read_small(self, path: Path, limit: int) -> bytes:
        real = self.resolve(path)
        try:
            blob = open_regular_file(real)
        except RefusedReference as e:
            raise CheckpointError(path, e.problem) from None
        except OSError as e:
            raise CheckpointError(path, f"cannot be read ({e.strerror or e})") from None
        with closing(blob):
            self.mtime_ns = max(self.mtime_ns, blob.version.mtime_ns)
            if blob.size > limit:
                raise CheckpointError(path, f"is {blob.size} bytes, more than the {limit} a {path.name} may have")
            try:
                return blob.read(0, blob.size)
            except OSError as e:
                raise CheckpointError(path, f"cannot be read ({e.strerror or e})") from None

    def read_json(self, path: Path, limit: int, what: str) -> dict:
        raw = self.read_small(path, limit)
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise CheckpointError(path, f"is not valid JSON ({str(e).splitlines()[0][:200]})") from None
        if not isinstance(doc, dict):
            raise CheckpointError(path, f"{what} is a JSON {type(doc).__name__}, not an object")
        return doc


def _plain_name(name, index: Path) -> str:
    """A shard file name from an index: a plain name in the same folder."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or "\0" in name or name in (".", ".."):
        raise CheckpointError(index, f"names shard {str(name)[:120]!r}: not a file name in its folder")
    return name


# -- weights ---------------------------------------------------------------------------------------------------------

def _safetensors_tensors(reader: _Reader, comp_dir: Path, shard: str, key_prefix: str, root: Path) -> dict:
    path = comp_dir / shard
    real = reader.resolve(path)
    try:
        ident = reader.identity(real)
        with closing(open_regular_file(real)) as blob:
            header = read_safetensors_header(blob)
            if not blob.version == ident == blob.current_version():  # the offsets must belong to the version the
                raise CheckpointError(path, "changed while its header was read")  # tensors will check
    except RefusedReference as e:
        raise CheckpointError(path, e.problem) from None
    except FileNotFoundError:
        raise CheckpointError(path, "not found") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(path, str(e)) from None
    reader.count(path, len(header))
    file = RegionFile(real, reader.confinement)  # opened on the first read, shared by the file's tensors
    return {name: BlobRegionTensor(file, e.offset, e.shape, e.dtype, key_prefix + name, root, what="safetensors file",
                                   identity=ident)
            for name, e in header.items()}


def _bin_tensors(reader: _Reader, comp_dir: Path, shard: str, key_prefix: str, root: Path, notes: list) -> dict:
    path = comp_dir / shard
    real = reader.resolve(path)
    try:
        got = read_torch_zip(real, key_prefix=key_prefix, root=root, confinement=reader.confinement)
    except RefusedReference as e:
        raise CheckpointError(path, e.problem) from None
    except FileNotFoundError:
        raise CheckpointError(path, "not found") from None
    except (TorchZipError, PickleRefused) as e:
        raise CheckpointError(path, str(e)) from None
    except OSError as e:
        raise CheckpointError(path, f"cannot be read ({e.strerror or e})") from None
    reader.identity(real)
    reader.count(path, len(got.tensors))
    notes.extend(got.notes)
    return got.tensors


def _indexed(reader: _Reader, comp_dir: Path, index_name: str, load) -> tuple[dict, tuple]:
    """Tensors of the shards an index names: every name the index maps must be in its shard; tensors of a shard
    the index does not name are kept too (transformers loads whole shards)."""
    index = comp_dir / index_name
    doc = reader.read_json(index, MAX_INDEX_BYTES, "the index")
    wm = doc.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise CheckpointError(index, "has no weight_map object")
    if len(wm) > MAX_MODEL_TENSORS:
        raise CheckpointError(index, f"names {len(wm)} tensors, more than the {MAX_MODEL_TENSORS} ckptfs takes")
    shards: dict = {}
    for name, shard in wm.items():
        shards.setdefault(_plain_name(shard, index), []).append(name)
    out: dict = {}
    where: dict = {}
    for shard in shards:
        got = load(shard)
        for name in shards[shard]:
            if name not in got:
                raise CheckpointError(index, f"maps {name!r} to {shard}, which has no such tensor")
        for name, t in got.items():
            if name in out:
                raise CheckpointError(comp_dir / shard, f"tensor {name!r} is also in {where[name]}")
            out[name] = t
            where[name] = shard
    ordered = {n: out[n] for n in wm}  # the index's order, then what it does not name
    ordered.update((n, t) for n, t in out.items() if n not in ordered)
    return ordered, tuple([index_name] + list(shards))


def _component(reader: _Reader, root: Path, folder: str, notes: list) -> HFComponent:
    comp_dir = root / folder if folder else root
    key_prefix = f"{folder}/" if folder else ""
    if not os.path.lexists(comp_dir / CONFIG):
        raise CheckpointError(comp_dir, "no config.json: not a Hugging Face model folder")
    config = reader.read_json(comp_dir / CONFIG, MAX_CONFIG_BYTES, "config.json")
    present = [n for n in (SAFE_SINGLE, SAFE_INDEX, BIN_SINGLE, BIN_INDEX) if os.path.lexists(comp_dir / n)]
    if not present:
        other = [n for n in UNREAD_WEIGHTS if os.path.lexists(comp_dir / n)]
        raise CheckpointError(comp_dir, "no weights: " + (f"{', '.join(other)} (a format ckptfs does not read); "
                                                            if other else "") +
                              f"expected {SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE} or {BIN_INDEX}")
    chosen = present[0]
    if len(present) > 1:
        notes.append(f"{key_prefix}{chosen} used (as transformers chooses); "
                     f"{', '.join(present[1:])} not read")
    if chosen == SAFE_SINGLE:
        tensors = _safetensors_tensors(reader, comp_dir, chosen, key_prefix, root)
        files = (chosen,)
    elif chosen == SAFE_INDEX:
        tensors, files = _indexed(reader, comp_dir, chosen,
                                  lambda s: _safetensors_tensors(reader, comp_dir, s, key_prefix, root))
    elif chosen == BIN_SINGLE:
        tensors = _bin_tensors(reader, comp_dir, chosen, key_prefix, root, notes)
        files = (chosen,)
    else:
        tensors, files = _indexed(reader, comp_dir, chosen,
                                  lambda s: _bin_tensors(reader, comp_dir, s, key_prefix, root, notes))
    if not tensors:
        raise CheckpointError(comp_dir / files[0], "holds no tensors")
    fmt = "safetensors" if chosen.startswith("model.safetensors") else "bin"
    return HFComponent(folder, comp_dir, config, tensors, files, fmt)


def read_hf_configs(path) -> dict:
    """``{folder: config}`` of a Hugging Face ``config.json`` file, or of each component of a model folder (no
    weights read): what ``ckptfs convert-config`` takes."""
    p = Path(path).absolute()
    if p.is_dir():
        snap = hub_repo_snapshot(p)
        root = snap if snap is not None else p
        hub = hub_snapshot_of(root)
        blobs = hub_blobs(hub) if hub is not None else None
        allowed = (blobs,) if blobs else ()
        reader = _Reader(root, Confinement(os.path.realpath(root), allowed), hub, False)
        return {f: reader.read_json((root / f if f else root) / CONFIG, MAX_CONFIG_BYTES, "config.json")
                for f in component_folders(root) or ("",)}
    if not p.exists():
        raise CheckpointError(p, "no such file or directory")
    reader = _Reader(p.parent, Confinement(os.path.realpath(p.parent)), None, True)
    return {"": reader.read_json(Path(os.path.realpath(p)), MAX_CONFIG_BYTES, "the config")}


def open_hf_model(path, *, allow_external=()) -> HFFolder:
    """Open the Hugging Face model at ``path`` (see the module docstring); ``CheckpointError`` naming the file and
    the problem when it cannot be read. Reads metadata only."""
    given = Path(path).absolute()
    if not given.is_dir():
        raise CheckpointError(given, "not a folder" if given.exists() else "no such file or directory")
    snap = hub_repo_snapshot(given)
    root = snap if snap is not None else given
    hub = hub_snapshot_of(root)
    allowed = []
    blobs = hub_blobs(hub) if hub is not None else None
    if blobs:
        allowed.append(blobs)
    allowed += [os.path.realpath(Path(p).absolute()) for p in allow_external or ()]
    confinement = Confinement(os.path.realpath(root), tuple(allowed))
    reader = _Reader(root, confinement, hub, bool(allow_external))
    notes: list = []
    if hub is not None:
        notes.append(f"Hugging Face Hub cache snapshot of {hub.repo_id} at revision {hub.revision}")
    folders = component_folders(root) or ("",)
    components = {f: _component(reader, root, f, notes) for f in folders}
    return HFFolder(root, components, confinement, hub, notes, reader.mtime_ns or None)
