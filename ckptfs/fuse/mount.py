"""Mount lifecycle: mount-point checks (stale mounts included), foreground serving, the background server process
with its readiness wait and log file, and unmounting.

Backgrounding: ``mount(..., foreground=False)`` checks the options and the mount point, then at once starts the
server, ``ckptfs mount … --foreground --status-fd N`` with its output going to a log file, and returns only once the
mount answers (``os.path.ismount`` and a ``stat`` of README.txt). The server is a fork of the calling process when
that has a single thread (the ``ckptfs mount`` command: no second interpreter to start, no import made twice; the
CLI imports nothing that building the tree needs, so the server starts as early as it can), else a fresh
``python -m ckptfs`` process: a fork copies no other thread, and a lock another thread held would stay held. The
checkpoint is opened once, by the server: if it fails before serving (a bad checkpoint, missing params, an unusable
run directory…), it writes its one-line error to the status pipe (fd ``N``) and exits, and ``mount`` raises that
same error (the line a foreground mount prints, plus where the log is). A server that exits without a word fails
with its log's last line. (The server itself forks once, while it is still single-threaded, to build the cs view's
HDF5 skeleton on the other CPU: ``ckptfs.layouts.hdf5.layout.Hdf5Layout.fork_build``.)
"""
from __future__ import annotations

import errno
import json
import logging
import os
import select
import shutil
import signal
import stat as stat_mod
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable
from dataclasses import dataclass
from pathlib import Path

from ..env import fuse_threads
from ..errors import CkptfsError, exit_code
from ..views.options import MountOptions, absolute, check_options, to_argv
from ckptfs.fuse.proctitle import interpreter_prefix, show_only
from ..state.dirs import CACHE_DIR_ENV, cache_dir
from ..state.files import StateDir
from ..tree.assemble import TreeBuilder, build_tree
from ..views.base import README_NAME
from ..storage.s3url import is_s3_url

log = logging.getLogger("ckptfs.mount")

READY_TIMEOUT = 120.0  # seconds the background start may take (tree building included)
POLL_SECONDS = 0.01  # how often the background start looks whether the mount answers
_STALE_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)


class MountError(CkptfsError):
    """The mount point is unusable, the server did not come up, or unmounting failed."""


class NotMountedError(MountError):
    """``ckptfs umount`` on a path where nothing is mounted."""


def stale_fix(mountpoint) -> str:
    return f"clear it with `ckptfs umount {mountpoint}` (or `fusermount3 -u -z {mountpoint}`)"


def proc_mounts() -> list:
    """``(mountpoint, fstype)`` of every mount, from /proc/self/mounts (does not touch the mounts themselves)."""
    from .operations import unescape_mount_path

    out = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    out.append((unescape_mount_path(parts[1]), parts[2]))
    except OSError:
        pass
    return out


def mount_state(mountpoint) -> str:
    """``"mounted"``, ``"stale"`` (a dead FUSE server: ENOTCONN) or ``"none"``."""
    p = os.path.abspath(str(mountpoint))
    try:
        os.stat(p)
    except OSError as e:
        if e.errno in _STALE_ERRNOS:
            return "stale"
        return "none"
    listed = {m for m, _ in proc_mounts()}
    if not (p in listed or os.path.realpath(p) in listed or os.path.ismount(p)):
        return "none"
    try:  # the kernel may still answer stat from its attribute cache; listing reaches the (dead?) server
        with os.scandir(p) as it:
            next(it, None)
    except OSError as e:
        if e.errno in _STALE_ERRNOS:
            return "stale"
    return "mounted"


def check_mountpoint(mountpoint) -> Path:
    """The absolute mount point if it is an existing, empty, unmounted directory; else a ``MountError`` saying why."""
    p = Path(os.path.abspath(str(mountpoint)))
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise MountError(p, "mount point does not exist (create it with mkdir)") from None
    except OSError as e:
        if e.errno in _STALE_ERRNOS:
            raise MountError(p, f"stale mount ({os.strerror(e.errno)}): its server died; {stale_fix(p)}") from None
        raise MountError(p, f"cannot use as mount point: {os.strerror(e.errno or 0)}") from None
    state = mount_state(p)
    if state == "stale":
        raise MountError(p, f"stale mount (Transport endpoint is not connected): its server died; {stale_fix(p)}")
    if state == "mounted":
        raise MountError(p, f"something is already mounted here (unmount it with `ckptfs umount {p}`)")
    if not stat_mod.S_ISDIR(st.st_mode):
        raise MountError(p, "mount point is not a directory")
    try:
        with os.scandir(p) as it:
            if next(it, None) is not None:
                raise MountError(p, "mount point is not empty")
    except PermissionError:
        raise MountError(p, "mount point is not readable") from None
    return p


