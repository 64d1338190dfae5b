"""Installing ckptfs into a user's environment leaves their torch alone: the wheel built from the checkout, installed
offline into a fresh virtual environment that already holds another torch (``torch==2.99.0``, as a training or
serving environment would), is planned and installed without torch; its ``ckptfs --version`` and a mount read by
``from_pretrained`` work; ``ckptfs.load`` without torch says in one line what to install."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

from helpers import FIXTURES, REPO, needs_fuse
from helpers.fuse import force_unmount, is_mounted

FAKE_TORCH = "2.99.0"


def _wheel_requires(wheel: Path) -> list:
    """The ``Requires-Dist`` lines of a wheel's metadata."""
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(name).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def _requirement_closure(requires: list) -> set:
    """The distributions ``requires`` (a wheel's) needs, transitively, as installed here (their names), torch
    left out."""
    from packaging.requirements import Requirement

    seen: set = set()
    todo = [(None, requires, ())]
    while todo:
        dist_name, texts, dist_extras = todo.pop()
        for text in texts if dist_name is None else metadata.requires(dist_name) or ():
            req = Requirement(text)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *dist_extras)):
                continue
            key = req.name.lower().replace("_", "-")
            if key not in seen and key != "torch":
                seen.add(key)
                todo.append((req.name, None, tuple(req.extras)))
    return seen


def _fake_dist(site: Path, name: str, version: str, requires=()) -> None:
    """An installed distribution as pip sees one: its dist-info (metadata only)."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


def _venv_site(venv: Path) -> Path:
    (site,) = venv.glob("lib/python*/site-packages")
    return site


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO),
                        "-w", str(out)], capture_output=True, text=True, cwd=out)
    assert r.returncode == 0, r.stderr
    (whl,) = out.glob("ckptfs-*.whl")
    return whl


@pytest.fixture(scope="module")
def user_env(tmp_path_factory, wheel) -> Path:
    """A fresh virtual environment (with pip, made offline) holding torch 2.99.0 and, as metadata, every other
    distribution ckptfs needs at the versions installed here: what a user's environment looks like to pip."""
    venv = tmp_path_factory.mktemp("user") / "venv"
    r = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    site = _venv_site(venv)
    _fake_dist(site, "torch", FAKE_TORCH)
    for dep in sorted(_requirement_closure(_wheel_requires(wheel))):
        dist = metadata.distribution(dep)
        _fake_dist(site, dist.metadata["Name"], dist.version, dist.requires or ())
    return venv


def _outside_env() -> dict:
    """The environment for the user's pip and ckptfs: nothing of the checkout on the path (no PYTHONPATH; run in
    a folder of the test's own, since the checkout holds the metadata a wheel build left), and no pip settings of
    this machine (its ``find-links`` would offer a torch, its constraints forbid the user's): the wheel folder is the
    only index."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PIP_")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_CONFIG_FILE=os.devnull)  # no configuration file read
    return env


def _pip(venv: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "python"), "-m", "pip", *args], capture_output=True, text=True,
                          env=_outside_env(), cwd=venv.parent)


def _plan(venv: Path, wheel: Path, spec: str) -> list:
    r = _pip(venv, "install", "--dry-run", "--quiet", "--report", "-", "--no-index", "--find-links", str(wheel.parent),
             spec)
    assert r.returncode == 0, r.stderr
    return [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(r.stdout)["install"]]


@pytest.mark.slow  # builds a wheel and a virtual environment
@pytest.mark.timeout(600)
def test_the_wheel_installs_beside_a_users_torch_without_touching_it(wheel, user_env):
    ours = metadata.version("ckptfs")
    assert _plan(user_env, wheel, "ckptfs") == [("ckptfs", ours)]
    assert _plan(user_env, wheel, "ckptfs[torch]") == [("ckptfs", ours)]  # torch 2.99.0 satisfies the extra
    r = _pip(user_env, "install", "--quiet", "--no-index", "--find-links", str(wheel.parent), "ckptfs")
    assert r.returncode == 0, r.stderr
    site = _venv_site(user_env)
    assert [p.name for p in site.glob("torch-*.dist-info")] == [f"torch-{FAKE_TORCH}.dist-info"]
    assert (site / "ckptfs" / "__init__.py").is_file() and (site / "ckptfs" / "mappings").is_dir()


@pytest.mark.slow
@needs_fuse
@pytest.mark.timeout(600)
def test_the_installed_wheel_prints_its_version_and_mounts(wheel, user_env, tmp_path):
    """The wheel's own code, run from the user's environment (the dependencies' modules taken from this one)."""
    from transformers import AutoModelForCausalLM

    site = _venv_site(user_env)
    if not (site / "ckptfs").is_dir():
        r = _pip(user_env, "install", "--quiet", "--no-deps", "--no-index", str(wheel))
        assert r.returncode == 0, r.stderr
    (site / "zz-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = _outside_env()
    env["CKPTFS_CACHE_DIR"] = str(tmp_path / "cache")
    exe = str(user_env / "bin" / "ckptfs")
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"ckptfs {metadata.version('ckptfs')}", r.stdout + r.stderr
    r = subprocess.run([str(user_env / "bin" / "python"), "-c", "import ckptfs; print(ckptfs.__file__)"],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert Path(r.stdout.strip()).is_relative_to(site), r.stdout + r.stderr  # the wheel's copy, not the checkout
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run([exe, "mount", str(FIXTURES / "llama" / "cs" / "checkpoint.mdl"), str(mnt)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        got = AutoModelForCausalLM.from_pretrained(mnt).state_dict()
        ref = AutoModelForCausalLM.from_pretrained(FIXTURES / "llama" / "hf").state_dict()
        assert list(got) == list(ref) and all(got[k].equal(ref[k]) for k in ref)
    finally:
        subprocess.run([exe, "umount", str(mnt)], capture_output=True, env=env, timeout=60)
        if is_mounted(mnt):
            force_unmount(mnt)


@pytest.mark.slow  # starts a Python process
def test_load_without_torch_says_what_to_install():
    code = ("import sys; sys.modules['torch'] = None\n"  # as if torch were not installed
            "import ckptfs\n"
            f"ckptfs.load({str(FIXTURES / 'llama' / 'cs' / 'checkpoint.mdl')!r})\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith("ModuleNotFoundError: ckptfs.load needs PyTorch"), r.stderr
    assert "pip install 'ckptfs[torch]'" in last


@pytest.mark.slow  # starts a Python process
def test_version_is_the_package_metadatas():
    r = subprocess.run([sys.executable, "-m", "ckptfs", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"ckptfs {metadata.version('ckptfs')}", r.stdout + r.stderr


def test_torch_is_an_extra_and_pinned_only_by_the_projects_setup():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.lower().startswith("torch")]
    assert project["optional-dependencies"]["torch"] == ["torch>=2.1"]
    assert '"torch==2.13.0"' in (REPO / "scripts" / "setup.sh").read_text()
