"""An S3 command's first request leaves before the modules it does not need are imported: ``ckptfs info``, ``ls`` and
a mount of an ``s3://`` location import neither boto3 (botocore's client is all they use) nor the readers of what
they find (numpy, h5py), the mapping core or a framework before it; and nothing connects anywhere but the endpoint
(no instance-metadata lookup) when the credentials come from the environment or a credentials file.

The real ``python -m ckptfs`` runs against moto's server on 127.0.0.1, with a ``sitecustomize`` module (the test's,
first on ``PYTHONPATH``) that records every outgoing connection and the modules imported at the first one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import needs_fuse
from helpers.fuse import mounted
from helpers.s3 import ACCESS_KEY, SECRET_KEY, endpoint_with

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # processes: the CLI, a server, a mount

LAYOUT = "s3://ckpts/s3_llama/checkpoint_100.mdl"  # Cerebras' S3 layout: a prefix of objects
HDF5_OBJECT = "s3://ckpts/s3_run/synced_model_dir/checkpoint_0.mdl"  # an HDF5 .mdl stored as one object
RUN = "s3://ckpts/s3_run/model_dir"

#: modules an S3 command does not need before its first request: boto3 (and its transfer manager), what reads the
#: checkpoint's bytes, the mapping core and its YAML, the frameworks
NOT_BEFORE_FIRST_REQUEST = ("boto3", "s3transfer", "numpy", "h5py", "hdf5plugin", "zstandard", "yaml", "torch",
                            "transformers", "tensorflow", "safetensors", "ckptfs.mapping", "ckptfs.tensor.base",
                            "ckptfs.catalog.model", "ckptfs.readers.cerebras.h5store", "ckptfs.readers.s3.layout")

RECORDER = '''\
"""The test's recorder (tests/readers/s3/test_s3_startup.py): every outgoing connection of this process, and the
modules imported when the first one was made, as JSON in $S3_STARTUP_RECORD."""
import json, os, socket, sys, threading

_path = os.environ.get("S3_STARTUP_RECORD")
if _path:
    _connect = socket.socket.connect
    _record = {"connects": [], "modules": None}
    _lock = threading.Lock()

    def connect(self, address):
        with _lock:
            _record["connects"].append(address if isinstance(address, str) else [str(a) for a in address[:2]])
            if _record["modules"] is None:
                _record["modules"] = sorted(sys.modules)
            with open(_path + ".tmp", "w") as f:
                json.dump(_record, f)
            os.replace(_path + ".tmp", _path)
        return _connect(self, address)

    socket.socket.connect = connect
'''


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    yield from endpoint_with(tmp_path_factory.mktemp("s3"), "s3_llama", "s3_run")


@pytest.fixture
def recorded(s3, tmp_path):
    """``(env, record path)``: an environment for a recorded ckptfs process, its credentials in the environment and
    the instance-metadata service NOT turned off (it must not be asked all the same)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(RECORDER)
    record = tmp_path / "record.json"
    env = s3.env(CKPTFS_CACHE_DIR=str(tmp_path / "cache"), S3_STARTUP_RECORD=str(record))
    env.pop("AWS_EC2_METADATA_DISABLED")
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env, record


def ckptfs(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptfs", *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=180)


def first_request(record: Path, s3) -> list:
    """The modules imported when the process made its first connection; every connection went to the endpoint."""
    assert record.exists(), "the process made no connection (or the recorder did not run)"
    seen = json.loads(record.read_text())
    assert seen["connects"] and all(c == ["127.0.0.1", str(s3.port)] for c in seen["connects"]), seen["connects"]
    return seen["modules"]


def too_early(modules: list) -> list:
    return [m for m in modules if m in NOT_BEFORE_FIRST_REQUEST or m.startswith(tuple(
        f"{name}." for name in NOT_BEFORE_FIRST_REQUEST))]


@pytest.mark.parametrize("command, location, says", [
    ("info", LAYOUT, "tensors: 22"),
    ("info", HDF5_OBJECT, "format: 0.5"),
    ("info", RUN, "latest: checkpoint_200"),
    ("ls", LAYOUT, "model/"),
])
def test_the_first_request_leaves_before_the_modules_the_command_does_not_need(s3, recorded, command, location, says):
    env, record = recorded
    r = ckptfs(command, location, env=env)
    assert r.returncode == 0 and says in r.stdout, r.stdout + r.stderr
    modules = first_request(record, s3)
    assert "botocore.client" in modules  # the recorder saw the S3 client's connection
    assert too_early(modules) == []


def test_credentials_from_a_credentials_file_ask_no_metadata_service(s3, recorded, tmp_path):
    env, record = recorded
    creds = tmp_path / "credentials"
    creds.write_text(f"[reader]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        env.pop(name)
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(creds), AWS_PROFILE="reader")
    r = ckptfs("info", LAYOUT, env=env)
    assert r.returncode == 0 and "tensors: 22" in r.stdout, r.stdout + r.stderr
    assert too_early(first_request(record, s3)) == []


@needs_fuse
def test_a_mount_server_makes_its_first_request_before_the_readers_are_imported(s3, recorded):
    env, record = recorded
    with mounted(LAYOUT, env=env) as mnt:
        assert (mnt / "config.json").stat().st_size > 0
    assert too_early(first_request(record, s3)) == []
