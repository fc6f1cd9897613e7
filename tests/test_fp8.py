"""FP8 latent-cache formats (mla_decode.fp8), on the CPU: the per-tensor and
the tiled (656-byte) rows quantize within the formats' stated error bound,
saturate instead of overflowing, keep NaN, and the paged append writes
exactly the rows it is given and nothing else."""

import pytest
import torch

from mla_decode.fp8 import (FP8_DTYPES, TILED_ROW_BYTES, dequantize_per_tensor, dequantize_tiled, fp8_append_paged,
                            fp8_max, quantize_per_tensor, quantize_tiled)


def within_bound(deq, x, scale):
    """|deq - x| <= max(2^-4 |x|, 2^-10 scale) element-wise (scale broadcast)."""
    err = (deq.double() - x.double()).abs()
    lim = torch.maximum(x.double().abs() * 2.0 ** -4, torch.as_tensor(scale, dtype=torch.float64) * 2.0 ** -10)
    return bool((err <= lim * (1 + 1e-6)).all()), (err - lim).max().item()


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_per_tensor_round_trip_and_saturation(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 576, generator=g) * 3
    x[0, :8] = torch.tensor([0.0, -0.0, 1e-9, -1e-9, 5e-4, -5e-4, 2.0, -2.0])
    s = 0.05
    q = quantize_per_tensor(x, s, dtype)
    assert q.dtype == dtype and q.shape == x.shape
    m = fp8_max(dtype)
    inside = x.abs() <= m * s
    ok, excess = within_bound(dequantize_per_tensor(q, s)[inside], x[inside], s)
    assert ok, f"excess {excess}"
    big = torch.tensor([1e6, -1e6, m * s * 1.5])
    assert torch.equal(dequantize_per_tensor(quantize_per_tensor(big, s, dtype), s),
                       torch.tensor([m * s, -m * s, m * s]))
    assert torch.isnan(dequantize_per_tensor(quantize_per_tensor(torch.tensor([float("nan")]), s, dtype), s)).all()
    with pytest.raises(ValueError, match="k_scale must be a positive finite number"):
        quantize_per_tensor(x, 0.0, dtype)
    with pytest.raises(TypeError, match="dtype must be one of"):
        quantize_per_tensor(x, s, torch.bfloat16)


def test_tiled_rows():
    g = torch.Generator().manual_seed(2)
    rows = (torch.randn(5, 576, generator=g) * torch.logspace(-3, 2, 5).unsqueeze(1)).to(torch.bfloat16)
    rows[1, 128:256] = 0  # an all-zero tile
    rows[2, 300] = 1000.0  # one large value: its tile's scale follows it
    packed = quantize_tiled(rows)
    assert packed.dtype == torch.uint8 and packed.shape == (5, TILED_ROW_BYTES) == (5, 656)
    deq = dequantize_tiled(packed)
    lat = rows[:, :512].float().reshape(5, 4, 128)
    scale = lat.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 448
    ok, excess = within_bound(deq[:, :512].reshape(5, 4, 128), lat, scale)
    assert ok, f"excess {excess}"
    assert torch.equal(deq[:, 512:], rows[:, 512:].float())  # rope as stored (bf16)
    assert torch.equal(deq[1, 128:256], torch.zeros(128))
    assert torch.equal(packed[:, 512:528].contiguous().view(torch.float32), scale.reshape(5, 4))
    assert deq[2, 300] == 1000.0  # a tile's amax is exact (it maps to 448)
    with pytest.raises(ValueError, match=r"rows must be float \[\.\.\., 576\]"):
        quantize_tiled(rows[:, :575])


