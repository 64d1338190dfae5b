"""Tokenizer files beside a checkpoint in a bucket are served as those beside a local checkpoint are: the same places
in the same order (the checkpoint's folder, its tokenizer/, the params file's folder), confined to the checkpoint's
and the params file's prefixes, bounded in size, read by range naming the ETag listed; README.txt says where they
came from. Against moto's server on 127.0.0.1, through real FUSE mounts and transformers' AutoTokenizer."""
from __future__ import annotations

import pytest

from helpers import FIXTURES, needs_fuse
from helpers.fuse import mounted
from helpers.s3 import LocalS3, upload_case
from helpers.tokens import make_tokenizer, prompts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # processes: the CLI, a server, TensorFlow

LAYOUT = "s3://ckpts/s3_llama/checkpoint_100.mdl"  # S3 layout: a prefix; tokenizer files beside it
OBJECT = "s3://ckpts/objrun/checkpoint_1000.mdl"  # an .mdl object; tokenizer files in objrun/tokenizer/
SPLIT = "s3://ckpts/split/ckpts/checkpoint_5.mdl"  # params (and tokenizer) in split/train/, one level up
FAR = "s3://ckpts/far/checkpoint_7.mdl"  # params naming a tokenizer elsewhere in the bucket


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def s3(tmp_path_factory, tok):
    srv = LocalS3(tmp_path_factory.mktemp("s3"))
    upload_case(srv, "s3_llama")
    c = srv.client()
    mdl = (FIXTURES / "llama" / "cs" / "checkpoint.mdl").read_bytes()
    params = (FIXTURES / "llama" / "cs" / "params.yaml").read_bytes()
    objects = {"objrun/checkpoint_1000.mdl": mdl, "objrun/params.yaml": params,
               "split/ckpts/checkpoint_5.mdl": mdl, "split/train/params_train.yaml": params,
               "far/checkpoint_7.mdl": mdl,
               "far/params.yaml": params + b"\ntokenizer_path: s3://ckpts/elsewhere/\n",
               "elsewhere/tokenizer.json": tok["tokenizer.json"]}
    for name, body in tok.items():
        objects[f"s3_llama/{name}"] = body
        objects[f"objrun/tokenizer/{name}"] = body
        objects[f"split/train/{name}"] = body
    for key, body in objects.items():
        c.put_object(Bucket="ckpts", Key=key, Body=body)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def env(s3, tmp_path_factory):
    return s3.env(CKPTFS_CACHE_DIR=str(tmp_path_factory.mktemp("cache")))


@needs_fuse
@pytest.mark.parametrize("ckpt,where", [(LAYOUT, "s3://ckpts/s3_llama/ (the checkpoint's folder in the bucket)"),
                                        (OBJECT, "s3://ckpts/objrun/tokenizer/"),
                                        (SPLIT, "s3://ckpts/split/train/ (the params file's folder in the bucket)")])
def test_tokenizer_files_in_the_bucket_are_served_and_autotokenizer_loads_them(s3, env, tok, tmp_path, ckpt, where):
    from transformers import AutoTokenizer

    local = tmp_path / "local-tokenizer"
    local.mkdir()
    for name, body in tok.items():
        (local / name).write_bytes(body)
    expected = AutoTokenizer.from_pretrained(local)
    with mounted(ckpt, env=env) as mnt:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            assert (mnt / name).read_bytes() == tok[name], name
        got = AutoTokenizer.from_pretrained(mnt)
        readme = (mnt / "README.txt").read_text()
    for text in prompts():
        assert got(text)["input_ids"] == expected(text)["input_ids"]
    assert f"tokenizer files chat_template.jinja, tokenizer.json, tokenizer_config.json from {where}" in readme
    assert "no tokenizer files" not in readme


def test_a_tokenizer_named_outside_the_checkpoint_and_params_prefixes_is_not_read(s3, env, monkeypatch):
    import ckptfs

    for k, v in env.items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    tree = ckptfs.open(FAR, views="hf")
    try:
        assert "tokenizer.json" not in tree.file_paths()
        readme = tree.read("README.txt", 0, 1 << 20).decode()
    finally:
        tree.close()
    assert "tokenizer location s3://ckpts/elsewhere (params tokenizer_path) lies outside" in readme, readme
    assert "no tokenizer files" in readme


def test_a_tokenizer_file_over_the_bound_is_left_out_with_a_note(s3, env, monkeypatch):
    import ckptfs
    from ckptfs.views.hf import s3_tokenizers as s3tokenizer

    for k, v in env.items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    monkeypatch.setattr(s3tokenizer, "MAX_FILE_BYTES", 1000)  # tokenizer.json is larger, the other files smaller
    tree = ckptfs.open(LAYOUT, views="hf")
    try:
        names = tree.file_paths()
        readme = tree.read("README.txt", 0, 1 << 20).decode()
    finally:
        tree.close()
    assert "tokenizer.json" not in names and "tokenizer_config.json" in names
    assert "s3://ckpts/s3_llama/tokenizer.json is larger than" in readme, readme


def test_a_tokenizer_object_replaced_after_opening_fails_its_reads(s3, env, tok, monkeypatch):
    import ckptfs
    from ckptfs.errors import SourceChangedError

    for k, v in env.items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    key = "objrun/tokenizer/chat_template.jinja"  # not read while the view is built (token ids are not in it)
    tree = ckptfs.open(OBJECT, views="hf")
    try:
        size = tree.attr("chat_template.jinja").size
        s3.client().put_object(Bucket="ckpts", Key=key, Body=tok["chat_template.jinja"].replace(b"m", b"M"))
        with pytest.raises(SourceChangedError):
            tree.read("chat_template.jinja", 0, size)
    finally:
        tree.close()
        s3.client().put_object(Bucket="ckpts", Key=key, Body=tok["chat_template.jinja"])
