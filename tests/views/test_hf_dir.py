"""The HF view as a complete directory (issue 15), through the Python API (no FUSE): --hf-format layouts (one
weight format and at most one index per folder, the .bin format in a complete HF folder bin/, no index for a single
shard), --overlay files (at their paths, replacing generated files, confined, read on demand without mixed bytes),
tokenizer files found next to the checkpoint or named by its params, and the token ids they give."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import yaml

import ckptfs
from ckptfs.layouts.pieces import PiecedFile, TensorBytes
from ckptfs.views.hf.overlay import OverlayError
from helpers import FIXTURES
from helpers.tokens import make_tokenizer

LLAMA = FIXTURES / "llama" / "cs" / "checkpoint.mdl"
GPT2 = FIXTURES / "gpt2" / "cs" / "checkpoint.mdl"


def opened(ckpt, **options):
    return ckptfs.open(ckpt, views=options.pop("views", "hf"), **options)


def text(tree, path: str) -> str:
    return tree.read(path, 0, tree.attr(path).size).decode()


def config(tree, path: str = "config.json") -> dict:
    return json.loads(text(tree, path))


def names(tree, folder: str = "") -> set:
    return set(tree.listdir(folder))


def copy_case(case: str, dest: Path) -> Path:
    """The case's checkpoint and params in a folder of their own (a model_dir one can add files to)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURES / case / "cs" / "checkpoint.mdl", dest / "checkpoint.mdl")
    shutil.copy(FIXTURES / case / "cs" / "params.yaml", dest / "params.yaml")
    return dest / "checkpoint.mdl"


# -- weight formats ----------------------------------------------------------------------------------------------


def test_both_formats_unsharded_one_format_per_folder_and_no_index():
    tree = opened(LLAMA)
    try:
        assert names(tree) == {"README.txt", "config.json", "generation_config.json", "model.safetensors", "bin", "hub"}
        assert names(tree, "bin") == {"config.json", "generation_config.json", "pytorch_model.bin"}
        assert text(tree, "bin/config.json") == text(tree, "config.json")
        assert ("bin/: the .bin files (pytorch_model.bin) are here, in a complete HF folder of their own "
                "(from_pretrained(MOUNT/bin, use_safetensors=False))") in text(tree, "README.txt")
    finally:
        tree.close()


def test_both_formats_sharded_have_one_index_each():
    tree = opened(GPT2, max_shard_size="20KB")
    try:
        root, sub = names(tree), names(tree, "bin")
        assert [n for n in root if n.endswith(".index.json")] == ["model.safetensors.index.json"]
        assert [n for n in sub if n.endswith(".index.json")] == ["pytorch_model.bin.index.json"]
        assert not any(n.endswith(".bin") for n in root) and not any(n.endswith(".safetensors") for n in sub)
        index = json.loads(text(tree, "model.safetensors.index.json"))
        assert set(index["weight_map"].values()) == {n for n in root if n.endswith(".safetensors")}
        bin_index = json.loads(text(tree, "bin/pytorch_model.bin.index.json"))
        assert bin_index["weight_map"].keys() == index["weight_map"].keys()
        assert set(bin_index["weight_map"].values()) == {n for n in sub if n.endswith(".bin")}
    finally:
        tree.close()


@pytest.mark.parametrize("fmt, weights", [("safetensors", {"model.safetensors"}), ("bin", {"pytorch_model.bin"})])
def test_one_format_only(fmt, weights):
    tree = opened(LLAMA, hf_format=fmt)
    try:
        assert names(tree) == {"README.txt", "config.json", "generation_config.json", "hub"} | weights
        assert names(tree, "hub") == {"config.json", "generation_config.json"} | weights
        assert "bin/" not in text(tree, "README.txt")
    finally:
        tree.close()


