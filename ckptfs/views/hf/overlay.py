"""Real files laid over the Hugging Face view: ``--overlay DIR`` (tokenizer, chat template, generation_config.json,
model card…), and, without it, the tokenizer files found next to the checkpoint or its params.

An overlay directory's files appear at the same relative paths in the HF view (``DIR/tokenizer.json`` at the mount
root, ``DIR/text_model/tokenizer.json`` in ``text_model/``). They are read from disk when a byte is asked for, with
these guarantees:

* confinement: only regular files are served; hidden entries (``.git``…) are left out; a symbolic link inside DIR
  is followed only when it leads to a regular file inside DIR (DIR itself may be a link: the user named it) — or,
  when DIR is a Hugging Face cache snapshot (``…/snapshots/<revision>``, whose files all link to ``../../blobs``),
  into that repository's own ``blobs`` folder (a real folder there, not a link elsewhere; for a tokenizer found
  next to the checkpoint, also inside the checkpoint's folder). Anything else is left out with a note in README.txt;
* bounded memory: files are served from disk by range, never read whole; only the small tokenizer files that state
  token ids are parsed, and not above ``special_tokens.MAX_FILE_BYTES``;
* stable bytes: each file's identity (device, inode, size, mtime, ctime) is taken when the view is built; a read
  checks it before and after reading, so a file changed since then fails with an error (EIO through FUSE) instead
  of giving bytes mixed from two versions. Remount to serve the new content.
"""
from __future__ import annotations

import os
import stat as stat_mod
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import CkptfsError, ConfigError
from ...guard.safe_yaml import load_params_yaml
from ...readers.hf.names import hub_blobs, hub_snapshot_of
from ...storage.local import FileIdentity
from ...layouts.file import VirtualFile
from ...storage.locate import local_folder
from ckptfs.storage.s3url import is_s3_url
from .tokenizer_files import TOKENIZER_FILES, named_in_params


class OverlayError(CkptfsError):
    """An overlay file cannot be served (gone, changed since the mount, unreadable) or an overlay is unusable."""


class OverlayFile(VirtualFile):
    """A regular file on disk served as a virtual file: exactly the version seen when the view was built."""

    def __init__(self, path: Path, stamp: FileIdentity, origin: str):
        self.path = Path(path)  # the resolved file (no symbolic link left)
        self.stamp = stamp
        self.size = stamp.size
        self.origin = origin  # where it came from, for README.txt

    def _check(self, st: os.stat_result) -> None:
        if FileIdentity.of_stat(st) != self.stamp:
            raise OverlayError(self.path, "changed since the mount was made; remount to serve the new content")

    def readinto(self, offset: int, out: memoryview, cursor=None) -> int:
        want = len(out)
        try:
            # never blocks: a FIFO swapped in for the file fails the identity check below
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise OverlayError(self.path, f"cannot open: {e.strerror or e}") from e
        try:
            self._check(os.fstat(fd))
            got = 0
            while got < want:
                k = os.preadv(fd, [out[got:]], offset + got)
                if not k:
                    break
                got += k
            self._check(os.fstat(fd))
        except OSError as e:
            raise OverlayError(self.path, f"cannot read: {e.strerror or e}") from e
        finally:
            os.close(fd)
        if got != want:
            raise OverlayError(self.path, "changed since the mount was made; remount to serve the new content")
        return got


@dataclass
class Overlay:
    """Files to lay over the HF view: {relative path: OverlayFile}, and README.txt lines about them."""

    files: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    def folder(self, folder: str) -> dict:
        """{file name: OverlayFile} directly inside ``folder`` ('' = the HF root)."""
        prefix = f"{folder}/" if folder else ""
        return {rel[len(prefix):]: f for rel, f in self.files.items()
                if rel.startswith(prefix) and "/" not in rel[len(prefix):]}


def _inside(path: str, roots: list) -> bool:
    return any(os.path.commonpath([path, r]) == r for r in roots)


def _allowed_roots(real_root: str, confined: list | None = None) -> list:
    """Where links inside ``real_root`` may lead: itself, and a Hugging Face cache snapshot's own ``blobs`` folder
    (``source.hf_layout.hub_blobs``: a real folder, not a link elsewhere) — within ``confined`` too, when given (a
    place the checkpoint or its params named)."""
    roots = [real_root]
    hub = hub_snapshot_of(Path(real_root))
    blobs = hub_blobs(hub) if hub is not None else None
    if blobs is not None and (confined is None or _inside(blobs, confined)):
        roots.append(blobs)
    return roots


