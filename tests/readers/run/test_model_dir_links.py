"""What a model_dir names is untrusted (issue 31, attacks 8, 9 and 12): a ``latest`` pointer and a checkpoint name
that is a link are confined to the model_dir, read with a size bound and followed once; a file open in a run mount
keeps its attributes after its checkpoint leaves the listing."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ckptfs.errors import CheckpointError
from ckptfs.readers import resolve_checkpoint
from helpers import needs_fuse, real_env, run_ckptfs
from helpers.fuse import mounted
from helpers.run import model_dir, norm_of, save

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # every test runs the CLI or mounts


@pytest.fixture
def run_and_outside(tmp_path) -> tuple:
    """A model_dir with checkpoint_1 and a folder beside it holding checkpoint_9 (another run's)."""
    d = model_dir(tmp_path / "run")
    save(d, 1)
    outside = model_dir(tmp_path / "outside")
    save(outside, 9)
    return d, outside


# -- attack 8: the latest pointer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["text", "symlink", "text-folder"])
def test_a_pointer_out_of_the_model_dir_is_not_followed(run_and_outside, kind):
    d, outside = run_and_outside
    if kind == "text":
        (d / "latest").write_text("../outside/checkpoint_9.mdl\n")
    elif kind == "symlink":
        (d / "latest").symlink_to(outside / "checkpoint_9.mdl")
    else:  # a folder elsewhere (as "/" is): it would be searched for checkpoints
        (d / "latest").write_text(f"{outside}\n")
    with pytest.raises(CheckpointError, match="outside the model_dir"):
        resolve_checkpoint(d)
    if kind != "text-folder":  # a folder is never a pointer's target: the pointer is followed once, to a file
        assert os.path.samefile(resolve_checkpoint(d, allow_external=[outside]), outside / "checkpoint_9.mdl")
    r = run_ckptfs("export", d, "model.safetensors", "-", env=real_env())
    assert r.returncode == 2 and b"outside the model_dir" in r.stderr and b"Traceback" not in r.stderr
    assert r.stdout == b""


@pytest.mark.parametrize("cycle", ["self-link", "self-text", "two-links"])
def test_a_pointer_cycle_is_one_line(run_and_outside, cycle):
    d, _ = run_and_outside
    if cycle == "self-link":
        (d / "latest").symlink_to("latest")
    elif cycle == "self-text":
        (d / "latest").write_text("latest\n")
    else:
        (d / "latest").symlink_to("other")
        (d / "other").symlink_to("latest")
    r = run_ckptfs("info", d, "--single", env=real_env())
    err = r.stderr.decode()
    assert r.returncode == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "latest" in err


def test_a_huge_pointer_file_is_not_read(run_and_outside):
    d, _ = run_and_outside
    with open(d / "latest", "wb") as f:
        f.truncate(256 << 20)  # sparse: costs no disk, 256 MiB to whoever reads it whole
    probe = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, "
             "stderr=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    r = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "ckptfs", "ls", str(d)],
                       env=real_env(), capture_output=True, text=True, timeout=120)
    peak_kib = int(r.stdout.strip())
    assert peak_kib < 200 << 10, peak_kib  # ckptfs ls alone peaks near 100 MiB
    r = run_ckptfs("ls", d, env=real_env())
    assert r.returncode == 0 and b"checkpoint_1.mdl" in r.stdout  # the run is listed, the pointer ignored
    assert b"4096" in r.stdout or b"pointer" in r.stdout


# -- attack 9: a checkpoint name that is a link out of the model_dir ----------------------------------------------


@needs_fuse
def test_a_run_mount_does_not_serve_a_checkpoint_linked_from_outside(run_and_outside):
    d, outside = run_and_outside
    (d / "checkpoint_2.mdl").symlink_to(outside / "checkpoint_9.mdl")
    (d / "checkpoint_3.mdl").symlink_to("checkpoint_1.mdl")  # a link inside the model_dir is fine
    with mounted(d, env=real_env()) as mnt:
        names = sorted(os.listdir(mnt))
        readme = (mnt / "README.txt").read_text()
        assert "checkpoint_2" not in names and "checkpoint_3" in names, names
        assert "checkpoint_2.mdl" in readme and "outside" in readme and "not served" in readme
        assert norm_of((mnt / "latest" / "model.safetensors").read_bytes())[0] == 1  # checkpoint_3 -> step 1


# -- attack 12: fstat of a file whose checkpoint left the listing --------------------------------------------------


@needs_fuse
def test_fstat_of_an_open_file_works_after_its_checkpoint_is_deleted(tmp_path):
    d = model_dir(tmp_path / "run")
    save(d, 1)
    save(d, 2)
    with mounted(d, env=real_env()) as mnt:
        f = open(mnt / "checkpoint_1" / "config.json", "rb")
        try:
            size = os.fstat(f.fileno()).st_size
            (d / "checkpoint_1.mdl").unlink()
            deadline = time.monotonic() + 60
            while "checkpoint_1" in os.listdir(mnt):
                assert time.monotonic() < deadline, "checkpoint_1 still listed"
                time.sleep(0.2)
            time.sleep(1.5)  # past the kernel's attribute timeout: fstat asks the server again
            assert os.fstat(f.fileno()).st_size == size
            assert len(f.read()) == size
        finally:
            f.close()