@pytest.mark.parametrize("case, model, repo", [
    ("llama", None, {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "chat_template.jinja"}),
    ("dpo_llama", None, {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                         "tokenizer_config.json", "chat_template.jinja"}),  # the policy model: no ref_model/
    # no model at the root: each model folder, and the files laid over the root
    ("llava", "llava", {"image_model", "text_model", "tokenizer.json", "tokenizer_config.json",
                        "chat_template.jinja"}),
])
def test_hub_is_exactly_the_repository(tmp_path, case, model, repo):
    """hub/ (issue 34): the files of the model's Hugging Face repository — the same file objects as the root's,
    overlay files included, no bin/, no other view, no folder ckptfs adds beside the model — and README.txt says to
    publish it, naming what else the mount has."""
    tok = make_tokenizer(tmp_path / "tok")
    tree = ckptfs.open(FIXTURES / case / "cs" / "checkpoint.mdl", model=model, overlay=tok)
    try:
        assert names(tree, "hub") == repo
        hub = [p for p in tree.file_paths() if p.startswith("hub/")]
        for p in hub:
            assert tree.lookup(p).file is tree.lookup(p[4:]).file, p
        if case == "llava":
            assert {p[4:].split("/", 1)[1] for p in hub if p.count("/") == 2} == {
                "config.json", "generation_config.json", "model.safetensors", "preprocessor_config.json"}
        readme = text(tree, "README.txt")
        head = " ".join(readme.split("\n\nviews:")[0].split())
        assert ("publish: hub/ is exactly the model's Hugging Face repository (config, weights, tokenizer and "
                "overlay files): publish or copy that folder (hf upload ORG/NAME MOUNT/hub; cp -r MOUNT/hub DEST), "
                "not the mount root, which also has README.txt (this file), hub/ (the repository again), ") in head
        want = {"llama": "bin/ (the model again, as .bin files), cs/, tensors/, torch/ (the whole checkpoint",
                "dpo_llama": "bin/ (the model again, as .bin files), ref_model/, cs/, tensors/, torch/",
                "llava": "image_model/bin/ (the model again, as .bin files), text_model/bin/ (the model again"}
        assert want[case] in head
    finally:
        tree.close()


def test_bin_format_bytes_equal_the_both_formats_bin_folder():
    both, single = opened(LLAMA), opened(LLAMA, hf_format="bin")
    try:
        a = b"".join(both.iter_blocks("bin/pytorch_model.bin"))
        assert a == b"".join(single.iter_blocks("pytorch_model.bin"))
    finally:
        both.close()
        single.close()


def test_every_component_folder_gets_its_own_bin_folder():
    tree = ckptfs.open(FIXTURES / "llava" / "cs" / "checkpoint.mdl", model="llava", views="hf")
    try:
        for folder in ("image_model", "text_model"):
            own = names(tree, folder)
            assert "model.safetensors" in own and "bin" in own and not any(n.endswith(".index.json") for n in own)
            sub = names(tree, f"{folder}/bin")
            assert {"config.json", "pytorch_model.bin"} <= sub
            assert own - {"bin", "model.safetensors"} == sub - {"pytorch_model.bin"}, folder  # same small files
    finally:
        tree.close()


class RawLayout(PiecedFile):
    """A made-up weight format for the test below: every tensor's bytes one after the other."""

    def __init__(self, named, name, *, cache=None, **_):
        super().__init__([TensorBytes(t, n) for n, t in named], name=name, cache=cache)


def test_a_new_weight_format_is_one_layout_and_one_row_of_the_table(monkeypatch):
    """The HF view, its folders and the --hf-format choices follow ``hf_formats.FORMATS``: a row naming a layout is
    served on its own, in its own complete HF folder beside the safetensors, and with an index when sharded."""
    from ckptfs.views import options
    from ckptfs.views.hf import formats as hf_formats

    assert options.by_name("hf_format").kind.metavar == "{" + ",".join(hf_formats.choices()) + "}"
    raw = hf_formats.WeightFormat("raw", "weights", ".raw", "raw", "raw tensor bytes", RawLayout)
    monkeypatch.setattr(hf_formats, "FORMATS", hf_formats.FORMATS + (raw,))
    only = opened(GPT2, hf_format="raw")
    both = opened(GPT2)
    sharded = opened(GPT2, hf_format="raw", max_shard_size="20KB")
    try:
        assert names(only) == {"README.txt", "config.json", "generation_config.json", "weights.raw", "hub"}
        st = both.read("model.safetensors", 0, 8)
        header = json.loads(both.read("model.safetensors", 8, int.from_bytes(st, "little")))
        first = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        assert names(both, "raw") == {"config.json", "generation_config.json", "weights.raw"}
        assert "raw/: the raw tensor bytes (weights.raw) are here" in text(both, "README.txt")
        assert not any(p.startswith("hub/raw/") for p in both.file_paths())  # the model again: not in hub/
        assert set(names(both)) >= {"model.safetensors", "bin", "raw"}
        index = json.loads(text(sharded, "weights.raw.index.json"))
        assert len(set(index["weight_map"].values())) > 1 and first in index["weight_map"]
    finally:
        for t in (only, both, sharded):
            t.close()


