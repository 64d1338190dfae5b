"""Hugging Face model folders as a source: every tensor's bytes are the saved tensor's (safetensors and torch .bin,
single and sharded, any dtype, non-contiguous views), Hub cache snapshots and multi-folder models open, and a
crafted folder cannot make ckptfs read outside it or hang; bad files are one line naming the file."""
from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptfs.errors import CheckpointError, SourceChangedError
from ckptfs.tensor import regions
from ckptfs.readers.hf.folder import open_hf_model
from ckptfs.readers.kind import is_hf_folder
from ckptfs.tensor.base import full_box
from helpers import FIXTURES
from helpers.hf import as_hub_cache, llama_state, save_hf

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(model, state: dict, folder: str = ""):
    tensors = model.components[folder].tensors
    assert list(tensors) == list(state) or set(tensors) == set(state)
    for name, t in state.items():
        vt = tensors[name]
        assert vt.shape == tuple(t.shape) and vt.dtype.name == str(t.dtype).removeprefix("torch."), name
        assert vt.read_all().tobytes() == raw(t), name


def one_line_error(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def mixed_state() -> dict:
    st = llama_state(dtype=torch.bfloat16)
    st["extra.f32"] = torch.randn(3, 5)
    st["extra.f16"] = torch.randn(7).half()
    st["extra.i64"] = torch.arange(-3, 3)
    st["extra.bool"] = torch.tensor([True, False, True])
    st["extra.f8"] = torch.randn(4, 2).to(torch.float8_e4m3fn)
    st["extra.scalar"] = torch.tensor(1.25)
    st["extra.empty"] = torch.zeros(0, 4)
    return st


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("shards", [1, 3])
def test_every_tensor_reads_back_bit_for_bit(tmp_path, fmt, shards):
    st = mixed_state()
    save_hf(tmp_path / "m", st, CONFIG, fmt=fmt, shards=shards)
    assert is_hf_folder(tmp_path / "m")
    m = open_hf_model(tmp_path / "m")
    assert m.components[""].format == fmt and m.components[""].config == CONFIG
    assert_same(m, st)
    w = m.components[""].tensors["model.layers.1.self_attn.q_proj.weight"]
    part = w.read(((3, 9), (2, 11)))  # a box reads only its region
    want = st["model.layers.1.self_attn.q_proj.weight"][3:9, 2:11]
    assert part.tobytes() == raw(want)


def test_bin_views_shared_storages_and_parameters(tmp_path, monkeypatch):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    emb = torch.randn(8, 4)
    st = {"t": base.t(), "rows": base[2:5], "cols": base[:, 3:7], "step": base[::2, ::3], "emb": emb, "tied": emb,
          "param": torch.nn.Parameter(torch.randn(3, 3)), "big_t": torch.randn(40, 50).t()}
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(CONFIG))
    torch.save(st, tmp_path / "m" / "pytorch_model.bin")
    monkeypatch.setattr(regions, "STRIDED_SPAN_BYTES", 64)  # strided reads split their boxes
    m = open_hf_model(tmp_path / "m")
    ts = m.components[""].tensors
    assert ts["t"].stride is not None and ts["rows"].stride is None
    assert_same(m, {k: v.detach() for k, v in st.items()})
    assert ts["big_t"].read(((5, 17), (3, 31))).tobytes() == raw(st["big_t"][5:17, 3:31])


def test_hub_cache_snapshot_and_repository_folder(tmp_path):
    st = llama_state()
    save_hf(tmp_path / "src", st, CONFIG, shards=2)
    snap = as_hub_cache(tmp_path / "src", tmp_path / "hub")
    assert (snap / "config.json").is_symlink()
    m = open_hf_model(snap)
    assert m.hub.repo_id == "org/tiny-model" and m.hub.revision == "0" * 40
    assert_same(m, st)
    repo = snap.parent.parent
    m2 = open_hf_model(repo)  # the repository folder: refs/main names the snapshot
    assert m2.path == snap
    assert is_hf_folder(repo) and is_hf_folder(snap)


def test_hub_link_out_of_its_repository_is_refused(tmp_path):
    st = llama_state()
    save_hf(tmp_path / "src", st, CONFIG)
    snap = as_hub_cache(tmp_path / "src", tmp_path / "hub")
    other = as_hub_cache(tmp_path / "src", tmp_path / "hub", repo_id="other/model")
    target = os.path.realpath(other / "model.safetensors")
    (snap / "model.safetensors").unlink()
    os.symlink(target, snap / "model.safetensors")  # into another repository's blobs
    with pytest.raises(CheckpointError) as e:
        open_hf_model(snap)
    msg = one_line_error(e)
    assert "model.safetensors" in msg and "outside the model folder" in msg and "--allow-external" in msg
    m = open_hf_model(snap, allow_external=[other.parent.parent / "blobs"])
    assert_same(m, st)


