"""The wheel is self-contained: built with `pip wheel --no-deps .` and installed outside the repository, it still
finds its mappings (packaged as ckptfs.mappings) and every command works."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import FIXTURES, run_ckptfs

REPO = Path(__file__).resolve().parent.parent.parent


@pytest.mark.slow  # builds and installs a wheel
@pytest.mark.timeout(300)
def test_wheel_installed_outside_the_repo_finds_its_mappings(tmp_path):
    wheels = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO),
                        "-w", str(wheels)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (wheel,) = wheels.glob("ckptfs-*.whl")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    env = dict(os.environ, PYTHONPATH=str(site))
    code = ("import ckptfs, sys; from ckptfs.mapping.lang.families import list_models; "
            "print(ckptfs.__file__); print(len(list_models()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    where, n = r.stdout.split()
    assert Path(where).is_relative_to(site)  # the installed copy, not the checkout
    assert int(n) >= 15
    ckpt = FIXTURES / "llama" / "cs" / "checkpoint.mdl"
    r = run_ckptfs("info", ckpt, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0 and "llama" in r.stdout, r.stderr
    r = run_ckptfs("export", ckpt, "config.json", "-", text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0 and '"LlamaForCausalLM"' in r.stdout, r.stderr


def test_every_package_of_the_source_tree_is_packaged():
    """pyproject.toml lists its packages by name: a new folder of ckptfs/ (a layer, a backend) must be listed too."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    here = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "ckptfs").rglob("__init__.py")}
    assert here - listed == set()