# -- overlay -----------------------------------------------------------------------------------------------------


def test_overlay_tokenizer_appears_and_its_ids_win(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", pad=0, bos=1, eos=7)
    (tok / "README.md").write_text("# model card\n")
    tree = opened(LLAMA, overlay=tok)
    try:
        root = names(tree)
        assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "README.md"} <= root
        assert text(tree, "README.md") == "# model card\n"
        assert text(tree, "tokenizer.json") == (tok / "tokenizer.json").read_text()
        cfg = config(tree)
        assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 7, 0)
        gen = config(tree, "generation_config.json")
        assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 7, 0)
        assert {"tokenizer.json", "tokenizer_config.json", "README.md"} <= names(tree, "bin")
        assert config(tree, "bin/config.json") == cfg
        readme = text(tree, "README.txt")
        assert f"overlay {tok}" in readme
        assert (f"token ids of config.json and generation_config.json and bin/'s: bos_token_id 1 (tokenizer_config.json "
                f"bos_token '<s>' in {tok}), eos_token_id 7 (tokenizer_config.json eos_token '</s>' in {tok}), "
                f"pad_token_id 0 (tokenizer_config.json pad_token '<pad>' in {tok})") in readme
        assert "no tokenizer files" not in readme
    finally:
        tree.close()


def test_overlay_replaces_generated_files_and_readme_says_so(tmp_path):
    over = tmp_path / "over"
    over.mkdir()
    (over / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9], "do_sample": True}))
    (over / "config.json").write_text('{"model_type": "llama", "mine": true}\n')
    tree = opened(LLAMA, overlay=over)
    try:
        assert json.loads(text(tree, "config.json")) == {"model_type": "llama", "mine": True}
        assert config(tree, "generation_config.json") == {"eos_token_id": [2, 9], "do_sample": True}
        assert config(tree, "bin/generation_config.json") == {"eos_token_id": [2, 9], "do_sample": True}
        readme = text(tree, "README.txt")
        for name in ("config.json", "generation_config.json"):
            assert f"{name} is the overlay's ({over}/{name}), replacing the generated one" in readme
    finally:
        tree.close()


