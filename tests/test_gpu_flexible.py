"""Flexible MLA shapes on the GPU: any head count, value width dv in
{64, 128, 256, 512}, rope width in {8, 16, 32, 64}, the rope keys shared (in
the latent row) or per head (MHA2MLA), against a float64 evaluation. Every
cache row past a sequence's length, every unused page and the outputs are
NaN-poisoned; invalid ids sit in unused block-table slots."""

import pytest
import torch

from mla_decode import (attention_reference, flash_mla_with_kvcache, get_mla_metadata, mla_attention)

from conftest import needs_gpu
from test_gpu_attention import check

pytestmark = [needs_gpu, pytest.mark.gpu]

DVS = (64, 128, 256, 512)
ROPES = (8, 16, 32, 64)
HEADS = (8, 24, 40, 56, 128, 16, 32, 64)


def make_flat(lens, h_q, dv, rope, per_head, s_q=1, seed=0, dtype=torch.bfloat16):
    """q [bs, s_q, h_q, dv + rope]; kv [bs, max_seq, d or dv]; kpe_heads
    [bs, max_seq, h_q, rope] or None. NaN past every length."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    bs, max_seq, d = len(lens), max(max(lens), 1) + 5, dv + rope
    width = dv if per_head else d
    kv = torch.randn(bs, max_seq, width, device="cuda", generator=g).to(dtype)
    kh = torch.randn(bs, max_seq, h_q, rope, device="cuda", generator=g).to(dtype) if per_head else None
    for b, L in enumerate(lens):
        kv[b, L:] = float("nan")
        if kh is not None:
            kh[b, L:] = float("nan")
    q = torch.randn(bs, s_q, h_q, d, device="cuda", generator=g).to(dtype)
    return q, kv, kh, torch.tensor(lens, dtype=torch.int32, device="cuda")


def make_pages(lens, block_size, h_q, dv, rope, per_head, s_q=1, seed=0, dtype=torch.bfloat16):
    """Pages in a random order, NaN in unused pages and tails, 2**30 in
    unused block-table slots; kpe pages share the ids of the latent pages."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    d = dv + rope
    width = dv if per_head else d
    used = [(L + block_size - 1) // block_size for L in lens]
    num_blocks = sum(used) + 3
    pages = torch.full((num_blocks, block_size, width), float("nan"), device="cuda", dtype=dtype)
    kh = (torch.full((num_blocks, block_size, h_q, rope), float("nan"), device="cuda", dtype=dtype)
          if per_head else None)
    ids = torch.randperm(num_blocks, device="cuda", generator=g).tolist()
    table = torch.full((len(lens), max(1, max(used))), 2 ** 30, dtype=torch.int32, device="cuda")
    nxt = 0
    for b, L in enumerate(lens):
        for j in range(used[b]):
            pid = ids[nxt]
            nxt += 1
            table[b, j] = pid
            n = min(block_size, L - j * block_size)
            pages[pid, :n] = torch.randn(n, width, device="cuda", generator=g).to(dtype)
            if kh is not None:
                kh[pid, :n] = torch.randn(n, h_q, rope, device="cuda", generator=g).to(dtype)
    q = torch.randn(len(lens), s_q, h_q, d, device="cuda", generator=g).to(dtype)
    return q, pages, kh, table, torch.tensor(lens, dtype=torch.int32, device="cuda")


def poisoned(q, dv):
    bs, s_q, h_q, _ = q.shape
    return (torch.full((bs, s_q, h_q, dv), float("nan"), dtype=q.dtype, device="cuda"),
            torch.full((bs, h_q, s_q), float("nan"), dtype=torch.float32, device="cuda"))


CASES = [(dv, rope, per_head) for dv in DVS for rope in ROPES for per_head in (False, True)]


@pytest.mark.parametrize("dv,rope,per_head", CASES)
def test_flexible_shapes(dv, rope, per_head):
    i = CASES.index((dv, rope, per_head))
    h_q = HEADS[i % len(HEADS)]
    lens = [1, 63, 65, 777, 0, 2049] if i % 2 == 0 else [300, 33, 4097]
    q, kv, kh, seqlens = make_flat(lens, h_q, dv, rope, per_head, seed=i)
    scale = (dv + rope) ** -0.5
    out, lse = poisoned(q, dv)
    mla_attention(q, kv, seqlens, scale, out=out, lse=lse, head_dim_v=dv, kpe_heads=kh)
    ro, rl = attention_reference(q, kv, seqlens, scale, head_dim_v=dv, kpe_heads=kh)
    check(out, lse, ro, rl, f"dv={dv} rope={rope} per_head={per_head} h_q={h_q}")
    if 0 in lens:
        b = lens.index(0)
        assert torch.equal(out[b], torch.zeros_like(out[b])) and torch.isneginf(lse[b]).all()


@pytest.mark.parametrize("dv,rope,h_q", [(512, 32, 32), (256, 16, 128), (128, 8, 40)])
def test_rows_wider_than_the_key(dv, rope, h_q):
    """Keys in rows padded in memory (row stride 64 elements past dv + rope,
    so rows start on 128-byte boundaries): the gap columns are NaN and must
    never be read."""
    lens = [1, 700, 4097, 129]
    q, kv, _, seqlens = make_flat(lens, h_q, dv, rope, False, seed=dv + rope)
    d = dv + rope
    wide = torch.full((kv.shape[0], kv.shape[1], dv + 64), float("nan"), dtype=kv.dtype, device="cuda")
    wide[..., :d] = kv
    view = wide[..., :d]
    assert view.stride(1) == dv + 64
    out, lse = poisoned(q, dv)
    mla_attention(q, view, seqlens, d ** -0.5, out=out, lse=lse, head_dim_v=dv)
    ro, rl = attention_reference(q, kv, seqlens, d ** -0.5, head_dim_v=dv)
    check(out, lse, ro, rl, f"strided rows dv={dv} rope={rope} h_q={h_q}")


@pytest.mark.parametrize("dv,rope,h_q", [(512, 32, 64), (256, 16, 24), (128, 8, 128), (64, 32, 64)])
def test_separate_rope_rows_narrow(dv, rope, h_q):
    """Separate rope-key rows (kpe) narrower than 64, in a wider buffer with
    NaN in the gap: they replace the key's rope columns, which are NaN in the
    cache and never read. The kernel pads the rope block to 64 columns: the
    NaN gap beside the kpe columns must never reach S. (h_q 64 and 128 take
    Q by TMA, 24 by cp.async; the lengths give full 64-key halves (TMA) and
    partial ones (cp.async).)"""
    lens = [1, 700, 4097, 129]
    q, kv, _, seqlens = make_flat(lens, h_q, dv, rope, False, seed=dv + 3 * rope + h_q)
    wide = torch.full((kv.shape[0], kv.shape[1] + 2, rope + 16), float("nan"), dtype=kv.dtype, device="cuda")
    kpe = wide[:, :, 8:8 + rope]
    kpe[:, :kv.shape[1]] = kv[..., dv:]
    kv_no_rope = kv.clone()
    kv_no_rope[..., dv:] = float("nan")
    out, lse = poisoned(q, dv)
    scale = (dv + rope) ** -0.5
    mla_attention(q, kv_no_rope, seqlens, scale, out=out, lse=lse, head_dim_v=dv, kpe=kpe)
    ro, rl = attention_reference(q, kv, seqlens, scale, head_dim_v=dv)
    check(out, lse, ro, rl, f"kpe rows dv={dv} rope={rope} h_q={h_q}")


@pytest.mark.parametrize("dv,rope", [(512, 32), (128, 64), (256, 64), (64, 64)])
def test_flexible_rope_on_the_fly(dv, rope):
    # the task's RoPE applied to the shared rope columns in the kernel, any rope width
    from mla_decode import rope_table

    q, kv, _, seqlens = make_flat([5, 700, 129], 24, dv, rope, False, seed=dv + rope)
    cs = rope_table(kv.shape[1], rope, device="cuda")
    out, lse = mla_attention(q, kv, seqlens, 0.07, rope_cs=cs, head_dim_v=dv)
    ro, rl = attention_reference(q, kv, seqlens, 0.07, rope_cs=cs, head_dim_v=dv)
    check(out, lse, ro, rl, f"rope on the fly dv={dv} rope={rope}")


@pytest.mark.parametrize("dv,rope,per_head,block,h_q,s_q,dtype", [
    (256, 32, True, 1, 40, 2, torch.bfloat16),
    (128, 16, False, 16, 24, 1, torch.bfloat16),
    (64, 8, True, 64, 56, 3, torch.bfloat16),
    (512, 64, True, 64, 128, 1, torch.bfloat16),
    (512, 16, False, 1, 32, 1, torch.bfloat16),
    (512, 16, True, 16, 32, 1, torch.float16),
    (512, 32, True, 1, 8, 4, torch.bfloat16),
    (256, 64, False, 32, 8, 4, torch.float16),
    (256, 8, False, 1, 128, 2, torch.bfloat16),
    (128, 64, False, 64, 64, 1, torch.float16),
])
def test_flexible_serving(dv, rope, per_head, block, h_q, s_q, dtype):
    lens = [2048, 4096, 1, 6000, 3000, s_q]
    q, pages, kh, table, seqlens = make_pages(lens, block, h_q, dv, rope, per_head, s_q=s_q, seed=block + h_q,
                                              dtype=dtype)
    meta, splits = get_mla_metadata(seqlens, s_q * h_q, 1)
    out, lse = flash_mla_with_kvcache(q, pages.unsqueeze(2), table, seqlens, dv, meta, splits, causal=s_q > 1,
                                      kpe_cache=kh)
    assert out.shape == (len(lens), s_q, h_q, dv) and out.dtype == dtype
    ro, rl = attention_reference(q, pages, seqlens, (dv + rope) ** -0.5, block_table=table, causal=s_q > 1,
                                 head_dim_v=dv, kpe_heads=kh)
    check(out, lse, ro, rl, f"serving dv={dv} rope={rope} per_head={per_head} block={block} h_q={h_q} s_q={s_q}")


@pytest.mark.parametrize("h_q,s_q,rope,dtype", [(32, 1, 16, torch.bfloat16), (12, 1, 32, torch.bfloat16),
                                                 (8, 4, 64, torch.bfloat16), (16, 2, 8, torch.float16),
                                                 (40, 1, 16, torch.bfloat16), (128, 1, 16, torch.bfloat16),
                                                 (72, 1, 64, torch.float16)])
def test_per_head_keys_dv512(h_q, s_q, rope, dtype):
    # on the Hopper kernel where there is one: work items of 32 query rows, the
    # score tile in the rope block (rows past the last zero-filled; fewer than
    # 32 rows by cp.async); lengths cover partial halves and a 1-key tail
    lens = [4097, 1, 129, 700, 63, 2000]
    q, kv, kh, seqlens = make_flat(lens, h_q, 512, rope, True, s_q=s_q, seed=h_q + s_q, dtype=dtype)
    out, lse = poisoned(q, 512)
    mla_attention(q, kv, seqlens, 0.09, out=out, lse=lse, head_dim_v=512, kpe_heads=kh, causal=s_q > 1)
    ro, rl = attention_reference(q, kv, seqlens, 0.09, head_dim_v=512, kpe_heads=kh, causal=s_q > 1)
    check(out, lse, ro, rl, f"per-head dv 512 h_q={h_q} s_q={s_q} rope={rope}")
    from mla_decode._ext import attention_info
    dev = torch.cuda.current_device()
    if attention_info(dev, 512, 64).kernel == "hopper":  # a Hopper build on a Hopper GPU: per-head keys go there too
        assert attention_info(dev, 512, 0).kernel == "hopper" and attention_info(dev, 512, 0).rows_per_block == 32


def test_flexible_bad_inputs():
    q, kv, kh, seqlens = make_flat([10, 20], 16, 256, 32, True)
    with pytest.raises(ValueError, match=r"unsupported attention shape: head dim d=288 with head_dim_v=192.*"
                                         r"supported: value width dv in \{64, 128, 256, 512\}"):
        mla_attention(q, kv, seqlens, 0.1, head_dim_v=192, kpe_heads=kh)
    with pytest.raises(ValueError, match=r"kpe_heads must have shape \[bs, >= max_seq_len, h_q, rope\] with "
                                         r"h_q=16, rope=32, got \[2, 25, 8, 32\]"):
        mla_attention(q, kv, seqlens, 0.1, head_dim_v=256, kpe_heads=kh[:, :, :8].contiguous())
    with pytest.raises(ValueError, match=r"kv must have shape \[bs, max_seq_len, 256\]"):
        mla_attention(q, torch.cat([kv, kv[..., :32]], -1), seqlens, 0.1, head_dim_v=256, kpe_heads=kh)
    with pytest.raises(ValueError, match="pass neither rope_cs nor kpe"):
        from mla_decode import rope_table
        mla_attention(q, kv, seqlens, 0.1, head_dim_v=256, kpe_heads=kh,
                      rope_cs=rope_table(kv.shape[1], 32, device="cuda"))
    shifted = torch.empty(kh.numel() + 4, dtype=kh.dtype, device="cuda")[4:].view(kh.shape)  # 8 bytes off
    shifted.copy_(kh)
    with pytest.raises(ValueError, match="16-byte aligned"):
        mla_attention(q, kv, seqlens, 0.1, head_dim_v=256, kpe_heads=shifted)