def test_a_blobs_link_widens_nothing(tmp_path):
    """A snapshot whose repository's blobs/ is a link (to /) gets no blobs root: its links are refused."""
    save_hf(tmp_path / "src", llama_state(), CONFIG)
    snap = as_hub_cache(tmp_path / "src", tmp_path / "hub")
    repo = snap.parent.parent
    (repo / "blobs").rename(tmp_path / "real-blobs")
    os.symlink("/", repo / "blobs")
    for f in snap.iterdir():
        target = tmp_path / "real-blobs" / os.readlink(f).rpartition("/")[2]
        f.unlink()
        os.symlink(os.path.relpath(target, "/").join(["../../blobs/", ""]), f)  # ../../blobs/<root-relative path>
    assert (snap / "config.json").is_file()  # the link works: through blobs -> / to the real file
    with pytest.raises(CheckpointError, match="outside the model folder"):
        open_hf_model(snap)


def test_multi_folder_models_from_the_fixtures():
    m = open_hf_model(FIXTURES / "llava" / "hf")
    assert list(m.components) == ["image_model", "text_model"]
    assert m.components["text_model"].config["model_type"] == "llama"
    m = open_hf_model(FIXTURES / "dpr" / "hf")
    assert list(m.components) == ["q_encoder", "ctx_encoder"]
    from safetensors.numpy import load_file

    for folder, c in m.components.items():
        ref = load_file(str(c.path / "model.safetensors"))
        assert set(ref) == set(c.tensors)
        for name, arr in ref.items():
            assert c.tensors[name].read_all().tobytes() == arr.tobytes(), (folder, name)


# -- confinement -------------------------------------------------------------------------------------------------

def _folder(tmp_path, fmt="safetensors", shards=1) -> Path:
    return save_hf(tmp_path / "m", llama_state(), CONFIG, fmt=fmt, shards=shards)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", "..", ""])
def test_index_entries_naming_other_folders_are_refused(tmp_path, shard):
    m = _folder(tmp_path, shards=2)
    idx = m / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    doc["weight_map"][next(iter(doc["weight_map"]))] = shard
    idx.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError) as e:
        open_hf_model(m)
    assert "not a file name in its folder" in one_line_error(e) and "index.json" in str(e.value)


def test_links_out_of_the_folder_are_refused(tmp_path):
    m = _folder(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (m / "model.safetensors").rename(outside / "w.safetensors")
    os.symlink(outside / "w.safetensors", m / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        open_hf_model(m)
    assert "outside the model folder" in one_line_error(e)
    assert open_hf_model(m, allow_external=[outside]).components[""].tensors
    os.symlink("/etc/hostname", m / "config.json.tmp")
    (m / "config.json").unlink()
    (m / "config.json.tmp").rename(m / "config.json")
    with pytest.raises(CheckpointError, match="config.json: leads to .*outside the model folder"):
        open_hf_model(m, allow_external=[outside])


@pytest.mark.parametrize("victim", ["config.json", "model.safetensors"])
def test_fifos_and_devices_are_refused_without_blocking(tmp_path, victim):
    m = _folder(tmp_path)
    (m / victim).unlink()
    os.mkfifo(m / victim)
    with pytest.raises(CheckpointError) as e:
        open_hf_model(m)  # a FIFO would block an open without O_NONBLOCK
    assert "FIFO" in one_line_error(e)
    (m / victim).unlink()
    os.symlink("/dev/zero", m / victim)
    with pytest.raises(CheckpointError) as e:
        open_hf_model(m, allow_external=["/dev"])
    assert "character device" in one_line_error(e)


# -- bad files ---------------------------------------------------------------------------------------------------

def _rewrite_header(path: Path, edit):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])


@pytest.mark.parametrize("edit, words", [
    (lambda h: h["lm_head.weight"].update(data_offsets=[0, 1 << 40]), "outside"),
    (lambda h: h["lm_head.weight"].update(shape=[3, 3]), "needs"),
    (lambda h: h["lm_head.weight"].update(dtype="Q7"), "unknown dtype"),
    (lambda h: h["lm_head.weight"].update(shape=[-1, 16]), "negative dimension"),
])
def test_bad_safetensors_headers(tmp_path, edit, words):
    m = _folder(tmp_path)
    _rewrite_header(m / "model.safetensors", edit)
    with pytest.raises(CheckpointError) as e:
        open_hf_model(m)
    msg = one_line_error(e)
    assert "model.safetensors" in msg and words in msg


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def _bin_with(tmp_path, obj, **kw) -> Path:
    m = tmp_path / "m"
    m.mkdir(exist_ok=True)
    (m / "config.json").write_text(json.dumps(CONFIG))
    torch.save(obj, m / "pytorch_model.bin", **kw)
    return m


