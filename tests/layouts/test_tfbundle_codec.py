"""The tensor-bundle codec (ckptfs/tfbundle) against TensorFlow's own files: the genuine saver checkpoints of
tests/fixtures/tf/ (parsed and re-encoded byte for byte, every data CRC checked), indexes of several table blocks
written by real TensorFlow here, slice keys, and corrupt indexes refused with one line."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from helpers import FIXTURES, real_env
from ckptfs.tfbundle import (BundleEntry, BundleFormatError, BundleHeader, crc32c, data_file_name,
                             decode_slice_key, decode_string_tensor, encode_index,
                             encode_string_tensor, encode_slice_key, mask, parse_index, read_table,
                             unmask)
from ckptfs.tfbundle.crc32c import _bytewise, _lanes, combine
from ckptfs.tfbundle.table import TABLE_MAGIC

TF_CASES = sorted(p.name for p in (FIXTURES / "tf").iterdir() if p.is_dir())


def _case(name):
    root = FIXTURES / "tf" / name
    manifest = json.loads((root / "MANIFEST.json").read_text())
    prefix = root / manifest["checkpoint_prefix"]
    return root, manifest, prefix


def test_crc32c_known_values_and_mask():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert mask(0) == 0xA282EAD8  # what TF stores for an empty tensor (see tf1_dtypes' "dtypes/empty")
    data = os.urandom(3 * (1 << 14) * 256 + 1234)
    assert crc32c(data) == _bytewise(data, 0)
    assert _lanes(memoryview(data)[:(1 << 14) * 256], 7) == _bytewise(data[:(1 << 14) * 256], 7)
    assert crc32c(data[100:], crc32c(data[:100])) == crc32c(data)
    assert combine(crc32c(data[:10]), crc32c(data[10:]), len(data) - 10) == crc32c(data)
    for v in (0, 1, 0xFFFFFFFF, 0x12345678):
        assert unmask(mask(v)) == v


@pytest.mark.parametrize("case", TF_CASES)
def test_fixture_index_reencodes_byte_identical(case):
    root, manifest, prefix = _case(case)
    data = Path(str(prefix) + ".index").read_bytes()
    index = parse_index(data, "x.index")
    assert encode_index(index.header, index.entries) == data
    ref = json.loads((root / "ref.json").read_text())
    assert set(index.tensors()) == set(ref)
    for name, e in index.tensors().items():
        if not e.slices:
            assert list(e.dims) == ref[name]["shape"], name


@pytest.mark.parametrize("case", TF_CASES)
def test_fixture_data_crcs_are_masked_crc32c_of_the_bytes(case):
    root, manifest, prefix = _case(case)
    index = parse_index(Path(str(prefix) + ".index").read_bytes())
    n = index.header.num_shards
    shards = [Path(str(prefix) + data_file_name("", i, n)[0:]).read_bytes() for i in range(n)]
    checked = 0
    for key, e in index.entries:
        if e.slices:  # a sliced tensor's own entry: its bytes are under its slices' keys
            assert e.size == 0 and e.crc32c == 0
            continue
        blob = shards[e.shard_id][e.offset:e.offset + e.size]
        assert len(blob) == e.size
        if e.dtype_name == "string":  # lengths, their checksum, the bytes: the CRC is not the bytes' plain CRC
            values = decode_string_tensor(blob, math.prod(e.dims))
            assert encode_string_tensor(values) == (blob, e.crc32c), key
        else:
            assert e.crc32c == mask(crc32c(blob)), key
        checked += 1
    assert checked >= manifest["variables"]


@pytest.mark.parametrize("case", [c for c in TF_CASES if c.startswith("tf1")])
def test_tf1_saver_data_is_sorted_by_name_end_to_end(case):
    """A TF1 Saver adds tensors sorted by name: each tensor starts where the previous one ended, no padding."""
    root, manifest, prefix = _case(case)
    index = parse_index(Path(str(prefix) + ".index").read_bytes())
    pos = 0
    for _, e in index.entries:
        assert e.offset == pos
        pos += e.size
    assert Path(str(prefix) + ".data-00000-of-00001").stat().st_size == pos


def test_sliced_fixture_keys_decode():
    root, manifest, prefix = _case("tf2_bert_sharded")
    index = parse_index(Path(str(prefix) + ".index").read_bytes())
    whole = index.tensors()
    slice_keys = [k for k, _ in index.entries if k[:1] == b"\0"]
    assert slice_keys
    for key in slice_keys:
        name, extents = decode_slice_key(key)
        assert extents in whole[name].slices
        assert encode_slice_key(name, extents) == key


@pytest.mark.parametrize("value", [0, 1, 63, 64, -1, -64, -65, 8191, 8192, 1 << 40, -(1 << 40), (1 << 63) - 1,
                                   -(1 << 63)])
def test_slice_key_numbers_round_trip(value):
    key = encode_slice_key("a\0b\xff", [(value, 5), (0, None)])
    assert decode_slice_key(key) == ("a\0b\xff", ((value, 5), (0, None)))


_TF_SAVE = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    prefix, count = sys.argv[1], int(sys.argv[2])
    names = [f"layer_{i:05d}/a_rather_long_variable_name_to_fill_index_blocks/kernel" for i in range(count)]
    names += ["\\xff\\xfe/odd", "zz/\\u00e9t\\u00e9"]
    tensors = [tf.constant(np.arange(i % 7 + 1, dtype=np.float32) * i) for i in range(len(names))]
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors)
""")