def fusermount() -> str:
    for name in ("fusermount3", "fusermount"):
        path = shutil.which(name)
        if path:
            return path
    raise MountError(None, "fusermount3 not found: install fuse3 (Debian/Ubuntu: apt install fuse3)")


def unmount(mountpoint) -> str:
    """Unmount a ckptfs (or any FUSE) mount, live or stale: ``fusermount3 -u``, then ``-u -z`` if busy.

    Returns what was done (``"unmounted"`` or ``"lazily unmounted"``).
    """
    p = os.path.abspath(str(mountpoint))
    state = mount_state(p)
    if state == "none":
        raise NotMountedError(p, "not mounted")
    fm = fusermount()
    r = subprocess.run([fm, "-u", p], capture_output=True, text=True)
    if r.returncode == 0:
        return "unmounted"
    first = (r.stderr or r.stdout).strip().splitlines()
    r2 = subprocess.run([fm, "-u", "-z", p], capture_output=True, text=True)
    if r2.returncode == 0:
        return "lazily unmounted"
    msg = (r2.stderr or r2.stdout).strip().splitlines() or first or [f"{fm} failed"]
    raise MountError(p, f"unmount failed: {msg[-1]}")


def _log_folder() -> StateDir:
    """The folder for server logs: ``logs/`` under ckptfs's cache directory when that is the user's own
    (``ckptfs.state.files``) and can be written; else a private folder under the system's temporary directory (a
    read-only HOME or cache directory must not stop a mount); else a ``MountError`` saying what to set."""
    for root in (cache_dir(), Path(tempfile.gettempdir()) / f"ckptfs-{os.getuid()}"):
        folder = StateDir.open(root, "logs")
        if folder is not None:
            if os.access(folder.path, os.W_OK | os.X_OK):
                return folder
            folder.close()
    raise MountError(cache_dir() / "logs", "cannot create a folder for the server's log (read-only home or cache "
                                           f"directory?): set {CACHE_DIR_ENV} to a writable folder")


def log_dir() -> Path:
    """Where a background server writes its log (``_log_folder``)."""
    with _log_folder() as folder:
        return folder.path


def open_log(stem: str) -> tuple:
    """``(path, file)``: a new private log file ``<stem>.log`` (``<stem>-N.log`` when taken) in the log folder,
    created without following a link."""
    with _log_folder() as folder:
        for n in range(100):
            name = f"{stem}.log" if n == 0 else f"{stem}-{n}.log"
            try:
                return folder.path / name, folder.create(name)
            except FileExistsError:
                continue
            except OSError as e:
                raise MountError(folder.path / name, f"cannot write the server's log ({e.strerror or e}): set "
                                                     f"{CACHE_DIR_ENV} to a writable folder") from None
    raise MountError(folder.path / f"{stem}.log", "cannot create the server's log: too many of that name")


def _argument(ckpt) -> str:
    """A checkpoint argument as the server is given it: an absolute path, or the ``s3://`` URL as it is."""
    return str(ckpt) if is_s3_url(ckpt) else os.path.abspath(str(ckpt))


def server_argv(ckpt, mountpoint, options: MountOptions, *, allow_other: bool = False, debug: bool = False) -> list:
    """The ``ckptfs`` arguments that run this mount in the foreground (what the background process executes)."""
    argv = ["mount", _argument(ckpt), os.path.abspath(str(mountpoint)), "--foreground", *to_argv(options)]
    if allow_other:
        argv.append("--allow-other")
    if debug:
        argv.append("--debug")
    return argv


def public_argv(ckpt, mountpoint) -> list:
    """What the background server's command line shows (``/proc/PID/cmdline``, readable by every user): the
    checkpoint and the mount point; never an option (an ``--endpoint-url`` may carry a password)."""
    return ["mount", _argument(ckpt), os.path.abspath(str(mountpoint)), "--foreground"]


def private_options(argv: list) -> list:
    """The part of ``server_argv`` that is not on the server's command line (``public_argv``): sent through a pipe
    of its own (``--options-fd``)."""
    return argv[4:]


def send_options(fd: int, options: list) -> None:
    """Write the server's options to the pipe ``fd`` (JSON) and close it."""
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(options).encode())
    except BrokenPipeError:  # the server died before reading them: its status says why
        pass