def regular_file(path: str, roots: list) -> tuple:
    """(resolved path, stat) of ``path`` when it is a regular file, or a link to one within ``roots``;
    (None, reason) otherwise."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    if stat_mod.S_ISLNK(st.st_mode):
        target = os.path.realpath(path)
        if not _inside(target, roots):
            return None, f"is a symbolic link leading outside the overlay ({target})"
        try:
            st = os.stat(target)
        except OSError as e:
            return None, f"is a broken symbolic link ({e.strerror or e})"
        path = target
    if not stat_mod.S_ISREG(st.st_mode):
        return None, "is not a regular file"
    return path, st


def scan_dir(root: Path, *, only: tuple | None = None, recursive: bool = True, confined: list | None = None
             ) -> tuple:
    """({relative path: OverlayFile}, [problems]) of the regular files under ``root`` (see the module docstring);
    ``only`` keeps just these file names (tokenizer discovery); ``confined``: the real folders links may lead into
    at most (a snapshot's blobs included)."""
    real_root = os.path.realpath(root)
    roots = _allowed_roots(real_root, confined)
    files: dict = {}
    problems: list = []
    for dirpath, dirnames, filenames in os.walk(real_root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, real_root)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
        keep = []
        for d in sorted(dirnames):
            if d.startswith("."):
                continue
            if os.path.islink(os.path.join(dirpath, d)):
                problems.append(f"{rel_dir}{d}/ is a symbolic link to a directory; not followed")
                continue
            keep.append(d)
        dirnames[:] = keep if recursive else []
        for name in sorted(filenames):
            if name.startswith(".") or (only is not None and name not in only):
                continue
            path, st = regular_file(os.path.join(dirpath, name), roots)
            if path is None:
                problems.append(f"{rel_dir}{name} {st}; left out")
                continue
            files[rel_dir + name] = OverlayFile(Path(path), FileIdentity.of_stat(st), f"{root}/{rel_dir}{name}")
    return files, problems


def collect_overlays(dirs) -> Overlay:
    """The files of every ``--overlay`` directory, a later one replacing an earlier one's file of the same path."""
    overlay = Overlay()
    for d in dirs:
        root = Path(d)
        if not root.is_dir():
            raise OverlayError(root, "--overlay: not a directory")
        files, problems = scan_dir(root)
        replaced = sorted(set(files) & set(overlay.files))
        overlay.files.update(files)
        overlay.notes.append(f"overlay {root}: {len(files)} file{'' if len(files) == 1 else 's'}"
                             + (f" ({', '.join(sorted(files)[:8])}{', …' if len(files) > 8 else ''})" if files else ""))
        if replaced:
            overlay.notes.append(f"overlay {root} replaces the earlier overlay's {', '.join(replaced)}")
        overlay.notes += [f"overlay {root}: {p}" for p in problems]
    return overlay


# ---- tokenizer discovery (no --overlay) --------------------------------------------------------------------


def params_tokenizer_paths(params_path: Path | None) -> tuple:
    """([(origin, local path)], [hints]) for the tokenizer locations a params YAML names: an existing directory,
    or an existing tokenizer file; a Hub name (``org/name``) that is not a local path becomes a hint."""
    if params_path is None:
        return [], []
    try:
        doc = load_params_yaml(Path(params_path))  # bounded: size, aliases
    except ConfigError:
        return [], []
    named: list = []
    named_in_params(doc, named)
    out, hints = [], []
    for key, value in named:
        p = Path(os.path.expandvars(os.path.expanduser(value)))
        if not p.is_absolute():
            p = Path(params_path).parent / p
        if p.is_dir() or (p.is_file() and p.name in TOKENIZER_FILES):
            out.append((f"{p} (params {key})", p))
        elif not p.exists() and value.count("/") == 1 and not value.startswith((".", "/", "$", "~")):
            hints.append(f"params {key} names the Hugging Face tokenizer {value!r}: download it (e.g. "
                         f"`huggingface-cli download {value} --include 'tokenizer*' 'special_tokens_map.json'`) and "
                         f"mount with --overlay DIR")
    return out, hints


def discover_tokenizer(ckpt_path: Path, params_path: Path | None, allow_external=(), params_location=None,
                       parts=None) -> tuple:
    """({file name: OverlayFile}, where, hints): the tokenizer files of the first place that has any — a location
    the params YAML names, the checkpoint's folder (the model_dir), its ``tokenizer/`` folder, then the params
    file's folder and its ``tokenizer/`` folder. ``where`` is None when none has any.

    Confinement (as for a checkpoint's external tensors, ``ckptfs.guard.confine``): a place is read only when,
    symlinks resolved, it lies in the checkpoint's folder, the params file's folder or an ``allow_external``
    folder. A crafted params YAML (or a ``tokenizer`` link) naming another folder only gets a hint.

    A checkpoint in S3 (``ckpt_path`` an ``S3Location``; ``params_location``: where its params file was fetched
    from) has its bucket looked at first, the same places in the same order (``views.s3tokenizer``); then the local
    places its params name. ``parts``: the tree's pool its files in the bucket read through."""
    s3_hints: list = []
    if is_s3_url(ckpt_path):
        from ckptfs.views.hf.s3_tokenizers import discover_s3_tokenizer

        found, where, s3_hints = discover_s3_tokenizer(ckpt_path, params_path if params_location else None,
                                                       params_location, parts)
        if where is not None:
            return found, where, s3_hints
    named, hints = params_tokenizer_paths(params_path)
    hints = s3_hints + hints
    places = list(named)
    here = local_folder(ckpt_path)  # None for a checkpoint in S3: only its params file's folder is looked at
    if here is not None:
        places += [(f"{here} (the checkpoint's folder)", here), (f"{here / 'tokenizer'}", here / "tokenizer")]
    roots = ([os.path.realpath(here)] if here is not None else []) + [os.path.realpath(a) for a in allow_external or ()]
    if params_path is not None:
        roots.append(os.path.realpath(Path(params_path).parent))
    if params_path is not None and (here is None or Path(params_path).parent.resolve() != here.resolve()):
        there = Path(params_path).parent
        places += [(f"{there} (the params file's folder)", there), (f"{there / 'tokenizer'}", there / "tokenizer")]
    for where, p in places:
        if p.exists() and not _inside(os.path.realpath(p), roots):
            hints.append(f"tokenizer location {where} lies outside the checkpoint's folder ({os.path.realpath(p)}): "
                         f"not read; mount with --allow-external or --overlay naming it to use it")
            continue
        if p.is_file():
            path, st = regular_file(str(p), [os.path.realpath(p)])  # the params named this file: follow it
            if path is not None:
                return {p.name: OverlayFile(Path(path), FileIdentity.of_stat(st), str(p))}, where, hints
            continue
        if not p.is_dir():
            continue
        files, _ = scan_dir(p, only=TOKENIZER_FILES, recursive=False, confined=roots)
        if files:
            return files, where, hints
    return {}, None, hints