@pytest.fixture(scope="module")
def tf_many(tmp_path_factory):
    """An index of several 256 KiB table blocks, written by real TensorFlow (SaveV2, as a Saver runs it)."""
    d = tmp_path_factory.mktemp("tfmany")
    prefix = d / "many"
    subprocess.run([sys.executable, "-c", _TF_SAVE, str(prefix), "9000"], check=True, env=real_env(),
                   capture_output=True, timeout=300)
    return prefix


@pytest.mark.slow  # runs TensorFlow in a process
def test_multi_block_index_from_real_tensorflow(tf_many):
    data = Path(str(tf_many) + ".index").read_bytes()
    assert len(data) > 2 * (256 << 10)
    index = parse_index(data)
    assert len(index.entries) == 9002
    assert encode_index(index.header, index.entries) == data
    blob = Path(str(tf_many) + ".data-00000-of-00001").read_bytes()
    for _, e in index.entries[::97]:
        assert e.crc32c == mask(crc32c(blob[e.offset:e.offset + e.size]))


def _fixture_index() -> bytes:
    _, _, prefix = _case("tf1_dtypes")
    return Path(str(prefix) + ".index").read_bytes()


def _one_line_error(data: bytes) -> str:
    with pytest.raises(BundleFormatError) as err:
        parse_index(data, "bad/model.ckpt.index")
    text = str(err.value)
    assert "\n" not in text and text.startswith("bad/model.ckpt.index: ")
    return text


def test_corrupt_indexes_refused_with_one_line():
    good = _fixture_index()
    assert "shorter than a table footer" in _one_line_error(good[:40])
    assert "magic" in _one_line_error(good[:-1] + b"\0")
    flipped = bytearray(good)
    flipped[30] ^= 0x40
    assert "checksum" in _one_line_error(bytes(flipped))
    assert "past" in _one_line_error(good[200:])  # handles point outside a file cut at the front
    huge = bytearray(good)
    huge[-48:-8] = b"\xff" * 11 + bytes(29)  # a varint longer than 10 bytes in the footer
    assert "longer than 10 bytes" in _one_line_error(bytes(huge))


def _rebuild(entries, header=BundleHeader()):
    return encode_index(header, entries)


def test_semantic_checks_refused_with_one_line():
    e = BundleEntry(dtype=1, dims=(2, 3), offset=0, size=24)
    assert parse_index(_rebuild([("w", e)])).tensors()["w"] == e
    assert "should hold 24 bytes" in _one_line_error(_rebuild([("w", BundleEntry(1, (2, 3), size=25))]))
    assert "shard 3 of 1" in _one_line_error(_rebuild([("w", BundleEntry(1, (2, 3), shard_id=3, size=24))]))
    assert "announces 0 data shards" in _one_line_error(_rebuild([], BundleHeader(num_shards=0)))
    assert "byte order" in _one_line_error(_rebuild([], BundleHeader(endianness=1)))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_random_corruption_parses_or_raises_one_line(data):
    good = _fixture_index()
    buf = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(buf)))
    candidate = bytes(buf[:cut]) if data.draw(st.booleans()) else bytes(buf)
    try:
        parse_index(candidate, "f.index")
    except BundleFormatError as err:
        assert "\n" not in str(err)


def test_read_table_rejects_a_block_claiming_more_restarts_than_fit():
    from ckptfs.tfbundle.table import _trailer
    from ckptfs.tfbundle.wire import put_fixed32, put_fixed64, put_varint
    raw = put_fixed32(0) + put_fixed32(1000)
    body = raw + _trailer(raw)
    handle = put_varint(0) + put_varint(len(raw))
    footer = handle + handle
    table = body + footer + bytes(40 - len(footer)) + put_fixed64(TABLE_MAGIC)
    with pytest.raises(BundleFormatError, match="restart points"):
        read_table(table)