#: largest option list a server reads from its options pipe
MAX_OPTIONS_BYTES = 1 << 20


def receive_options(fd: int) -> list:
    """The options ``send_options`` wrote to ``fd`` (read to its end, at most ``MAX_OPTIONS_BYTES``)."""
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_OPTIONS_BYTES + 1)
    try:
        options = json.loads(data) if len(data) <= MAX_OPTIONS_BYTES else None
    except ValueError:
        options = None
    if not isinstance(options, list) or not all(isinstance(a, str) for a in options):
        raise MountError("--options-fd", "the options pipe did not hold a list of arguments")
    return options


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def stop_server(proc, mountpoint) -> None:
    """Stop a server process (terminate, then kill) and leave nothing mounted at ``mountpoint``."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if mount_state(mountpoint) != "none":
        try:
            unmount(mountpoint)
        except CkptfsError:
            pass


def _error_class(name: str) -> type:
    """The ``CkptfsError`` subclass called ``name`` among those this process has imported (``CkptfsError`` if none)."""
    todo, seen = [CkptfsError], {}
    while todo:
        cls = todo.pop()
        seen.setdefault(cls.__name__, cls)
        todo.extend(cls.__subclasses__())
    cls = seen.get(name, CkptfsError)
    return cls if cls.__init__ is CkptfsError.__init__ or cls is CkptfsError else CkptfsError


def encode_status_error(err: CkptfsError) -> bytes:
    """What a server writes to its status pipe when it fails before serving (``relayed_error`` reads it back)."""
    return json.dumps({"type": type(err).__name__, "path": err.path, "problem": err.problem}).encode() + b"\n"


def relayed_error(data: bytes, log_path: Path | None = None) -> CkptfsError | None:
    """The server's error from its status pipe's bytes: the same class when this process knows it (else
    ``CkptfsError``), with the same path and problem (the line the server printed), plus where its log is."""
    try:
        msg = json.loads(data.decode("utf-8", "replace").splitlines()[0])
        where = f" (log: {log_path})" if log_path else ""
        return _error_class(str(msg["type"]))(msg.get("path"), str(msg["problem"]) + where)
    except (ValueError, IndexError, KeyError, TypeError):
        return None


def report_status_error(status_fd: int | None, err: CkptfsError) -> None:
    """Tell the waiting ``ckptfs mount`` (if any) why this server fails; it may be gone already."""
    if status_fd is None:
        return
    try:
        os.write(status_fd, encode_status_error(err))
    except OSError:
        pass


def _read_status(status_r: int) -> bytes:
    """The line a server wrote to its status pipe (up to its newline, the pipe's end, or 1 s of silence)."""
    chunks = []
    while select.select([status_r], [], [], 1.0)[0]:
        data = os.read(status_r, 65536)
        if not data:
            break
        chunks.append(data)
        if b"\n" in data:
            break
    return b"".join(chunks)


def wait_until_mounted(proc, mountpoint, *, timeout: float = READY_TIMEOUT,
                       log_path: Path | None = None, status_r: int | None = None) -> None:
    """Poll until ``mountpoint`` is a mount whose README.txt can be stat'ed; fail early if ``proc`` exits.

    ``status_r``: the read end of the server's status pipe. An error the server writes there is raised (after the
    server has exited) with its log's path; the pipe also wakes this wait as soon as the server exits."""
    p = os.path.abspath(str(mountpoint))
    deadline = time.monotonic() + timeout
    while True:
        if status_r is not None and select.select([status_r], [], [], POLL_SECONDS)[0]:
            data = _read_status(status_r)
            status_r = None  # the caller closes it
            err = relayed_error(data, log_path) if data else None
            if err is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
                raise err
        rc = proc.poll()
        if rc is not None:
            why = _last_line(log_path) if log_path else ""
            where = f" (log: {log_path})" if log_path else ""
            raise MountError(p, f"server exited with code {rc} before mounting: {why or 'no output'}{where}")
        if os.path.ismount(p):
            try:
                os.stat(os.path.join(p, README_NAME))
                return
            except OSError:
                pass
        if time.monotonic() > deadline:
            stop_server(proc, p)
            where = f" (log: {log_path})" if log_path else ""
            raise MountError(p, f"server did not answer within {timeout:.0f} s{where}")
        if status_r is None:
            time.sleep(POLL_SECONDS)


@dataclass
class Started:
    """A background server that answers at ``mountpoint``."""

    pid: int
    mountpoint: Path
    log_path: Path


def single_threaded() -> bool:
    """Whether this process runs a single thread, Python's or native (``/proc/self/task``): only then may it fork."""
    if threading.active_count() != 1:
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


class ForkedServer:
    """A server forked from this process (``start_background``), with the part of ``subprocess.Popen`` that starting
    and stopping it uses: ``pid``, ``poll``, ``wait``, ``terminate``, ``kill``."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: gone, its status unknown
                self.returncode = 1
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"ckptfs server {self.pid}", timeout)
            time.sleep(POLL_SECONDS)
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def _fork_server(serve: Callable[[], int], log_fd: int, status_w: int, shown: list) -> ForkedServer:
    """Run ``serve()`` (the foreground mount, ``_serve_forked``) in a forked child set up as ``Popen`` sets up the
    spawned server (a new session, cwd /, stdin from /dev/null, stdout and stderr to the log, no descriptor but the
    status pipe's), minus the new interpreter and the imports this process already made. The child never returns
    here: it exits with ``serve``'s exit code once the mount ends. Its command line, the caller's until then (options
    and all), is rewritten to show only ``shown``."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # nothing buffered here is written twice
        except (OSError, ValueError, AttributeError):
            pass
    prefix = interpreter_prefix()
    pid = os.fork()
    if pid:
        return ForkedServer(pid)
    code = 1
    try:
        if not show_only([*prefix, *shown]):
            print("ckptfs: the server's command line could not be rewritten: it shows the mount command's",
                  file=sys.stderr)
        os.setsid()
        os.chdir("/")
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.closerange(3, status_w)  # what the caller had open (its pipes, the status pipe's read end, the log)
        os.closerange(status_w + 1, os.sysconf("SC_OPEN_MAX"))
        sys.argv = [sys.argv[0], *shown]  # what this process now runs, as its command line shows it
        code = serve()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - said in the log; the waiting mount reports the exit
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve_forked(ckpt, mountpoint, options: MountOptions, allow_other: bool, debug: bool, status_w: int,
                  build: TreeBuilder) -> int:
    """The forked server's work: the foreground mount of what this process was asked to mount (the options as
    parsed here, nothing parsed again), its error one line in the log and on the status pipe; the exit code."""
    return exit_code(lambda: mount(ckpt, mountpoint, options, foreground=True, allow_other=allow_other, debug=debug,
                                   status_fd=status_w, build=build), debug)


def start_background(ckpt, mountpoint, options: MountOptions, *, allow_other: bool = False,
                     debug: bool = False, timeout: float = READY_TIMEOUT, fork: bool | None = None,
                     build: TreeBuilder = build_tree) -> Started:
    """Start the server (``ckptfs mount … --foreground``) in the background and wait until it answers.

    ``fork``: the server is a fork of this process (default: when this process has a single thread, as the
    ``ckptfs mount`` command does) — it starts without a second interpreter and the imports made here; otherwise a
    new ``python -m ckptfs`` process (which builds its trees with ``build_tree``; a fork keeps ``build``). The server
    gets the write end of a status pipe (``--status-fd``): the error
    that stops it before serving is raised here as the server printed it; on any failure (or Ctrl-C) nothing is left
    running or mounted."""
    args = server_argv(ckpt, mountpoint, options, allow_other=allow_other, debug=debug)
    shown = public_argv(ckpt, mountpoint)
    if fork is None:
        fork = hasattr(os, "fork") and single_threaded()
    log_path, logf = open_log(f"mount-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    status_r, status_w = os.pipe()
    try:
        with logf:
            if fork:
                where = (_argument(ckpt), os.path.abspath(str(mountpoint)), absolute(options))  # the child works in /
                proc = _fork_server(lambda: _serve_forked(*where, allow_other, debug, status_w, build), logf.fileno(),
                                    status_w, shown)
            else:
                # the options go through a pipe of their own, not the command line (``public_argv``)
                options_r, options_w = os.pipe()
                env = dict(os.environ)
                pkg_parent = str(Path(__file__).resolve().parent.parent)
                env["PYTHONPATH"] = os.pathsep.join(x for x in (pkg_parent, env.get("PYTHONPATH")) if x)
                try:
                    proc = subprocess.Popen([sys.executable, "-m", "ckptfs", *shown, "--status-fd", str(status_w),
                                             "--options-fd", str(options_r)],
                                            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, cwd="/",
                                            env=env, start_new_session=True, close_fds=True,
                                            pass_fds=(status_w, options_r))
                finally:
                    os.close(options_r)
                send_options(options_w, private_options(args))
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)  # the server holds the only write end: its exit ends the pipe
    try:
        wait_until_mounted(proc, mountpoint, timeout=timeout, log_path=log_path, status_r=status_r)
    except (KeyboardInterrupt, CkptfsError):  # invalid, or the user gave up waiting: leave nothing behind
        stop_server(proc, mountpoint)
        raise
    finally:
        os.close(status_r)
    return Started(proc.pid, Path(os.path.abspath(str(mountpoint))), log_path)


def setup_logging(debug: bool = False) -> None:
    """Server-side logging: one line per record on stderr (the log file when in the background)."""
    root = logging.getLogger()
    if not any(getattr(h, "_ckptfs", False) for h in root.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        h._ckptfs = True
        root.addHandler(h)
    root.setLevel(logging.DEBUG if debug else logging.INFO)


def mount(ckpt, mountpoint, options: MountOptions | None = None, *, foreground: bool = False,
          allow_other: bool = False, debug: bool = False, status_fd: int | None = None,
          build: TreeBuilder = build_tree) -> Started | None:
    """Mount checkpoint ``ckpt`` at ``mountpoint``.

    Everything that can be checked is checked before anything is mounted (mount point, checkpoint, views), so a
    failure leaves nothing mounted. In the foreground this serves until unmounted or signalled and returns None;
    otherwise it returns once a background server answers, or raises the error that stopped the server.
    ``status_fd``: the server's end of the status pipe of a background start (``start_background``); the error
    that ends this call is written there too. ``build``: what builds a checkpoint's tree (``build_tree``).
    """
    if status_fd is not None:
        os.set_inheritable(status_fd, False)
    try:
        return _mount(ckpt, mountpoint, options or MountOptions(), foreground=foreground, allow_other=allow_other,
                      debug=debug, background_server=status_fd is not None, build=build)
    except CkptfsError as e:
        report_status_error(status_fd, e)
        raise


def _mount(ckpt, mountpoint, options: MountOptions, *, foreground: bool, allow_other: bool, debug: bool,
           background_server: bool, build: TreeBuilder) -> Started | None:
    check_options(options)  # a --config that does not exist or does not parse: one line, nothing mounted
    mp = check_mountpoint(mountpoint)
    from .operations import check_fuse, load_mfusepy

    if not foreground:
        check_fuse()  # a missing libfuse or mfusepy is reported before a server is started
        # The server opens the checkpoint (once) and relays its error, if any: a bad checkpoint is still one line,
        # exit 2, nothing left mounted.
        return start_background(ckpt, mp, options, allow_other=allow_other, debug=debug, build=build)
    load_mfusepy()  # a missing libfuse is reported before anything is built
    from .operations import CACHE_TIMEOUT, pin_malloc, serve, trim_memory

    # before any thread starts: a server of a checkpoint in object storage (or one told to) serves on libfuse's
    # threads (``loop_threads``), which share one malloc arena
    pin_malloc(one_arena=is_s3_url(str(ckpt)) or fuse_threads() is True)
    from ..tree.assemble import classify_source
    from ..tree.run import RUN_CACHE_TIMEOUT, check_run, open_run

    # what CKPT is (source.kind): nothing ckptfs reads is one line, unmounted; a caller's own builder (synthetic
    # files) is given its argument as it is
    src = classify_source(ckpt, options, required=build is build_tree)
    run = src.is_run and not options.single  # a model_dir: the whole training run, live (tree/run.py)
    scanner = None
    if run and background_server:
        scanner = check_run(src.path, options)  # a directory that cannot be followed as a run fails the background start
    tree = open_run(src, options, build_tree=build, scanner=scanner) if run else build(ckpt, options,
                                                                                      fork_builds=True)
    trim_memory()  # what building the tree used and freed (the catalog's HDF5 handle, temporaries) goes back
    tree.warm()  # expensive layouts (the cs view's HDF5 skeleton) build while the mount already answers
    setup_logging(debug)
    log.info("mounting %s at %s (%d %s)", ckpt, mp, tree.file_count, "checkpoints" if run else "files")
    try:
        serve(tree, mp, fsname=f"ckptfs:{_argument(ckpt)}", allow_other=allow_other,
              cache_timeout=RUN_CACHE_TIMEOUT if run else CACHE_TIMEOUT)
    finally:
        tree.close()
    log.info("unmounted %s", mp)
    return None
