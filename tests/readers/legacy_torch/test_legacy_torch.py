"""Legacy-mode checkpoints: a ``torch.save`` zip of a Cerebras state mounts, exports and diffs like an HDF5 ``.mdl``
of the same state (``ckptfs/readers/legacy_torch/reader.py``), read without unpickling; hostile files are refused in one
line, nothing mounted."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from ckptfs.errors import CheckpointError
from ckptfs.readers import open_checkpoint
from ckptfs.commands.compare import EQUAL, diff_checkpoints
from ckptfs.readers.legacy_torch.reader import HEAD_BYTES, is_legacy_torch
from ckptfs.catalog.materialize import to_torch
from helpers import FIXTURES, real_env, run_ckptfs
from helpers.fuse import mounted
from test_source_reference import _ref_cases

pytestmark = pytest.mark.slow  # processes: the CLI, a server, TensorFlow

LEGACY = FIXTURES / "legacy_torch" / "llama" / "checkpoint_0.pt"
LLAMA_MDL = FIXTURES / "llama" / "cs" / "checkpoint.mdl"
TRAIN_PT = FIXTURES / "train_gpt2" / "ref.pt"
TRAIN_MDL = FIXTURES / "train_gpt2" / "cs" / "checkpoint.mdl"


def _sha(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()


# -- the fixture through real mounts ----------------------------------------------------------------------------------


def test_hf_view_through_fuse_equals_the_converters_output_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    expected = json.loads((FIXTURES / "llama" / "expected_hf" / "keys.json").read_text())["tensors"]
    with mounted(LEGACY, env=real_env(), timeout=300) as mnt:
        served = load_file(str(mnt / "model.safetensors"))
        # the converter also writes the tied lm_head (the same values as the embeddings); save_pretrained does not
        assert set(expected) - set(served) == {"lm_head.weight"} and set(served) <= set(expected)
        assert expected["lm_head.weight"]["sha256"] == expected["model.embed_tokens.weight"]["sha256"]
        for name, arr in served.items():
            facts = expected[name]
            assert list(arr.shape) == facts["shape"] and str(arr.dtype) == facts["dtype"], name
            assert _sha(arr) == facts["sha256"], name
        model = AutoModelForCausalLM.from_pretrained(mnt)
        state = model.state_dict()
        for name, facts in expected.items():
            assert _sha(state[name].numpy()) == facts["sha256"], name
        readme = (mnt / "README.txt").read_text()
        legacy_bytes = (mnt / "model.safetensors").read_bytes()
    with mounted(LLAMA_MDL, "--views", "hf", env=real_env(), timeout=300) as mnt:
        assert (mnt / "model.safetensors").read_bytes() == legacy_bytes  # as the .mdl of the same state serves it
    assert "torch.save zip (legacy mode)" in readme and "family:         llama" in readme
    assert "params tests/fixtures/legacy_torch/llama/params.yaml" in readme or "params.yaml" in readme


def test_training_state_mounts_with_its_optimizer_state_in_torch_and_tensors():
    expected = torch.load(TRAIN_PT, weights_only=True)
    with mounted(TRAIN_PT, env=real_env(), timeout=300) as mnt:
        whole = torch.load(mnt / "torch" / "ref.pt", weights_only=True)
        assert set(whole) == set(expected)
        for i, st in expected["optimizer"]["state"].items():
            for k, v in st.items():
                assert torch.equal(whole["optimizer"]["state"][i][k], v), (i, k)
                npy = np.load(mnt / "tensors" / "optimizer" / "state" / str(i) / f"{k}.npy")
                assert np.array_equal(npy, v.numpy()), (i, k)
        assert whole["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
        assert whole["lr_scheduler"] == expected["lr_scheduler"] and whole["global_step"] == expected["global_step"]
        for k, v in expected["model"].items():
            assert torch.equal(whole["model"][k], v), k
        assert json.loads((mnt / "config.json").read_text())["model_type"] == "gpt2"


def test_cs_view_serves_the_state_as_an_hdf5_mdl_equal_to_the_original(tmp_path):
    with mounted(LEGACY, "--views", "cs", env=real_env(), timeout=300) as mnt:
        mdl = tmp_path / "checkpoint_0.mdl"
        shutil.copyfile(mnt / "cs" / "checkpoint_0.mdl", mdl)
        assert (mnt / "cs" / "checkpoint_0.yaml").read_text().strip()
    with open_checkpoint(mdl) as a, open_checkpoint(LLAMA_MDL) as b:
        assert a.format_version == 0.5
        result = diff_checkpoints(a, b)
    assert result.keys and all(k.status == EQUAL for k in result.keys), [k for k in result.keys if k.status != EQUAL]


def test_cs_view_upgrades_the_training_state(tmp_path):
    with mounted(TRAIN_PT, "--views", "cs", env=real_env(), timeout=300) as mnt:
        mdl = tmp_path / "ref.mdl"
        shutil.copyfile(mnt / "cs" / "ref.mdl", mdl)
    with open_checkpoint(mdl) as a, open_checkpoint(TRAIN_MDL) as b:
        result = diff_checkpoints(a, b)
        bad = [k for k in result.keys if k.status != EQUAL and not k.key.startswith("__metadata__.1")]
    assert not bad, bad


def test_diff_between_the_legacy_file_and_the_mdl_shows_them_equal():
    r = run_ckptfs("diff", LEGACY, LLAMA_MDL, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "22 keys: 22 equal" in r.stdout
    r = run_ckptfs("diff", TRAIN_PT, TRAIN_MDL, "--json", text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_a_background_mount_given_a_relative_path_serves_it(tmp_path):
    from helpers.fuse import force_unmount

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        r = run_ckptfs("mount", LEGACY.name, mnt, "--views", "hf", cwd=LEGACY.parent, env=real_env(), timeout=300)
        assert r.returncode == 0, r.stderr
        served = load_file(str(mnt / "model.safetensors"))
        assert "model.embed_tokens.weight" in served
        assert run_ckptfs("umount", mnt, env=real_env(), timeout=120).returncode == 0
    finally:
        force_unmount(mnt)


def test_a_run_of_legacy_mode_checkpoints_mounts_each_and_tells_a_partial_one(tmp_path):
    """Legacy mode names its files checkpoint_<step>.mdl too: a run of them mounts like a run of HDF5 ones."""
    run = tmp_path / "model_dir"
    run.mkdir()
    shutil.copyfile(FIXTURES / "legacy_torch" / "llama" / "params.yaml", run / "params.yaml")
    shutil.copyfile(LEGACY, run / "checkpoint_10.mdl")
    raw = LEGACY.read_bytes()
    (run / "checkpoint_20.mdl").write_bytes(raw[: len(raw) // 2])  # a save still being written
    with mounted(run, env=real_env(), timeout=300) as mnt:
        assert os.readlink(mnt / "latest") == "checkpoint_10"
        readme = (mnt / "README.txt").read_text()
        assert "checkpoint_20.mdl: partial torch.save zip" in readme, readme
        served = (mnt / "checkpoint_10" / "model.safetensors").read_bytes()
    with mounted(LEGACY, "--views", "hf", env=real_env(), timeout=300) as mnt:
        assert (mnt / "model.safetensors").read_bytes() == served


def test_a_legacy_mode_checkpoint_in_s3_mounts_as_the_local_file_does(tmp_path):
    from helpers.s3 import BUCKET, LocalS3

    srv = LocalS3(tmp_path / "s3")
    try:
        client = srv.client()
        client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key="legacy/checkpoint_0.pt", Body=LEGACY.read_bytes())
        client.put_object(Bucket=BUCKET, Key="legacy/params.yaml", Body=(LEGACY.parent / "params.yaml").read_bytes())
        env = srv.env(CKPTFS_CACHE_DIR=str(tmp_path / "cache"))
        with mounted(f"s3://{BUCKET}/legacy/checkpoint_0.pt", "--views", "hf,tensors", env=env, timeout=300) as mnt:
            served = (mnt / "model.safetensors").read_bytes()
            readme = (mnt / "README.txt").read_text()
            npy = np.load(mnt / "tensors" / "model" / "embedding_layer" / "word_embeddings" / "weight.npy")
    finally:
        srv.stop()
    assert "torch.save zip (legacy mode)" in readme and f"s3://{BUCKET}/legacy/params.yaml" in readme
    assert np.array_equal(npy, torch.load(LEGACY, weights_only=True)["model"]["embedding_layer.word_embeddings.weight"])
    with mounted(LEGACY, "--views", "hf", env=real_env(), timeout=300) as mnt:
        assert (mnt / "model.safetensors").read_bytes() == served


def test_export_of_a_legacy_file_writes_the_hf_files(tmp_path):
    r = run_ckptfs("export", LEGACY, "config.json", tmp_path / "config.json", text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"


# -- the source layer against torch.load ------------------------------------------------------------------------------


def _torch_cases():
    """Every fixture's ref.pt (torch.save of what cstorch.load gave) whose state holds only what a Cerebras state
    holds (numpy.ref.pt pickles numpy arrays and cerebras objects: refused, below)."""
    return [(mdl, ref) for mdl, ref in _ref_cases() if ref.name != "numpy.ref.pt"]


def _same(ours, ref, where="root"):
    """Exact equality of values, dtypes, shapes, container types and keys (int keys included)."""
    assert type(ours) is type(ref), f"{where}: {type(ours).__name__} != {type(ref).__name__}"
    if isinstance(ref, dict):
        assert list(ours) == list(ref), where
        for k in ref:
            _same(ours[k], ref[k], f"{where}[{k!r}]")
    elif isinstance(ref, (list, tuple)):
        assert len(ours) == len(ref), where
        for i, (a, b) in enumerate(zip(ours, ref)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(ref, torch.Tensor):
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, where
        a, b = ours.contiguous().reshape(-1), ref.contiguous().reshape(-1)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), where  # bit for bit (NaNs, -0.0)
    else:
        assert ours == ref, f"{where}: {ours!r} != {ref!r}"


@pytest.mark.parametrize("mdl,ref", _torch_cases(), ids=lambda p: p.parent.name + "/" + p.name)
def test_every_fixture_ref_pt_opens_equal_to_torch_load(mdl, ref):
    with open_checkpoint(ref) as ours:
        assert ours.format_version is None and ours.format_name
        _same(to_torch(ours), torch.load(ref, weights_only=True))


def test_the_same_tensor_object_twice_is_one_leaf(tmp_path):
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    p = tmp_path / "tied.pt"
    torch.save({"model": {"a": w, "b": w, "t": w.t()}}, p)
    with open_checkpoint(p) as c:
        assert c.leaves["model.b"] is c.leaves["model.a"] and c.links == {"model.b": "model.a"}
        t = c.leaves["model.t"].tensor
        assert np.array_equal(t.read(((0, 3), (0, 2))), w.t().numpy())
        assert np.array_equal(t.read(((1, 3), (1, 2))), w.t().numpy()[1:3, 1:2])


def test_a_file_rewritten_after_opening_fails_its_reads(tmp_path):
    from ckptfs.errors import SourceChangedError

    p = tmp_path / "checkpoint.pt"
    shutil.copyfile(LEGACY, p)
    with open_checkpoint(p) as c:
        t = next(iter(c.tensors().values())).tensor
        t.read_all()
        with open(p, "r+b") as f:
            f.seek(p.stat().st_size - 1)
            f.write(f.read(1) or b"\0")
        os.utime(p, ns=(1, 1))
        with pytest.raises(SourceChangedError):
            t.read_all()


def test_is_legacy_torch_tells_the_formats_apart(tmp_path):
    torch.save({"w": torch.ones(1)}, tmp_path / "new.pt")
    torch.save({"w": torch.ones(1)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert is_legacy_torch((tmp_path / "new.pt").read_bytes()[:HEAD_BYTES])
    assert is_legacy_torch((tmp_path / "old.pt").read_bytes()[:HEAD_BYTES])
    assert not is_legacy_torch(LLAMA_MDL.read_bytes()[:HEAD_BYTES])
    assert not is_legacy_torch(pickle.dumps({"a": 1}))


# -- hostile inputs: one line naming the file, exit 2, nothing mounted -------------------------------------------------


def _members(src: Path) -> list:
    with zipfile.ZipFile(src) as z:
        return [(i.filename, z.read(i.filename)) for i in z.infolist()]


def _write_zip(path: Path, members: list, compressed: set = frozenset()) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members:
            z.writestr(name, data, zipfile.ZIP_DEFLATED if name in compressed else zipfile.ZIP_STORED)
    return path


def _with_pickle(path: Path, pkl: bytes) -> Path:
    members = [(n, pkl if n.endswith("/data.pkl") else d) for n, d in _members(LEGACY)]
    return _write_zip(path, members)


class _System:
    def __reduce__(self):
        return (os.system, ("touch " + str(self.marker),))


def _refused(path: Path, tmp_path: Path, *words) -> str:
    """Mount ``path``: exit 2, one line naming it and holding ``words``, nothing mounted; also from the source."""
    with pytest.raises(CheckpointError) as ei:
        open_checkpoint(path)
    assert "\n" not in str(ei.value)
    mnt = tmp_path / "mnt"
    mnt.mkdir(exist_ok=True)
    r = run_ckptfs("mount", path, mnt, env=real_env(), text=True, timeout=300)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and path.name in lines[0] and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], lines[0]
    assert not os.path.ismount(mnt) and not list(mnt.iterdir())
    return lines[0]


def test_a_pickle_calling_os_system_is_refused(tmp_path):
    marker = tmp_path / "ran"
    _System.marker = marker
    p = _with_pickle(tmp_path / "system.pt", pickle.dumps({"model": _System()}, protocol=2))
    _refused(p, tmp_path, "system is not allowed")
    assert not marker.exists()


def test_a_global_outside_the_allow_list_is_refused_naming_it(tmp_path):
    import collections

    p = _with_pickle(tmp_path / "counter.pt", pickle.dumps({"model": {"w": collections.Counter()}}, protocol=2))
    _refused(p, tmp_path, "global collections.Counter is not allowed")


def test_numpy_and_cerebras_objects_in_a_state_are_refused(tmp_path):
    p = Path(shutil.copyfile(FIXTURES / "cstorch_edge_cases" / "numpy.ref.pt", tmp_path / "numpy.pt"))
    _refused(p, tmp_path, "is not allowed")


def test_a_storage_whose_size_lies_about_its_member_is_refused(tmp_path):
    members = _members(LEGACY)
    name, data = next((n, d) for n, d in members if n.endswith("/data/0"))
    p = _write_zip(tmp_path / "short.pt", [(n, d[: len(d) // 2] if n == name else d) for n, d in members])
    _refused(p, tmp_path, f"member holds {len(data) // 2} bytes, the pickle says {len(data)}")


def test_a_compressed_member_is_refused(tmp_path):
    members = _members(LEGACY)
    name = next(n for n, _ in members if n.endswith("/data/0"))
    p = _write_zip(tmp_path / "deflated.pt", members, compressed={name})
    _refused(p, tmp_path, "is compressed", "uncompressed")


def test_a_pre_1_6_file_says_what_would_work(tmp_path):
    p = tmp_path / "old.pt"
    torch.save(torch.load(LEGACY, weights_only=True), p, _use_new_zipfile_serialization=False)
    _refused(p, tmp_path, "before torch 1.6", "torch>=1.6", "cstorch")


def test_a_truncated_zip_is_refused(tmp_path):
    raw = LEGACY.read_bytes()
    p = tmp_path / "truncated.pt"
    p.write_bytes(raw[: len(raw) * 2 // 3])
    _refused(p, tmp_path, "end-of-central-directory")


def test_a_view_reaching_past_its_storage_is_refused(tmp_path):
    """A tensor whose shape claims more elements than its storage holds (the pickle edited, sizes kept)."""
    state = {"model": {"w": torch.zeros(4)}}
    src = tmp_path / "src.pt"
    torch.save(state, src)
    members = _members(src)
    pkl = next(d for n, d in members if n.endswith("/data.pkl"))
    edited = pkl.replace(b"K\x04\x85", b"K\x40\x85", 1)  # size (4,) -> (64,)
    assert edited != pkl
    p = _write_zip(tmp_path / "past.pt", [(n, edited if n.endswith("/data.pkl") else d) for n, d in members])
    _refused(p, tmp_path, "reaches", "16-byte storage")


def test_a_single_tensor_is_not_a_state(tmp_path):
    p = tmp_path / "tensor.pt"
    torch.save(torch.ones(3), p)
    _refused(p, tmp_path, "single tensor, not a state")
