"""ckptfs's own files kept between runs (catalog indexes, zip CRCs, export records, the mapping index, server logs):
the one place that decides when such a file is trusted, and how it is read, written and pruned.

A cache directory may be shared (set to a team folder), and what a cached fact decides — which
dataset a key reads, the CRC in a zip directory, whether an exported file is finished — must come from the user's own
earlier runs. So a ``StateDir`` is opened only when the whole chain from the cache directory down is the user's:

* each folder (the cache directory and the sub-folder, e.g. ``catalogs/``) is reached without following a symbolic
  link (``O_NOFOLLOW`` and directory file descriptors; the path *to* the cache directory is the user's own choice),
  is owned by the user and is writable by nobody else (no group or other write bit);
* each file is opened through its folder's descriptor without following a link and without blocking (a FIFO or a
  device is refused before it is read), must be a regular file owned by the user, readable by nobody else, and
  within the size its reader allows;
* each file holds sealed JSON lines: a header ``{"ckptfs": kind, …}``, its lines, then ``{"seal": …}``, a keyed
  BLAKE2b of everything before it under a secret only the user can read (``key`` in the cache directory, made on
  first use). A file edited by hand, cut short, or copied from someone else's cache does not verify.

Anything else is ignored — the fact is computed again — with one log line per folder and reason, and is never
pruned or overwritten: pruning removes only files whose name its caller recognises and whose header names the
caller's kind (``StateDir.prune``). Files are written to a private temporary file in the folder and renamed into
place, so a reader sees a whole file or none.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import stat as stat_mod
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator

log = logging.getLogger("ckptfs.state")

#: the secret that seals state files, in the cache directory itself
KEY_NAME = "key"
KEY_BYTES = 32
#: a header line is at most this long (pruning reads no more to recognise a file)
MAX_HEADER = 64 << 10
#: temporary files of a writer killed mid-way are removed after this many seconds
STALE_TEMPORARY = 86400

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_O_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMPORARY = re.compile(r"^\.tmp-[0-9a-f]{16}$")

_said: set = set()
_said_lock = threading.Lock()


class StateFileError(Exception):
    """A state file that is not what ckptfs wrote for this user (unsealed, another kind, malformed)."""


def say_once(where, problem: str) -> None:
    """One warning per (place, problem) in this process: why a state file or folder is not used."""
    key = (str(where), problem)
    with _said_lock:
        if key in _said:
            return
        _said.add(key)
    log.warning("%s: %s; not used (ckptfs computes what it would have held)", where, problem)


def _problem_of_dir(st: os.stat_result) -> str | None:
    if not stat_mod.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by you"
    if st.st_mode & 0o022:
        return f"is writable by others (mode {stat_mod.S_IMODE(st.st_mode):o}; chmod go-w to use it)"
    return None


def problem_of_file(st: os.stat_result, max_bytes: int | None = None) -> str | None:
    """Why an open state file is not trusted (None when it is: a regular file of the user's, private, small enough)."""
    if not stat_mod.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by you"
    if st.st_mode & 0o077:
        return f"is readable or writable by others (mode {stat_mod.S_IMODE(st.st_mode):o})"
    if max_bytes is not None and st.st_size > max_bytes:
        return f"is larger than {max_bytes} bytes"
    return None


def _open_dir(name, dir_fd: int | None, create: bool) -> int:
    """A descriptor on the folder ``name`` (in ``dir_fd``), created private when missing and ``create``."""
    try:
        return os.open(name, _O_DIR, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
    try:
        if dir_fd is None:
            os.makedirs(name, mode=0o700, exist_ok=True)
        else:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        pass
    return os.open(name, _O_DIR, dir_fd=dir_fd)


class StateDir:
    """One checked folder of ckptfs's state (see the module docstring), held open as a directory descriptor."""

    def __init__(self, path: Path, fd: int, key: bytes):
        self.path, self.fd, self._key = Path(path), fd, key

    @classmethod
    def open(cls, root, sub: str = "", *, create: bool = True) -> "StateDir | None":
        """The folder ``root/sub`` (``sub`` one name or ""), checked and created if missing; None — with one log
        line when something is there but not trusted — when it cannot be used."""
        root = Path(root)
        path = root / sub if sub else root
        fds = []
        try:
            fds.append(_open_dir(str(root), None, create))
            why = _problem_of_dir(os.fstat(fds[-1]))
            if why is None and sub:
                fds.append(_open_dir(sub, fds[-1], create))
                why = _problem_of_dir(os.fstat(fds[-1]))
            if why is not None:
                say_once(path, why)
                return None
            key = _secret(fds[0], root)
            if key is None:
                return None
            return cls(path, fds.pop(), key)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                say_once(path, "is a symbolic link or not a directory")
            elif e.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
                say_once(path, f"cannot be opened ({e.strerror or e})")
            return None
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except OSError:
            pass

    # -- reading -------------------------------------------------------------------------------------------
    def open_file(self, name: str, max_bytes: int | None = None):
        """The trusted file ``name`` opened for reading (a binary file object), or None: absent, or not trusted
        (one log line)."""
        try:
            fd = os.open(name, _O_READ, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            say_once(self.path / name, "is a symbolic link" if e.errno == errno.ELOOP else
                     f"cannot be opened ({e.strerror or e})")
            return None
        try:
            why = problem_of_file(os.fstat(fd), max_bytes)
        except OSError as e:
            why = f"cannot be stat'ed ({e.strerror or e})"
        if why is not None:
            os.close(fd)
            say_once(self.path / name, why)
            return None
        return os.fdopen(fd, "rb")

    def read(self, name: str, kind: str, max_bytes: int) -> Iterator:
        """The header, then every value, of the sealed ``kind`` file ``name``, parsed one line at a time;
        ``StateFileError`` when it is absent, not trusted, not of ``kind``, or does not verify — the seal is checked
        at the end, so nothing read may be used before the iteration has ended."""
        f = self.open_file(name, max_bytes)
        if f is None:
            raise StateFileError(f"{self.path / name}: absent or not trusted")
        with f:
            yield from _unseal(f, kind, self._key, self.path / name)

    def load(self, name: str, kind: str, max_bytes: int) -> tuple | None:
        """``(header, [values])`` of a small sealed file, or None when it is absent, untrusted or does not verify."""
        try:
            head, *values = self.read(name, kind, max_bytes)
            return head, values
        except (StateFileError, ValueError):
            return None

    # -- writing -------------------------------------------------------------------------------------------
    def write(self, name: str, header: dict, values: Iterable, *, max_bytes: int | None = None) -> bool:
        """Write the sealed file ``name`` (``header`` must hold ``"ckptfs": kind``; ``values`` JSON-able, written
        one line each) atomically: a private temporary file renamed over ``name``. False when it could not be
        written (or would exceed ``max_bytes``, or a value is not JSON): the state is only an optimisation. A
        non-file under ``name`` (a link, a FIFO) is never replaced."""
        if "ckptfs" not in header:
            raise ValueError("a state file header names its kind")
        tmp = f".tmp-{secrets.token_hex(8)}"
        try:
            fd = os.open(tmp, _O_NEW, 0o600, dir_fd=self.fd)
        except OSError:
            return False
        ok = False
        try:
            with os.fdopen(fd, "wb") as f:
                mac = hashlib.blake2b(key=self._key, digest_size=32)
                written = 0
                for value in _chain(header, values):
                    line = json.dumps(value, separators=(",", ":"), allow_nan=True).encode("utf-8", "surrogatepass")
                    written += len(line) + 1
                    if max_bytes is not None and written > max_bytes:
                        return False
                    mac.update(line + b"\n")
                    f.write(line + b"\n")
                f.write(json.dumps({"seal": mac.hexdigest()}).encode() + b"\n")
            if not self._replaceable(name):
                return False
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            ok = True
            return True
        except (OSError, TypeError, ValueError, RecursionError):
            return False
        finally:
            if not ok:
                try:
                    os.unlink(tmp, dir_fd=self.fd)
                except OSError:
                    pass

    def create(self, name: str):
        """A new private file ``name`` opened for appending (a binary file object): never a link followed, never an
        existing file reused (``OSError`` ``EEXIST`` then)."""
        return os.fdopen(os.open(name, _O_NEW | os.O_APPEND, 0o600, dir_fd=self.fd), "ab")

    def _replaceable(self, name: str) -> bool:
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return True
        why = problem_of_file(st)
        if why is not None:
            say_once(self.path / name, why + " (left as it is)")
        return why is None

    # -- pruning -------------------------------------------------------------------------------------------
    def own_files(self, name: re.Pattern, kind: str) -> list:
        """``[(name, stat)]`` of the files here that are ckptfs's own of ``kind``: the name matches, the file is
        trusted (``problem_of_file``) and its header names ``kind``."""
        out = []
        try:
            names = [n for n in os.listdir(self.fd) if name.fullmatch(n)]
        except OSError:
            return out
        for n in names:
            f = self.open_file(n)
            if f is None:
                continue
            with f:
                try:
                    st = os.fstat(f.fileno())
                    if _header_of(f.readline(MAX_HEADER), kind) is not None:
                        out.append((n, st))
                except OSError:
                    continue
        return out

    def prune(self, name: re.Pattern, kind: str, *, keep=(), max_count: int, max_bytes: int) -> int:
        """Remove the least recently written of ckptfs's own ``kind`` files (``own_files``) beyond ``max_count``
        files or ``max_bytes`` in all, never those named in ``keep``; and temporary files of a writer killed
        mid-way (a day old). Anything not recognised stays. Returns how many files were removed."""
        removed = 0
        stale = time.time() - STALE_TEMPORARY
        try:
            temporaries = [n for n in os.listdir(self.fd) if _TEMPORARY.fullmatch(n)]
        except OSError:
            return 0
        for n in temporaries:
            try:
                st = os.stat(n, dir_fd=self.fd, follow_symlinks=False)
                if problem_of_file(st) is None and st.st_mtime < stale:
                    os.unlink(n, dir_fd=self.fd)
                    removed += 1
            except OSError:
                continue
        found = sorted(((st.st_mtime_ns, st.st_size, n) for n, st in self.own_files(name, kind)), reverse=True)
        count = total = 0
        for _, size, n in found:
            count, total = count + 1, total + size
            if n not in keep and (count > max_count or total > max_bytes):
                try:
                    os.unlink(n, dir_fd=self.fd)
                    removed += 1
                except OSError:
                    continue
        return removed


def _chain(header: dict, values: Iterable):
    yield header
    yield from values


def _header_of(line: bytes, kind: str) -> dict | None:
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    return doc if type(doc) is dict and doc.get("ckptfs") == kind else None


def _unseal(f, kind: str, key: bytes, where) -> Iterator:
    """The values of a sealed file's lines, its header first, the seal checked at the end."""
    mac = hashlib.blake2b(key=key, digest_size=32)
    first = True
    pending = None
    for line in f:
        if pending is not None:
            mac.update(pending)
            value = _json(pending, where)
            if first:
                if type(value) is not dict or value.get("ckptfs") != kind:
                    raise StateFileError(f"{where}: not a {kind} file")
                first = False
            yield value
        pending = line
    if pending is None or first:
        raise StateFileError(f"{where}: cut short")
    seal = _json(pending, where)
    if type(seal) is not dict or not isinstance(seal.get("seal"), str) or \
            not secrets.compare_digest(seal["seal"], mac.hexdigest()):
        raise StateFileError(f"{where}: its seal does not verify (edited, cut short, or not written by you)")


def _json(line: bytes, where):
    try:
        return json.loads(line)
    except ValueError:
        raise StateFileError(f"{where}: a line is not JSON") from None


def _secret(root_fd: int, root: Path) -> bytes | None:
    """The user's sealing key (``KEY_NAME`` in the cache directory), made on first use; None when it cannot be
    read or made, or is not trusted."""
    for _ in range(2):
        try:
            fd = os.open(KEY_NAME, _O_READ, dir_fd=root_fd)
        except FileNotFoundError:
            _make_secret(root_fd)
            continue
        except OSError as e:
            say_once(root / KEY_NAME, "is a symbolic link" if e.errno == errno.ELOOP else
                     f"cannot be opened ({e.strerror or e})")
            return None
        try:
            why = problem_of_file(os.fstat(fd), KEY_BYTES)
            data = os.read(fd, KEY_BYTES + 1) if why is None else b""
        finally:
            os.close(fd)
        if why is None and len(data) != KEY_BYTES:
            why = f"does not hold {KEY_BYTES} bytes"
        if why is not None:
            say_once(root / KEY_NAME, why)
            return None
        return data
    return None


def _make_secret(root_fd: int) -> None:
    """Publish a new key without ever exposing a partial one: written to a temporary file, then linked to its name
    (``link`` fails if another process published one first; that one is used)."""
    tmp = f".tmp-{secrets.token_hex(8)}"
    try:
        fd = os.open(tmp, _O_NEW, 0o600, dir_fd=root_fd)
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
        os.link(tmp, KEY_NAME, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    except OSError:
        pass
    finally:
        try:
            os.unlink(tmp, dir_fd=root_fd)
        except OSError:
            pass
