"""An FP8 latent cache with one scale per tensor (vLLM's layout; e4m3fn on
NVIDIA, e4m3fnuz on AMD) in the attention and the serving API: out and lse
against the float64 (or float32) reference on the dequantized cache, NaN in
every row past a length and in unused pages, invalid ids in unused
block-table slots, variable lengths, s_q 1-4 causal, h_q 16-128, pages of
1-128 rows, under CUDA graphs with lengths and block tables changed in place,
rows appended by fp8_append_paged, every finite code decoded exactly, q
beyond fp16's range, and which kernel reads which cache. Bound: the bf16
path's (check): the kernels multiply the e4m3 values themselves (exact in
bf16 and fp16) and apply the scale in fp32; the Hopper kernel's fp8
instances multiply in fp16, q scaled by a power of two into fp16's range."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

from mla_decode import kernel_choice
from mla_decode import attention_reference, flash_mla_with_kvcache, get_mla_metadata, mla_attention, rope_table
from mla_decode.fp8 import FP8_KV_DTYPE, dequantize_per_tensor, fp8_append_paged, quantize_per_tensor

from conftest import needs_gpu
from test_gpu_attention import check, make_case, make_paged, poisoned_out
from test_gpu_serving import varlen

pytestmark = [needs_gpu, pytest.mark.gpu]

KV_SCALE = 0.0125  # randn values up to ~4.5 -> up to ~360 of e4m3's 448 (240 for fnuz: saturates a few)


def quant(x):
    return quantize_per_tensor(x, KV_SCALE, FP8_KV_DTYPE)


def deq(x8):
    return dequantize_per_tensor(x8, KV_SCALE, torch.float32)


@pytest.mark.parametrize("h_q,s_q", [(128, 1), (64, 2), (16, 1), (32, 4), (24, 3)])
def test_fp8_dense_variable_lengths(h_q, s_q):
    lens = [1, 700, 4097, 63, 0, 2049]
    q, kv, seqlens = make_case(lens, h_q=h_q, s_q=s_q, seed=h_q + s_q)  # NaN past every length
    kv8 = quant(kv)
    causal = s_q > 1
    ro, rl = attention_reference(q, deq(kv8), seqlens, 0.08, causal=causal)
    for split in (True, False):
        out, lse = poisoned_out(q)
        mla_attention(q, kv8, seqlens, 0.08, causal=causal, out=out, lse=lse, split=split, kv_scale=KV_SCALE)
        check(out, lse, ro, rl, f"fp8 h_q {h_q} s_q {s_q} split {split}")


def test_fp8_long_context_split_and_merged():
    lens = [32769, 1, 8193]
    q, kv, seqlens = make_case(lens, h_q=128, seed=9)
    kv8 = quant(kv)
    ro, rl = attention_reference(q, deq(kv8), seqlens, 0.06)
    out, lse = mla_attention(q, kv8, seqlens, 0.06, kv_scale=KV_SCALE)
    check(out, lse, ro, rl, "fp8 long contexts")


@pytest.mark.parametrize("block_size,h_q,s_q", [(64, 128, 1), (16, 64, 2), (1, 128, 1), (32, 16, 4)])
def test_fp8_serving_paged(block_size, h_q, s_q):
    lens = varlen(12, 2048, s_q, seed=block_size + h_q)
    q, pages, table, seqlens = make_paged(lens, block_size, h_q=h_q, s_q=s_q, seed=block_size * 3 + s_q)
    pages8 = quant(pages)  # (NaN pages stay NaN)
    meta, splits = get_mla_metadata(seqlens, s_q * h_q, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = flash_mla_with_kvcache(q, pages8.unsqueeze(2), table, seqlens, 512, meta, splits,
                                          causal=s_q > 1, kv_scale=KV_SCALE)
    # (the metadata's plan is taken where the kernel splits as it plans, else the call plans its own, silently)
    assert not any("tile_scheduler_metadata" in str(w.message) for w in caught), [str(w.message) for w in caught]
    ro, rl = attention_reference(q, deq(pages8), seqlens, 576 ** -0.5, block_table=table, causal=s_q > 1,
                                 dtype=torch.float32)
    check(out, lse, ro.double(), rl.double(), f"fp8 serving block {block_size} h_q {h_q} s_q {s_q}")


@pytest.mark.parametrize("block_size", [16, 64])  # (the portable kernel's fp8 instance; the Hopper kernel's)
def test_fp8_under_a_cuda_graph_with_lengths_and_tables_changed_in_place(block_size):
    lens = [300, 1000, 64, 2000]
    q, pages, table, seqlens = make_paged(lens, block_size, h_q=64, seed=3)
    pages8 = quant(pages)
    out, lse = poisoned_out(q)
    mla_attention(q, pages8, seqlens, 0.07, block_table=table, out=out, lse=lse, kv_scale=KV_SCALE)  # (warm-up)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mla_attention(q, pages8, seqlens, 0.07, block_table=table, out=out, lse=lse, kv_scale=KV_SCALE)
    for new_lens, perm in (([1000, 300, 50, 1999], [1, 0, 2, 3]), ([1, 17, 64, 2000], [0, 1, 2, 3])):
        seqlens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        table.copy_(table[torch.tensor(perm, device=table.device)].clone())
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ro, rl = attention_reference(q, deq(pages8), seqlens, 0.07, block_table=table)
        check(out, lse, ro, rl, f"fp8 graph replay lens {new_lens}")


@pytest.mark.parametrize("qmul", [1.0, 1e5, 3e6])
def test_fp8_q_beyond_fp16_range(qmul):
    # The Hopper kernel's fp8 instances multiply in fp16: q up to 3e6 * 4.5
    # must be scaled into fp16's range (by a power of two), not overflow.
    q, kv, seqlens = make_case([700, 4097, 1, 129], h_q=64, seed=5)
    q = (q.float() * qmul).to(torch.bfloat16)
    kv8 = quant(kv)
    sc = 0.08 / qmul
    ro, rl = attention_reference(q, deq(kv8), seqlens, sc)
    out, lse = poisoned_out(q)
    mla_attention(q, kv8, seqlens, sc, out=out, lse=lse, kv_scale=KV_SCALE)
    check(out, lse, ro, rl, f"fp8 q x {qmul}")


@pytest.mark.parametrize("block_size", [64, 128])
def test_fp8_pages_of_a_multiple_of_64(block_size):
    lens = [300, 1000, 64, 2000, 4097]
    q, pages, table, seqlens = make_paged(lens, block_size, h_q=128, seed=block_size)
    p8 = quant(pages)
    ro, rl = attention_reference(q, deq(p8), seqlens, 0.07, block_table=table)
    out, lse = poisoned_out(q)
    mla_attention(q, p8, seqlens, 0.07, block_table=table, out=out, lse=lse, kv_scale=KV_SCALE)
    check(out, lse, ro, rl, f"fp8 pages of {block_size}")


def _kernels_run(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if "attention" in e.name and "combine" not in e.name]


def test_fp8_kernel_choice():
    # Where the Hopper kernel runs, it reads an fp8 cache that is dense or in
    # pages of a multiple of 64 rows (TMA boxes of 64 rows); the portable
    # kernel's fp8 instance reads pages of other sizes.
    hopper = kernel_choice.attention_kernel("cuda") == "hopper"
    q, kv, seqlens = make_case([100, 700], h_q=32, seed=2)
    kv8 = quant(kv)
    names = _kernels_run(lambda: mla_attention(q, kv8, seqlens, 0.1, kv_scale=KV_SCALE))
    assert names, "no attention kernel seen by the profiler"
    assert all(("attention_sm90_kernel" in n) == hopper for n in names), names
    q, pages, table, seqlens = make_paged([100, 700], 16, h_q=32, seed=2)
    p8 = quant(pages)
    names = _kernels_run(lambda: mla_attention(q, p8, seqlens, 0.1, block_table=table, kv_scale=KV_SCALE))
    assert names and not any("attention_sm90_kernel" in n for n in names), names


def test_fp8_with_tma_switched_off():
    # MLA_DECODE_TMA=0: the Hopper kernel's fp8 instances read only by TMA, so
    # an fp8 cache goes to the portable kernel's (not an error). A fresh
    # process: the switch is read once.
    code = ("import torch, mla_decode\n"
            "from mla_decode.fp8 import FP8_KV_DTYPE, dequantize_per_tensor, quantize_per_tensor\n"
            "g = torch.Generator(device='cuda').manual_seed(4)\n"
            "q = torch.randn(3, 1, 64, 576, device='cuda', generator=g).bfloat16()\n"
            "kv = torch.randn(3, 900, 576, device='cuda', generator=g).bfloat16()\n"
            "kv[1, 1:] = float('nan'); kv[2, 300:] = float('nan')\n"  # (never to be read)
            "lens = torch.tensor([900, 1, 300], dtype=torch.int32, device='cuda')\n"
            "kv8 = quantize_per_tensor(kv, 0.0125, FP8_KV_DTYPE)\n"
            "o, l = mla_decode.mla_attention(q, kv8, lens, 0.08, kv_scale=0.0125)\n"
            "ro, rl = mla_decode.attention_reference(q, dequantize_per_tensor(kv8, 0.0125, torch.float32), lens, 0.08)\n"
            "print((o.double() - ro).norm().item() / ro.norm().item(), (l.double() - rl).abs().max().item())\n")
    env = {k: v for k, v in os.environ.items() if k != "MLA_DECODE_TMA"}
    env["MLA_DECODE_TMA"] = "0"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rel, lse_err = map(float, r.stdout.split()[-2:])
    assert rel < 8e-3 and lse_err < 2e-3, r.stdout


def test_fp8_rows_appended_by_fp8_append_paged():
    lens = [40, 129, 7]
    q, pages, table, seqlens = make_paged([L + 1 for L in lens], 16, h_q=32, seed=21)
    pages8 = quant(pages)
    new_rows = torch.randn(len(lens), 576, device="cuda")
    fp8_append_paged(pages8, table, torch.tensor(lens), new_rows, k_scale=KV_SCALE)  # position L of each
    ro, rl = attention_reference(q, deq(pages8), seqlens, 0.09, block_table=table)
    out, lse = mla_attention(q, pages8, seqlens, 0.09, block_table=table, kv_scale=KV_SCALE)
    check(out, lse, ro, rl, "fp8 after an append")
    # the appended rows are what the cache holds for them: the last key of each sequence is the quantized row
    for b, L in enumerate(lens):
        pid, r = table[b, L // 16].item(), L % 16
        assert torch.equal(pages8[pid, r].view(torch.uint8), quant(new_rows[b]).view(torch.uint8))


@pytest.mark.parametrize("h_q", [16, 32, 128])
def test_fp8_every_code_decodes_exactly(h_q):
    # One key per sequence: its P is exactly 1, so out is its value row times
    # the scale (a power of two), which bf16 holds exactly: every finite code
    # of the platform's e4m3 (subnormals and both zeros included) must come
    # out as its value, bit for bit. Rows past the length hold NaN.
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_KV_DTYPE)
    finite = codes[torch.isfinite(codes.float())].view(torch.uint8)
    rows = torch.stack([finite.roll(k).repeat(3)[:576] for k in (0, 97)])  # two sequences, two orders
    kv8 = torch.full((2, 3, 576), 0x7F if FP8_KV_DTYPE == torch.float8_e4m3fn else 0x80, dtype=torch.uint8)
    kv8[:, 0] = rows
    kv8 = kv8.view(FP8_KV_DTYPE).cuda()
    g = torch.Generator(device="cuda").manual_seed(h_q)
    q = (0.01 * torch.randn(2, 1, h_q, 576, device="cuda", generator=g)).to(torch.bfloat16)
    seqlens = torch.ones(2, dtype=torch.int32, device="cuda")
    scale = 0.125
    out, lse = poisoned_out(q)
    mla_attention(q, kv8, seqlens, 0.1, out=out, lse=lse, kv_scale=scale)
    want = (rows[:, :512].view(FP8_KV_DTYPE).float() * scale).to(torch.bfloat16).cuda()
    assert torch.equal(out, want[:, None, None, :].expand_as(out)), (
        f"h_q {h_q}: {(out != want[:, None, None, :]).sum().item()} values differ from their code's value")


def test_fp8_refusals():
    q, kv, seqlens = make_case([100, 5], h_q=16, seed=1)
    kv8 = quant(kv)
    with pytest.raises(ValueError, match="kv_scale"):
        mla_attention(q, kv8, seqlens, 0.1)  # an fp8 cache without its scale
    with pytest.raises(ValueError, match="kv_scale"):
        mla_attention(q, kv, seqlens, 0.1, kv_scale=0.5)  # a scale for a bf16 cache
    with pytest.raises(ValueError, match="kv_scale"):
        torch.ops.mla_decode.attention(q, kv, seqlens, None, None, 0.1, False, None, 512, None, None, True, 0.5)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            mla_attention(q, kv8, seqlens, 0.1, kv_scale=bad)
    with pytest.raises(TypeError, match="bf16|bfloat16"):
        mla_attention(q.half(), kv8, seqlens, 0.1, kv_scale=0.5)
    with pytest.raises(ValueError, match="as stored|rope_cs"):
        mla_attention(q, kv8, seqlens, 0.1, kv_scale=0.5, rope_cs=rope_table(kv.shape[1], device="cuda"))
    other = torch.float8_e4m3fnuz if FP8_KV_DTYPE == torch.float8_e4m3fn else torch.float8_e4m3fn
    with pytest.raises(TypeError):
        mla_attention(q, kv.to(other), seqlens, 0.1, kv_scale=0.5)  # not this platform's format