def test_pickled_code_is_refused_in_one_line(tmp_path):
    m = _bin_with(tmp_path, {"w": torch.zeros(2), "evil": _Evil()})
    with pytest.raises(CheckpointError) as e:
        open_hf_model(m)
    msg = one_line_error(e)
    assert "pytorch_model.bin" in msg and "global posix.system is not allowed" in msg
    assert not (Path.cwd() / "pwned").exists()


def test_legacy_and_broken_bin_files(tmp_path):
    m = _bin_with(tmp_path, {"w": torch.zeros(2)}, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="legacy .*serialization"):
        open_hf_model(m)
    m = _bin_with(tmp_path, {"w": torch.zeros(2)})
    data = (m / "pytorch_model.bin").read_bytes()
    (m / "pytorch_model.bin").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError) as e:
        open_hf_model(m)
    assert "pytorch_model.bin" in one_line_error(e)
    # a member compressed (torch never does) is refused, not inflated
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(buf, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info),
                         zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED)
    (m / "pytorch_model.bin").write_bytes(buf.getvalue())
    with pytest.raises(CheckpointError, match="is compressed"):
        open_hf_model(m)


def test_a_view_reaching_past_its_storage_is_refused(tmp_path):
    m = _bin_with(tmp_path, {"w": torch.arange(12, dtype=torch.float32)})
    path = m / "pytorch_model.bin"
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    pkl_name = next(n for n in members if n.endswith("data.pkl"))
    pkl = members[pkl_name]
    members[pkl_name] = pkl.replace(b"K\x0c\x85", b"K\x0d\x85", 1)  # size (12,) -> (13,)
    assert members[pkl_name] != pkl
    with zipfile.ZipFile(path, "w") as z:
        for n, b in members.items():
            z.writestr(n, b)
    with pytest.raises(CheckpointError, match="reaches 52 bytes of a 48-byte storage"):
        open_hf_model(m)


def test_index_and_shard_disagreements(tmp_path):
    m = _folder(tmp_path, shards=2)
    idx = m / "model.safetensors.index.json"
    doc = json.loads(idx.read_text())
    doc["weight_map"]["not.in.any.shard"] = next(iter(doc["weight_map"].values()))
    idx.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="which has no such tensor"):
        open_hf_model(m)
    idx.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="is a JSON list, not an object"):
        open_hf_model(m)


@pytest.mark.parametrize("content, words", [(b"{not json", "is not valid JSON"), (b"[]", "JSON list"),
                                            (b" " * (5 << 20), "more than the")])
def test_bad_config(tmp_path, content, words):
    m = _folder(tmp_path)
    (m / "config.json").write_bytes(content)
    with pytest.raises(CheckpointError) as e:
        open_hf_model(m)
    assert "config.json" in one_line_error(e) and words in str(e.value)


def test_no_weights_and_other_formats(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    (m / "config.json").write_text(json.dumps(CONFIG))
    (m / "tf_model.h5").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="tf_model.h5 .a format ckptfs does not read"):
        open_hf_model(m)


def test_a_model_dir_holding_hf_files_stays_a_run(tmp_path):
    m = _folder(tmp_path)
    assert is_hf_folder(m)
    (m / "checkpoint_100.mdl").write_bytes(b"")
    assert not is_hf_folder(m)


def test_safetensors_preferred_over_bin_as_transformers_does(tmp_path):
    st = llama_state()
    save_hf(tmp_path / "m", st, CONFIG)
    torch.save({"other": torch.zeros(1)}, tmp_path / "m" / "pytorch_model.bin")
    m = open_hf_model(tmp_path / "m")
    assert m.components[""].files == ("model.safetensors",) and "pytorch_model.bin not read" in " ".join(m.notes)
    assert_same(m, st)


def test_a_file_changed_after_opening_fails_its_reads(tmp_path):
    st = llama_state()
    m = _folder(tmp_path)
    model = open_hf_model(m)
    t = model.components[""].tensors["lm_head.weight"]
    assert t.read_all().tobytes() == raw(st["lm_head.weight"])
    with open(m / "model.safetensors", "r+b") as f:
        f.seek(0, 2)
        f.write(b"\0" * 8)
    with pytest.raises(SourceChangedError, match="changed since it was opened"):
        t.read(full_box(t.shape))
