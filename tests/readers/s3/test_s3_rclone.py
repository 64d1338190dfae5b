"""A second S3-compatible server beside moto: ``rclone serve s3`` on 127.0.0.1, which spells ETags its own way (bare in
a listing, quoted on a GET). A checkpoint object served by it mounts through a real FUSE mount with the same bytes as
the local file; ETags are compared as S3 clients compare them (``ckptfs.storage.etag``)."""
from __future__ import annotations

import shutil

import pytest

from helpers import FIXTURES, needs_fuse
from helpers.fuse import mounted
from helpers.rclone import RcloneS3

from ckptfs.storage.etag import if_match, normal_etag, same_etag

pytestmark = pytest.mark.slow  # processes: the CLI, a server, TensorFlow


@pytest.mark.parametrize("a,b", [('"d9586e"', "d9586e"), ('W/"d9586e"', '"d9586e"'), (" d9586e ", 'w/"d9586e"'),
                                 ('"abc-3"', "abc-3")])
def test_spellings_of_one_etag_are_the_same(a, b):
    assert same_etag(a, b) and normal_etag(a) == normal_etag(b)
    assert if_match(a) == f'"{normal_etag(b)}"'


def test_different_etags_differ():
    assert not same_etag('"d9586e"', '"d9586f"') and not same_etag("", "x")


@pytest.fixture(scope="module")
def rclone(tmp_path_factory):
    root = tmp_path_factory.mktemp("rclone")
    bucket = root / "served" / "bucket"
    bucket.mkdir(parents=True)
    shutil.copy(FIXTURES / "llama" / "cs" / "checkpoint.mdl", bucket / "checkpoint.mdl")
    shutil.copy(FIXTURES / "llama" / "cs" / "params.yaml", bucket / "params.yaml")
    srv = RcloneS3(root / "served", root / "rclone.log")
    yield srv
    srv.stop()


def test_rclone_spells_listing_and_get_etags_differently(rclone):
    """What the test below relies on: the server really does spell the two ETags differently."""
    c = rclone.client()
    listed = c.list_objects_v2(Bucket="bucket")["Contents"]
    got = c.get_object(Bucket="bucket", Key="checkpoint.mdl", Range="bytes=0-9")
    (etag,) = [o["ETag"] for o in listed if o["Key"] == "checkpoint.mdl"]
    assert etag != got["ETag"] and same_etag(etag, got["ETag"])


@needs_fuse
@pytest.mark.timeout(300)
def test_a_checkpoint_served_by_rclone_mounts_as_the_local_file(rclone, tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    shutil.copy(FIXTURES / "llama" / "cs" / "checkpoint.mdl", local / "checkpoint.mdl")
    shutil.copy(FIXTURES / "llama" / "cs" / "params.yaml", local / "params.yaml")
    env = rclone.env(tmp_path, CKPTFS_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("AWS_ENDPOINT_URL")  # named on the command line instead
    with mounted(local / "checkpoint.mdl", env=env) as here:
        expected = (here / "model.safetensors").read_bytes()
        expected_cfg = (here / "config.json").read_bytes()
    with mounted("s3://bucket/checkpoint.mdl", "--endpoint-url", rclone.url, env=env) as there:
        assert (there / "model.safetensors").read_bytes() == expected
        assert (there / "config.json").read_bytes() == expected_cfg
        readme = (there / "README.txt").read_text()
    assert "params: s3://bucket/params.yaml" in readme