@pytest.mark.parametrize("bring", ["config", "generation_config", "both"])
def test_one_set_of_token_ids_per_mount_whatever_brings_them(tmp_path, bring):
    """Issue 34: an overlay config.json (50256) over a tokenizer whose ids differ (1, 2, 0): config.json and
    generation_config.json, at the root and in bin/, carry the same ids, and README.txt says where each came from."""
    over = make_tokenizer(tmp_path / "over", pad=0, bos=1, eos=2)
    ids = {"bos_token_id": 50256, "eos_token_id": 50256}
    if bring in ("config", "both"):
        cfg = json.loads(text_of(LLAMA, "config.json"))
        (over / "config.json").write_text(json.dumps({**cfg, **ids, "pad_token_id": None}))
    if bring in ("generation_config", "both"):
        (over / "generation_config.json").write_text(json.dumps({**ids, "pad_token_id": 3 if bring == "both" else 0,
                                                                "do_sample": False}))
    tree = opened(LLAMA, overlay=over)
    try:
        got = {p: {k: config(tree, p).get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
               for p in ("config.json", "generation_config.json", "bin/config.json", "bin/generation_config.json")}
        pad = 0 if bring == "generation_config" else None  # null in the overlay's config.json: unset
        if bring == "both":  # the user's two files disagree on pad_token_id: served as given, and said
            assert got["generation_config.json"]["pad_token_id"] == 3
            got = {p: {**v, "pad_token_id": None} for p, v in got.items()}
        assert all(v == {**ids, "pad_token_id": pad} for v in got.values()), got
        readme = text(tree, "README.txt")
        source = "config.json" if bring != "generation_config" else "generation_config.json"
        assert f"eos_token_id 50256 ({source} in {over})" in readme
        assert ("disagree on pad_token_id (None / 3); both are served as given" in readme) == (bring == "both")
    finally:
        tree.close()


def test_readme_names_the_source_of_ids_without_any_tokenizer():
    tree = opened(LLAMA)
    try:
        assert ("token ids of config.json and generation_config.json and bin/'s: bos_token_id 1 (the transformers "
                "config class's default), eos_token_id 2 (the transformers config class's default)") in text(
                    tree, "README.txt")
    finally:
        tree.close()
    tree = opened(FIXTURES / "starcoder" / "cs" / "checkpoint.mdl", hf_format="safetensors")
    try:
        assert "eos_token_id 0 (the family's mapping, as the converter writes it)" in text(tree, "README.txt")
    finally:
        tree.close()


def text_of(ckpt, path: str, **options) -> str:
    tree = opened(ckpt, **options)
    try:
        return text(tree, path)
    finally:
        tree.close()


def test_generation_config_overlay_gives_config_ids(tmp_path):
    over = tmp_path / "over"
    over.mkdir()
    (over / "generation_config.json").write_text(json.dumps({"bos_token_id": 5, "eos_token_id": 6}))
    tree = opened(LLAMA, overlay=over)
    try:
        cfg = config(tree)
        assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (5, 6)
    finally:
        tree.close()


def test_a_later_overlay_wins_and_nested_files_keep_their_paths(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "extra").mkdir(parents=True)
    b.mkdir()
    (a / "notes.txt").write_text("a")
    (a / "extra" / "deep.txt").write_text("deep")
    (b / "notes.txt").write_text("b")
    tree = opened(LLAMA, overlay=[a, b])
    try:
        assert text(tree, "notes.txt") == "b" and text(tree, "extra/deep.txt") == "deep"
        assert f"overlay {b} replaces the earlier overlay's notes.txt" in text(tree, "README.txt")
    finally:
        tree.close()


def test_overlay_folders_of_a_multi_component_model(tmp_path):
    over = tmp_path / "over"
    make_tokenizer(over / "text_model")
    tree = ckptfs.open(FIXTURES / "llava" / "cs" / "checkpoint.mdl", model="llava", views="hf", overlay=over)
    try:
        assert "tokenizer.json" in names(tree, "text_model") and "tokenizer.json" in names(tree, "text_model/bin")
        assert "tokenizer.json" not in names(tree) and "tokenizer.json" not in names(tree, "image_model")
    finally:
        tree.close()


def test_overlay_is_confined(tmp_path):
    over = tmp_path / "over"
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    (over / "sub").mkdir(parents=True)
    (over / "inside.txt").write_text("inside")
    (over / "link_in.txt").symlink_to(over / "inside.txt")
    (over / "link_out.txt").symlink_to(outside)
    (over / "dir_link").symlink_to(tmp_path)
    (over / ".hidden").write_text("h")
    (over / ".git").mkdir()
    (over / ".git" / "config").write_text("g")
    os.mkfifo(over / "fifo")
    tree = opened(LLAMA, overlay=over)
    try:
        root = names(tree)
        assert text(tree, "link_in.txt") == "inside"
        for absent in ("link_out.txt", "dir_link", ".hidden", ".git", "fifo"):
            assert absent not in root, absent
        readme = text(tree, "README.txt")
        assert "link_out.txt is a symbolic link leading outside the overlay" in readme
        assert "fifo is not a regular file" in readme and "dir_link/ is a symbolic link to a directory" in readme
    finally:
        tree.close()


def test_a_hugging_face_cache_snapshot_is_followed_into_its_blobs(tmp_path):
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (blobs / "1f2e").write_text('{"eos_token_id": 9}')
    (snap / "generation_config.json").symlink_to("../../blobs/1f2e")
    tree = opened(LLAMA, overlay=snap)
    try:
        assert config(tree, "generation_config.json") == {"eos_token_id": 9}
        assert config(tree)["eos_token_id"] == 9
    finally:
        tree.close()


def test_a_changed_overlay_file_fails_instead_of_mixing_bytes(tmp_path):
    over = tmp_path / "over"
    over.mkdir()
    f = over / "card.md"
    f.write_text("A" * 1000)
    tree = opened(LLAMA, overlay=over)
    try:
        assert tree.read("card.md", 0, 500) == b"A" * 500
        time.sleep(0.01)
        f.write_text("B" * 1000)  # same size, new content
        with pytest.raises(OverlayError, match="changed since the mount"):
            tree.read("card.md", 500, 500)
        f.unlink()
        with pytest.raises(OverlayError, match="cannot open"):
            tree.read("card.md", 0, 10)
    finally:
        tree.close()


def test_overlay_files_that_would_shadow_the_mount_are_left_out(tmp_path):
    over = tmp_path / "over"
    (over / "cs").mkdir(parents=True)
    (over / "README.txt").write_text("mine")
    (over / "cs" / "x.txt").write_text("x")
    (over / "bin").write_text("a file where the bin/ folder is")
    tree = opened(LLAMA, overlay=over, views="hf,cs")
    try:
        assert "x.txt" not in names(tree, "cs") and "ckptfs:" in text(tree, "README.txt")
        assert tree.lookup("bin").is_dir
        readme = text(tree, "README.txt")
        assert "overlay file README.txt left out" in readme and "overlay file cs/x.txt left out" in readme
        assert "overlay file bin left out" in readme
    finally:
        tree.close()


def test_overlay_must_be_a_directory(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        ckptfs.open(LLAMA, overlay=str(tmp_path / "nope"))


# -- tokenizer discovery -----------------------------------------------------------------------------------------


def test_tokenizer_next_to_the_checkpoint_is_served(tmp_path):
    ckpt = copy_case("llama", tmp_path / "model_dir")
    make_tokenizer(tmp_path / "model_dir", eos=5)
    tree = opened(ckpt)
    try:
        assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names(tree)
        assert "params.yaml" not in names(tree) and config(tree)["eos_token_id"] == 5
        assert f"from {tmp_path / 'model_dir'} (the checkpoint's folder)" in text(tree, "README.txt")
    finally:
        tree.close()


def test_tokenizer_folder_beside_the_checkpoint_is_served(tmp_path):
    ckpt = copy_case("llama", tmp_path / "model_dir")
    make_tokenizer(tmp_path / "model_dir" / "tokenizer")
    tree = opened(ckpt)
    try:
        assert "tokenizer.json" in names(tree) and "tokenizer.json" in names(tree, "bin")
        assert f"from {tmp_path / 'model_dir' / 'tokenizer'}" in text(tree, "README.txt")
    finally:
        tree.close()


def test_tokenizer_named_in_the_params_is_served(tmp_path):
    ckpt = copy_case("llama", tmp_path / "model_dir")
    make_tokenizer(tmp_path / "somewhere" / "tok", eos=6)
    params = yaml.safe_load((tmp_path / "model_dir" / "params.yaml").read_text())
    params["train_input"] = {"tokenizer_path": "../somewhere/tok"}
    (tmp_path / "model_dir" / "params.yaml").write_text(yaml.safe_dump(params))
    tree = opened(ckpt)  # outside the checkpoint's folder: confined (issue 16), a hint says how to opt in
    try:
        assert "tokenizer.json" not in names(tree)
        assert "outside the checkpoint's folder" in text(tree, "README.txt")
    finally:
        tree.close()
    tree = opened(ckpt, allow_external=(tmp_path / "somewhere",))
    try:
        assert "tokenizer.json" in names(tree) and config(tree)["eos_token_id"] == 6
        assert "(params train_input.tokenizer_path)" in text(tree, "README.txt")
    finally:
        tree.close()


def test_a_hub_tokenizer_named_in_the_params_becomes_a_hint(tmp_path):
    ckpt = copy_case("llama", tmp_path / "model_dir")
    params = yaml.safe_load((tmp_path / "model_dir" / "params.yaml").read_text())
    params["train_input"] = {"huggingface_tokenizer": "NousResearch/Llama-2-7b-hf"}
    (tmp_path / "model_dir" / "params.yaml").write_text(yaml.safe_dump(params))
    tree = opened(ckpt)
    try:
        readme = text(tree, "README.txt")
        assert "names the Hugging Face tokenizer 'NousResearch/Llama-2-7b-hf'" in readme
        assert "--overlay DIR" in readme
    finally:
        tree.close()


def test_an_overlay_turns_discovery_off(tmp_path):
    ckpt = copy_case("llama", tmp_path / "model_dir")
    make_tokenizer(tmp_path / "model_dir", eos=5)
    over = tmp_path / "over"
    over.mkdir()
    (over / "README.md").write_text("card")
    tree = opened(ckpt, overlay=over)
    try:
        assert "tokenizer.json" not in names(tree) and config(tree)["eos_token_id"] == 2
    finally:
        tree.close()
