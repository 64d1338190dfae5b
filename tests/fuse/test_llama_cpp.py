"""llama.cpp's converter on real mounts (issue 34): ``convert_hf_to_gguf.py --outtype f16`` (from the
llama-cpp-python source package, fetched by scripts/setup.sh; CPU only, offline) on mounts of the llama, mixtral and
gpt2 fixtures with a tokenizer overlay gives GGUF files byte-identical to converting the original HF folders with the
same tokenizer.

GPT-2 needs two words: the original folder does not convert (its config.json has no ``n_ctx``, which the converter
requires: KeyError), so the mount is compared with the original plus ``n_ctx`` — the key ckptfs adds for it. And the
converter's GPT-2 vocabulary step recognises a BPE tokenizer only by the ids it gives for a fixed text
(``get_vocab_base_pre``); every tokenizer it knows has ids beyond the fixtures' 128-token vocabulary (which the
converter asserts), so for gpt2 that one recognition step answers "gpt-2" on both sides (``ggufhelp.py``).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest

from helpers import FIXTURES, TESTS, needs_fuse, real_env
from helpers.fuse import mounted
from helpers.gguf import CONVERTER
from helpers.tokens import make_llama_bpe_tokenizer

pytestmark = [needs_fuse, pytest.mark.timeout(900)]

CASES = ("llama", "mixtral", "gpt2")
#: the converter's BPE pre-tokenizer recognition, answered for the cases whose vocabulary step needs it (see above)
PRE_TOKENIZER = {"gpt2": "gpt-2"}


def convert(jobs: list) -> list:
    """Run the converter on [(folder, outfile, pre-tokenizer or None)] in one process, offline: None per folder
    converted, else the error it raised."""
    env = real_env(HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(TESTS / "helpers" / "gguf.py"), str(CONVERTER),
                        json.dumps([[str(f), str(o), p] for f, o, p in jobs])],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def original_folder(case: str, dest: Path, tok: Path, **config_changes) -> Path:
    """The case's original HF folder (config.json, model.safetensors) with the tokenizer's files, at ``dest``."""
    dest.mkdir(parents=True)
    for f in (FIXTURES / case / "hf").iterdir():
        shutil.copy(f, dest / f.name)
    for f in tok.iterdir():
        shutil.copy(f, dest / f.name)
    if config_changes:
        config = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**config, **config_changes}, indent=2))
    return dest


def test_gguf_of_the_mounts_equals_the_originals(tmp_path):
    assert CONVERTER.is_file(), f"llama.cpp's converter is missing ({CONVERTER}): run scripts/setup.sh"
    tok = make_llama_bpe_tokenizer(tmp_path / "tok")
    with ExitStack() as stack:
        mounts = {c: stack.enter_context(mounted(FIXTURES / c / "cs" / "checkpoint.mdl", "--views", "hf",
                                                 "--overlay", tok, env=real_env())) for c in CASES}
        jobs, checks = [], []
        for case, mnt in mounts.items():
            # general.name comes from the folder's name: the original gets the mount point's
            n_ctx = {"n_ctx": json.loads((FIXTURES / case / "hf" / "config.json").read_text())["n_positions"]} \
                if case == "gpt2" else {}
            orig = original_folder(case, tmp_path / "orig" / case / mnt.name, tok, **n_ctx)
            pre = PRE_TOKENIZER.get(case)
            jobs += [(mnt, tmp_path / f"{case}-mount.gguf", pre), (orig, tmp_path / f"{case}-orig.gguf", pre)]
            checks.append(case)
            if case == "gpt2":  # the original as it is: the converter needs n_ctx
                jobs.append((original_folder(case, tmp_path / "bare" / mnt.name, tok), tmp_path / "bare.gguf", pre))
        results = convert(jobs)
    assert results[:2 * len(CASES)] == [None] * (2 * len(CASES)), list(zip([str(j[0]) for j in jobs], results))
    assert results[-1] == "KeyError: 'n_ctx'"
    for case in checks:
        mine, theirs = (tmp_path / f"{case}-mount.gguf").read_bytes(), (tmp_path / f"{case}-orig.gguf").read_bytes()
        assert len(mine) > 10_000 and mine == theirs, f"{case}: the mount's GGUF differs from the original's"