def test_tiled_rows_saturate_infinities_and_keep_nan_to_its_element():
    """As the per-tensor format: an infinity saturates at the tile's largest
    value (the scale comes from the finite values) and a NaN spoils only its
    own element, not its tile."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(2, 576, generator=g)
    rows[0, 5], rows[0, 6], rows[1, 200] = float("inf"), float("-inf"), float("nan")
    deq = dequantize_tiled(quantize_tiled(rows))
    s0 = rows[0, :128].nan_to_num(posinf=0, neginf=0).abs().amax() / 448
    assert deq[0, 5] == 448 * s0 and deq[0, 6] == -448 * s0
    assert torch.isnan(deq[1, 200]) and torch.isnan(deq).sum() == 1
    finite = torch.isfinite(rows)
    scale = rows.nan_to_num(nan=0, posinf=0, neginf=0)[:, :512].reshape(2, 4, 128).abs().amax(-1, keepdim=True) / 448
    ok, excess = within_bound(deq[:, :512].reshape(2, 4, 128)[finite[:, :512].reshape(2, 4, 128)],
                              rows[:, :512].reshape(2, 4, 128)[finite[:, :512].reshape(2, 4, 128)],
                              scale.expand(2, 4, 128)[finite[:, :512].reshape(2, 4, 128)])
    assert ok, f"excess {excess}"


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz", "tiled"])
def test_append_writes_exactly_the_given_rows(page, fmt):
    b, blocks = 3, 20
    width = TILED_ROW_BYTES if fmt == "tiled" else 576
    dtype = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz, "tiled": torch.uint8}[fmt]
    g = torch.Generator().manual_seed(page)
    poison = torch.randint(0, 256, (blocks, page, 1, width), generator=g, dtype=torch.uint8)
    k_cache = poison.clone().view(dtype)
    max_blocks = (130 + page - 1) // page
    table = torch.full((b, max_blocks), -7, dtype=torch.int32)  # invalid ids in every unused slot
    pos = torch.tensor([0, page + 3 if page > 1 else 5, 129])
    perm = torch.randperm(blocks, generator=g)
    for i in range(b):
        table[i, int(pos[i]) // page] = int(perm[i])
    rows = torch.randn(b, 576, generator=g).to(torch.bfloat16)
    scale = 0.02 if fmt != "tiled" else None
    fp8_append_paged(k_cache, table, pos, rows, k_scale=scale)
    after = k_cache.view(torch.uint8)
    written = torch.zeros(blocks, page, dtype=torch.bool)
    for i in range(b):
        blk, r = int(table[i, int(pos[i]) // page]), int(pos[i]) % page
        written[blk, r] = True
        got = after[blk, r, 0]
        want = (quantize_tiled(rows[i:i + 1])[0] if fmt == "tiled"
                else quantize_per_tensor(rows[i], scale, dtype).view(torch.uint8))
        assert torch.equal(got, want), f"sequence {i}"
    assert torch.equal(after[~written], poison[~written]), "a row that was not given changed"


def test_append_errors_write_nothing():
    k_cache = torch.zeros(4, 16, 576).to(torch.float8_e4m3fn)
    before = k_cache.view(torch.uint8).clone()
    rows = torch.randn(2, 576).to(torch.bfloat16)
    table = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"sequence 1: block id 9 at slot 1 is outside \[0, 4\)"):
        fp8_append_paged(k_cache, table, [3, 20], rows, k_scale=0.1)
    with pytest.raises(ValueError, match="k_scale is required"):
        fp8_append_paged(k_cache, table, [3, 4], rows)
    with pytest.raises(ValueError, match="needs block-table slot 2"):
        fp8_append_paged(k_cache, table, [3, 40], rows, k_scale=0.1)
    with pytest.raises(ValueError, match="positions must be non-negative"):
        fp8_append_paged(k_cache, table, [-1, 4], rows, k_scale=0.1)
    with pytest.raises(TypeError, match="k_cache must be fp8"):
        fp8_append_paged(torch.zeros(4, 16, 576), table, [3, 4], rows, k_scale=0.1)
    with pytest.raises(ValueError, match="a tiled row carries its own scales"):
        fp8_append_paged(torch.zeros(4, 16, 656, dtype=torch.uint8), table, [3, 4], rows, k_scale=0.1)
    with pytest.raises(TypeError, match="positions must be integers, got torch.float32"):
        fp8_append_paged(k_cache, table, torch.tensor([3.0, 4.7]), rows, k_scale=0.1)
    with pytest.raises(TypeError, match="positions must be integers, got torch.bool"):
        fp8_append_paged(k_cache, table, [True, False], rows, k_scale=0.1)
    same = torch.tensor([[1, 0], [1, 3]], dtype=torch.int32)  # both sequences' slot 0 is block 1
    with pytest.raises(ValueError, match="name the same cache row"):
        fp8_append_paged(k_cache, same, [5, 5], rows, k_scale=0.1)
    fp8_append_paged(k_cache.clone(), same, [5, 6], rows, k_scale=0.1)  # same block, other rows: fine
    assert torch.equal(k_cache.view(torch.uint8), before)


def test_kv_scale_argument():
    """The attention's kv_scale (mla_attention / flash_mla_with_kvcache): a
    float or a one-element tensor with an fp8 cache, required there, refused
    with a bf16 cache, positive and finite."""
    from mla_decode.attention import _kv_scale

    kv8 = torch.zeros(1, 4, 576).to(FP8_DTYPES[0])
    kv = torch.zeros(1, 4, 576, dtype=torch.bfloat16)
    assert _kv_scale(kv8, 0.25) == 0.25
    assert _kv_scale(kv8, torch.tensor(0.5)) == 0.5
    assert _kv_scale(kv8, torch.tensor([2.0])) == 2.0
    assert _kv_scale(kv, None) == 1.0
    with pytest.raises(ValueError, match="pass kv_scale"):
        _kv_scale(kv8, None)
    with pytest.raises(ValueError, match="one number"):
        _kv_scale(kv8, torch.tensor([1.0, 2.0]))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="positive finite"):
            _kv_scale(kv8, bad)
    with pytest.raises(ValueError, match="applies to an fp8"):
        _kv_scale(kv, 0.5)
