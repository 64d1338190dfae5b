"""Tensor operations: values equal torch's, and region reads touch only the matching source region."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfs.dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64, INT64, by_name
from ckptfs.errors import MappingError
from ckptfs.tensor import ops
from ckptfs.tensor.floats import bf16_bits_to_f32, cast, f32_to_bf16_bits
from ckptfs.tensor.base import full_box
from helpers.mapping import RecordingTensor


def rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def as_torch(t):
    raw = t.read_all()
    return torch.frombuffer(bytearray(raw.tobytes()), dtype=getattr(torch, t.dtype.name)).reshape(t.shape)


def torch_bits(x: torch.Tensor) -> np.ndarray:
    """Raw storage bits of a torch tensor as numpy (bf16 as uint16)."""
    if x.dtype == torch.bfloat16:
        return x.contiguous().view(torch.int16).numpy().view(np.uint16)
    return x.contiguous().numpy()


def boxes_for(shape):
    dims = [st.tuples(st.integers(0, n), st.integers(0, n)).map(sorted).map(tuple) for n in shape]
    return st.tuples(*dims)


# -- region reads ----------------------------------------------------------------------------------


def test_transpose_row_block_reads_matching_columns_only():
    src = RecordingTensor(rand((6, 10)))
    t = ops.Transpose(src)
    assert src.boxes == []  # building reads nothing
    out = t.read(((3, 5), (0, 6)))
    assert src.boxes == [((0, 6), (3, 5))]
    assert src.bytes_read == 6 * 2 * 4
    np.testing.assert_array_equal(out, src.inner.array.T[3:5])


def test_concat_row_block_reads_only_overlapping_parts():
    q, k, v = (RecordingTensor(rand((4, 3), s)) for s in range(3))
    c = ops.Concat([q, k, v], dim=0)
    out = c.read(((5, 7), (0, 3)))  # rows 1..2 of k
    assert q.boxes == [] and v.boxes == []
    assert k.boxes == [((1, 3), (0, 3))]
    np.testing.assert_array_equal(out, k.inner.array[1:3])


def test_gpt2_c_attn_row_block_reads_one_column_range_of_each_source():
    q, k, v = (RecordingTensor(rand((8, 8), s)) for s in range(3))
    c_attn = ops.Transpose(ops.Concat([q, k, v], dim=0))  # [8, 24]
    out = c_attn.read(((2, 4), (0, 24)))
    for s in (q, k, v):
        assert s.boxes == [((0, 8), (2, 4))]
    np.testing.assert_array_equal(out, np.concatenate([q.inner.array, k.inner.array, v.inner.array]).T[2:4])


def test_permute_rows_block_reads_only_the_needed_source_rows_in_few_runs():
    heads, head_dim, cols = 4, 8, 5
    src = RecordingTensor(rand((heads * head_dim, cols)))
    p = ops.PermuteRows(src, heads=heads, rotary_dim=head_dim)
    out = p.read(((8, 16), (0, cols)))  # all of head 1
    assert src.boxes == [((8, 16), (0, cols))]  # one contiguous run
    src.reset()
    p.read(((8, 12), (1, 3)))  # HF rows j=0..3 of head 1 come from CS rows 0,2,4,6 of head 1
    needed = {8, 10, 12, 14}
    read_rows = {r for (a, b), _ in src.boxes for r in range(a, b)}
    assert needed <= read_rows and len(read_rows) <= 7  # only rows 8..14, nothing outside
    assert all(c == (1, 3) for _, c in src.boxes)
    assert len(src.boxes) == 1  # dense: the covering rows in one request, not one request per row
    np.testing.assert_array_equal(out, p.read_all()[8:16])
    src.reset()
    two = p.read(((11, 13), (0, cols)))  # HF rows 3, 4 of head 1 come from CS rows 6 and 1: sparse, two requests
    assert sorted(src.boxes) == [((9, 10), (0, cols)), ((14, 15), (0, cols))]
    np.testing.assert_array_equal(two, p.read_all()[11:13])


def test_slice_and_select_read_only_their_region():
    src = RecordingTensor(rand((6, 4, 5)))
    sel = ops.Select(src, 1, 2)
    out = sel.read(((1, 3), (0, 5)))
    assert src.boxes == [((1, 3), (2, 3), (0, 5))]
    np.testing.assert_array_equal(out, src.inner.array[1:3, 2, :])
    src.reset()
    sl = ops.Slice(src, 0, 2, 5)
    sl.read(((1, 2), (0, 4), (0, 5)))
    assert src.boxes == [((3, 4), (0, 4), (0, 5))]


def test_cached_byte_reads_touch_only_the_requested_rows():
    from ckptfs.tensor.cache import BlockCache

    src = RecordingTensor(rand((64, 16)))
    t = ops.Transpose(src)  # [16, 64]; one row is 256 bytes
    data = t.read_bytes(0, 256, cache=BlockCache(1 << 20))
    assert len(data) == 256
    assert src.bytes_read <= t.nbytes  # a block, never more than the tensor
    np.testing.assert_array_equal(np.frombuffer(data, np.float32), src.inner.array.T[0])


# -- values ----------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(boxes_for((5, 7)))
def test_transpose_any_box(box):
    a = rand((7, 5))
    t = ops.Transpose(RecordingTensor(a))
    np.testing.assert_array_equal(t.read(box), a.T[tuple(slice(*b) for b in box)])


@settings(max_examples=40, deadline=None)
@given(boxes_for((9, 4)))
def test_concat_any_box(box):
    parts = [rand((n, 4), n) for n in (2, 0, 3, 4)]
    c = ops.Concat([RecordingTensor(p) for p in parts], dim=0)
    np.testing.assert_array_equal(c.read(box), np.concatenate(parts)[tuple(slice(*b) for b in box)])


@settings(max_examples=30, deadline=None)
@given(boxes_for((3, 4, 5)))
def test_stack_any_box(box):
    parts = [rand((3, 5), n) for n in range(4)]
    s = ops.Stack([RecordingTensor(p) for p in parts], dim=1)
    np.testing.assert_array_equal(s.read(box), np.stack(parts, axis=1)[tuple(slice(*b) for b in box)])


def converter_reverse_interleave(t: torch.Tensor, heads: int, rotary_dim: int) -> torch.Tensor:
    """CS -> HF row order as the Model Zoo converter writes it (reshape / permute formulation)."""
    if t.dim() == 2:
        t = t.reshape(heads, -1, t.shape[-1])
        rot, rest = t[:, :rotary_dim], t[:, rotary_dim:]
        rot = rot.reshape(heads, -1, 2, t.shape[-1]).permute(0, 2, 1, 3).reshape(heads, rotary_dim, t.shape[-1])
        return torch.cat((rot, rest), dim=1).reshape(-1, t.shape[-1])
    t = t.reshape(heads, -1)
    rot, rest = t[:, :rotary_dim], t[:, rotary_dim:]
    rot = rot.reshape(heads, -1, 2).permute(0, 2, 1).reshape(heads, -1)
    return torch.cat((rot, rest), dim=1).reshape(-1)


@pytest.mark.parametrize("heads,head_dim,rotary_dim,cols", [(4, 8, 8, 6), (2, 8, 4, 3), (3, 6, 2, 1), (1, 4, 4, None), (2, 6, 4, None)])
def test_permute_rows_matches_converter_and_inverts(heads, head_dim, rotary_dim, cols):
    shape = (heads * head_dim,) if cols is None else (heads * head_dim, cols)
    a = rand(shape, 3)
    p = ops.PermuteRows(RecordingTensor(a), heads, rotary_dim)
    ref = converter_reverse_interleave(torch.from_numpy(a), heads, rotary_dim).numpy()
    np.testing.assert_array_equal(p.read_all(), ref)
    back = ops.PermuteRows(p, heads, rotary_dim, direction="hf_to_cs")
    np.testing.assert_array_equal(back.read_all(), a)
    if cols:  # every row block equals the same rows of the full result
        for r0 in range(0, shape[0], 3):
            box = ((r0, min(r0 + 3, shape[0])), (0, cols))
            np.testing.assert_array_equal(p.read(box), ref[r0:r0 + 3])


def test_permute_rows_rejects_bad_geometry():
    with pytest.raises(MappingError, match="rotary_dim"):
        ops.PermuteRows(RecordingTensor(rand((8, 2))), heads=2, rotary_dim=3)
    with pytest.raises(MappingError, match="heads"):
        ops.PermuteRows(RecordingTensor(rand((9, 2))), heads=2, rotary_dim=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_affine_steps_equal_torch(dtype):
    x = torch.from_numpy(rand((16, 9), 5) * 3).to(getattr(torch, dtype))
    src = RecordingTensor(torch_bits(x), by_name(dtype))
    # gemma2 norm: w - 1; muP k: alpha * w / sqrt(d); lm_head: w * (alpha / width)
    cases = [
        (ops.Affine(src, [("sub", 1.0)]), x - torch.ones_like(x)),
        (ops.Affine(ops.Affine(src, [("mul", 0.7)]), [("div", math.sqrt(8))]), 0.7 * x / math.sqrt(8)),
        (ops.Affine(src, [("mul", 4.0 / (32 / 16))]), x * (4.0 / (32 / 16))),
        (ops.Affine(src, [("add", 1e-3)]), x + 1e-3),
    ]
    for op, ref in cases:
        assert op.dtype.name == dtype
        np.testing.assert_array_equal(op.read_all(), torch_bits(ref))
        np.testing.assert_array_equal(op.read(((3, 7), (2, 5))), torch_bits(ref)[3:7, 2:5])


@pytest.mark.parametrize("src_dtype,dst_dtype", [
    ("float32", "bfloat16"), ("bfloat16", "float32"), ("float64", "bfloat16"), ("float32", "float16"),
    ("bfloat16", "float16"), ("float16", "bfloat16"), ("float32", "int64"), ("int64", "float32"),
    ("bfloat16", "int32"), ("int32", "bfloat16")])
def test_cast_equals_torch(src_dtype, dst_dtype):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(64, 33, generator=g, dtype=torch.float64) * 300
    base[0, :6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0 + 2 ** -8])
    if "int" in src_dtype or "int" in dst_dtype:
        base = torch.nan_to_num(base, nan=0.0, posinf=1e4, neginf=-1e4)
    x = base.to(getattr(torch, src_dtype))
    src = RecordingTensor(torch_bits(x), by_name(src_dtype))
    c = ops.Cast(src, dst_dtype)
    ref = torch_bits(x.to(getattr(torch, dst_dtype)))
    got = c.read_all()
    if (src_dtype, dst_dtype) == ("float64", "bfloat16"):
        # torch's NaN bits here depend on the element's position (vector body vs scalar tail)
        nan = np.isnan(base.numpy())
        assert np.isnan(bf16_bits_to_f32(got)[nan]).all()
        got, ref = got[~nan], ref[~nan]
    if ref.dtype.kind == "f":
        np.testing.assert_array_equal(got.view(f"u{ref.itemsize}"), ref.view(f"u{ref.itemsize}"))
    else:
        np.testing.assert_array_equal(got, ref)


def test_bf16_rounding_helpers_round_to_nearest_even():
    vals = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, np.nan, np.inf, 3.0e38, -np.nan, 2.0 ** -140],
                    np.float32)
    bits = f32_to_bf16_bits(vals)
    ref = torch_bits(torch.from_numpy(vals).to(torch.bfloat16))
    np.testing.assert_array_equal(bits, ref)
    np.testing.assert_array_equal(bf16_bits_to_f32(bits)[:4], torch.from_numpy(vals).to(torch.bfloat16)
                                  .to(torch.float32).numpy()[:4])
    assert cast(np.array([1, 2], np.int64), INT64, FLOAT32).dtype == np.float32


def test_generated_tensors():
    m = ops.CausalMask(6)
    ref = torch.tril(torch.ones((6, 6), dtype=torch.uint8)).view(1, 1, 6, 6).numpy()
    np.testing.assert_array_equal(m.read_all(), ref)
    np.testing.assert_array_equal(m.read(((0, 1), (0, 1), (2, 5), (1, 4))), ref[:, :, 2:5, 1:4])
    c = ops.Constant(-1e4, "float32")
    assert c.shape == () and c.read(()).tobytes() == torch.tensor(-1e4).numpy().tobytes()
    p = ops.PositionIds(7)
    np.testing.assert_array_equal(p.read_all(), torch.arange(7).view(1, 7).numpy())
    assert p.dtype == INT64
    s = ops.AlibiSlopes(6)
    assert s.shape == (6, 1) and s.dtype == FLOAT32
    # Press et al.: 8 heads -> 2^-1 ... 2^-8
    np.testing.assert_array_equal(ops.AlibiSlopes(8).read_all()[:, 0], np.array([2.0 ** -i for i in range(1, 9)], np.float32))
    for g in (m, c, p, s):
        assert g.sources() == [] and g.describe()


def test_every_op_describes_and_lists_sources():
    a, b = RecordingTensor(rand((4, 6))), RecordingTensor(rand((4, 6), 1))
    built = [ops.Transpose(a), ops.Slice(a, 1, 1, 3), ops.Select(a, 0, 2), ops.Concat([a, b]), ops.Stack([a, b]),
             ops.PermuteRows(a, 2, 2), ops.Affine(a, [("mul", 2.0)]), ops.Cast(a, BFLOAT16)]
    for op in built:
        assert op.describe() and a in op.sources()
    assert a.boxes == [] and b.boxes == []  # nothing read while building


def test_shape_and_dtype_errors_are_mapping_errors():
    a = RecordingTensor(rand((4, 6)))
    with pytest.raises(MappingError):
        ops.Concat([a, RecordingTensor(rand((4, 5)))], dim=0)
    with pytest.raises(MappingError):
        ops.Select(a, 1, 6)
    with pytest.raises(MappingError):
        ops.Affine(RecordingTensor(np.arange(4)), [("mul", 2)])
    with pytest.raises(MappingError):
        ops.Transpose(a, (0, 0))


def test_block_cache_bytes_equal_full_read_for_every_op():
    a = RecordingTensor(rand((10, 12)))
    for op in [ops.Transpose(a), ops.PermuteRows(a, 2, 4), ops.Cast(a, FLOAT64), ops.Cast(a, FLOAT16)]:
        full = op.read_all().tobytes()
        assert op.read_bytes(0, op.nbytes) == full
        assert op.read_bytes(17, 93) == full[17:93]
    assert full_box((2, 3)) == ((0, 2), (0, 3))
