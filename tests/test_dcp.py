"""Decode context parallelism (mla_decode.dcp), on the CPU, always runs:
merge_attention_states against attention over the union of the keys, the
two cache layouts and dcp_shard_cache (round trips at page sizes 1, 16, 64),
and dcp_attention in 2 and 3 gloo processes against the single-process
float64 reference on the full cache. A 2-GPU NCCL variant with the kernels
(skips with the reason where fewer GPUs are visible)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mla_decode
from mla_decode import attention_reference
from mla_decode.attention import kv_rows_bf16
from mla_decode.dcp import (dcp_attention, dcp_global_positions, dcp_local_lengths, dcp_shard_cache,
                            merge_attention_states)

from conftest import free_port, gpus, init_rank, needs_gpu

DV, ROPE = 64, 8
D = DV + ROPE
H_Q = 4
LENS = [0, 1, 2, 5, 16, 17, 63, 100, 129]


def make_paged(lens, page, d=D, h_q=H_Q, s_q=1, seed=0, dtype=torch.float32):
    """A full paged cache [num_blocks, page, 1, d] in a random block order
    (NaN in every unused block and every row past a length, an invalid id in
    every unused block-table slot), q [b, s_q, h_q, d], seqlens int32."""
    g = torch.Generator().manual_seed(seed)
    used = [(L + page - 1) // page for L in lens]
    num_blocks = sum(used) + 3
    pages = torch.full((num_blocks, page, d), float("nan"), dtype=dtype)
    ids = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.full((len(lens), max(1, max(used))), 2 ** 30, dtype=torch.int32)
    nxt = 0
    for b, L in enumerate(lens):
        for j in range(used[b]):
            pid = int(ids[nxt])
            nxt += 1
            table[b, j] = pid
            n = min(page, L - j * page)
            pages[pid, :n] = torch.randn(n, d, generator=g).to(dtype)
    q = torch.randn(len(lens), s_q, h_q, d, generator=g).to(dtype)
    return q, pages.unsqueeze(2), table, torch.tensor(lens, dtype=torch.int32)


def full_reference(q, k_cache, table, seqlens, scale, dv=DV):
    return attention_reference(q, k_cache[:, :, 0], seqlens, scale, block_table=table, head_dim_v=dv,
                               dtype=torch.float64)


def close(out, ref, atol, rtol, what):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o, r = out.double(), ref.double()
    assert torch.equal(torch.isfinite(o), torch.isfinite(r)), f"{what}: finite positions differ"
    assert torch.equal(torch.isneginf(o), torch.isneginf(r)), f"{what}: -inf positions differ"
    fin = torch.isfinite(r)
    err = (o[fin] - r[fin]).abs()
    lim = atol + rtol * r[fin].abs()
    assert bool((err <= lim).all()), f"{what}: max abs err {err.max().item():.3g}, max excess {(err - lim).max().item():.3g}"


# ---------------------------------------------------------------------------- (a) merge

def split_dense(q, k_cache, table, seqlens, owner):
    """Dense per-set caches [b, max, d] of a paged cache's keys: owner(b, t)
    -> set index of token t of sequence b; returns {set: (kv, seqlens)}."""
    lens = seqlens.tolist()
    sets = {}
    for b, L in enumerate(lens):
        rows = kv_rows_bf16(k_cache[:, :, 0], table, b, L)
        for t in range(L):
            sets.setdefault(owner(b, t), {}).setdefault(b, []).append(rows[t])
    return sets


def partial_results(q, k_cache, table, seqlens, n_sets, owner, scale):
    b = q.shape[0]
    sets = split_dense(q, k_cache, table, seqlens, owner)
    outs, lses = [], []
    for s in range(n_sets):
        per = sets.get(s, {})
        m = max([1] + [len(v) for v in per.values()])
        kv = torch.zeros(b, m, q.shape[-1], dtype=k_cache.dtype)
        lens = torch.zeros(b, dtype=torch.int32)
        for i, rows in per.items():
            kv[i, :len(rows)] = torch.stack(rows)
            lens[i] = len(rows)
        o, lse = attention_reference(q, kv, lens, scale, head_dim_v=DV, dtype=torch.float64)
        outs.append(o)
        lses.append(lse.float())
    return outs, lses


@pytest.mark.parametrize("n_sets", [2, 3])
def test_merge_equals_attention_over_the_union(n_sets):
    q, k_cache, table, seqlens = make_paged(LENS, 16, s_q=2, seed=n_sets)
    scale = D ** -0.5
    ref_o, ref_l = full_reference(q, k_cache, table, seqlens, scale)
    g = torch.Generator().manual_seed(10 + n_sets)
    assign = torch.randint(0, n_sets, (len(LENS), max(LENS)), generator=g)
    assign[3] = 0  # sequence 3 (length 5): every other set empty for it
    # n_sets 3: set 2 sees no key of any sequence
    owner = (lambda b, t: int(assign[b, t]) % 2) if n_sets == 3 else (lambda b, t: int(assign[b, t]))
    outs, lses = partial_results(q, k_cache, table, seqlens, n_sets, owner, scale)
    if n_sets == 3:
        assert torch.isneginf(lses[2]).all()
    assert torch.isneginf(lses[1][3]).all() and torch.isneginf(lses[0][0]).all()
    # float64 partials: merged in float64, the lse in fp32
    out, lse = merge_attention_states(torch.stack(outs), torch.stack(lses))
    assert out.dtype == torch.float64 and lse.dtype == torch.float32 and out.shape == ref_o.shape
    close(out, ref_o, 1e-6, 1e-5, "merged out (float64 partials)")
    close(lse, ref_l, 1e-5, 1e-6, "merged lse")
    # fp32 partials (the list form)
    out32, lse32 = merge_attention_states([o.float() for o in outs], lses)
    assert out32.dtype == torch.float32
    close(out32, ref_o, 1e-5, 1e-5, "merged out (fp32 partials)")
    close(lse32, ref_l, 1e-5, 1e-6, "merged lse (fp32 partials)")
    # bf16 partials: the result is within bf16 rounding of the partials
    outbf, _ = merge_attention_states(torch.stack(outs).bfloat16(), torch.stack(lses))
    assert outbf.dtype == torch.bfloat16
    close(outbf, ref_o, 1e-2, 1e-2, "merged out (bf16 partials)")
    # the empty sequence 0: out 0, lse -inf
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()


def test_merge_all_empty_gives_zero_and_neg_inf():
    n, b, s_q, h_q, dv = 3, 2, 2, 4, 8
    outs = torch.full((n, b, s_q, h_q, dv), float("nan"))  # garbage a rank with no key might hold
    lses = torch.full((n, b, h_q, s_q), float("-inf"))
    out, lse = merge_attention_states(outs, lses)
    assert torch.equal(out, torch.zeros(b, s_q, h_q, dv)) and torch.isneginf(lse).all()
    # one partial with keys among empty ones: that partial exactly, the empty ones' garbage ignored
    lses[1, 0] = 0.25
    outs[1, 0] = 3.0
    out, lse = merge_attention_states(outs, lses)
    assert torch.equal(out[0], torch.full_like(out[0], 3.0)) and torch.equal(lse[0], torch.full_like(lse[0], 0.25))
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,dv", [(1, 512), (2, 512), (4, 512), (3, 100), (2, 36)])
def test_merge_kernel_matches_float64(dtype, n, dv):
    # the GPU merge (one kernel) against the float64 PyTorch merge of the same partials; partials with
    # lse -inf hold NaN (never read), one row has no key on any rank; dv 100 / 36: bf16/fp16 rows that are
    # not whole 16-byte pieces (the element path), fp32 rows that are (dv 100) or not (36)
    b, s_q, h_q = 3, 2, 5
    g = torch.Generator().manual_seed(n * 1000 + dv)
    outs = torch.randn(n, b, s_q, h_q, dv, generator=g).to(dtype)
    lses = torch.randn(n, b, h_q, s_q, generator=g) * 4
    gone = torch.rand(n, b, h_q, s_q, generator=g) < 0.3
    lses[gone] = float("-inf")
    lses[:, 1, 2, 1] = float("-inf")  # (b 1, h 2, s 1): no key anywhere
    outs = outs.clone()
    outs.permute(0, 1, 3, 2, 4)[gone] = float("nan")
    ref_o, ref_l = merge_attention_states(outs.double(), lses)
    got_o, got_l = merge_attention_states(outs.cuda(), lses.cuda())
    assert got_o.dtype == dtype and got_l.dtype == torch.float32 and got_o.is_cuda
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}[dtype]
    close(got_o.cpu(), ref_o, tol, tol, f"merged out {dtype} n {n} dv {dv}")
    close(got_l.cpu(), ref_l, 2e-5, 2e-6, f"merged lse {dtype} n {n} dv {dv}")
    assert torch.equal(got_o[1, 1, 2].cpu(), torch.zeros(dv, dtype=dtype))
    assert not torch.isnan(got_o).any()


def test_merge_bad_inputs_raise():
    outs, lses = torch.zeros(2, 1, 1, 4, 8), torch.zeros(2, 1, 4, 1)
    with pytest.raises(TypeError, match="lses must be float32"):
        merge_attention_states(outs, lses.double())
    with pytest.raises(TypeError, match="outs must be a float tensor"):
        merge_attention_states(outs.int(), lses)
    with pytest.raises(ValueError, match=r"lses must have shape \[N, b, h_q, s_q\] = \[2, 1, 4, 1\]"):
        merge_attention_states(outs, torch.zeros(2, 1, 1, 4))
    with pytest.raises(ValueError, match=r"lses must have shape"):
        merge_attention_states(outs, torch.zeros(3, 1, 4, 1))
    with pytest.raises(ValueError, match=r"outs must have shape \[N, b, s_q, h_q, dv\]"):
        merge_attention_states(outs[0], lses[0])
    with pytest.raises(ValueError, match="one device"):
        merge_attention_states(outs.to("meta"), lses)
    with pytest.raises(ValueError, match=r"outs\[1\] is"):
        merge_attention_states([outs[0], outs[1, ..., :4]], [lses[0], lses[1]])
    with pytest.raises(ValueError, match="empty list"):
        merge_attention_states([], [])
    with pytest.raises(TypeError, match="a tensor or a list of tensors"):
        merge_attention_states("x", lses)


# ---------------------------------------------------------------------------- (b) layouts

def brute_owner(t, L, world, layout, chunk):
    if layout == "interleaved":
        return (t // (chunk or 1)) % world
    c = chunk if chunk is not None else (L + world - 1) // world
    return t // c


LAYOUTS = [("interleaved", None), ("interleaved", 3), ("interleaved", 16), ("contiguous", None),
           ("contiguous", 64)]


@pytest.mark.parametrize("layout,chunk", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_local_lengths_and_positions_match_the_rule(layout, chunk, world):
    lens = [0, 1, 2, 3, 5, 15, 16, 17, 63, 64, 65, 100, 129, 191, 192]
    if layout == "contiguous" and chunk is not None:
        lens = [L for L in lens if L <= world * chunk]  # longer ones raise (test_layout_examples_and_errors)
    counts = torch.stack([dcp_local_lengths(torch.tensor(lens, dtype=torch.int32), r, world, layout, chunk)
                          for r in range(world)])
    assert counts.dtype == torch.int32
    assert counts.sum(0).tolist() == lens
    for r in range(world):
        for L in lens:
            want = [t for t in range(L) if brute_owner(t, L, world, layout, chunk) == r]
            got = dcp_global_positions(L, r, world, layout, chunk).tolist()
            assert got == want, f"rank {r} of {world}, L={L}, {layout} chunk={chunk}"
            assert int(counts[r, lens.index(L)]) == len(want)
    # a list works too; the device and no sync are kept (CPU here)
    assert dcp_local_lengths(lens, 0, world, layout, chunk).tolist() == counts[0].tolist()


def test_layout_examples_and_errors():
    # interleaved: token t on rank t mod N
    assert dcp_global_positions(7, 1, 3).tolist() == [1, 4]
    assert dcp_local_lengths(torch.tensor([7, 0, 1]), 0, 3).tolist() == [3, 0, 1]
    # contiguous without chunk: ceil(L / N) per rank, the last shorter or empty
    assert dcp_global_positions(7, 1, 3, "contiguous").tolist() == [3, 4, 5]
    assert dcp_global_positions(7, 2, 3, "contiguous").tolist() == [6]
    assert dcp_global_positions(4, 3, 4, "contiguous").tolist() == [3]
    assert dcp_global_positions(5, 3, 4, "contiguous").tolist() == []  # C = 2: ranks hold 2, 2, 1, 0
    with pytest.raises(ValueError, match="at most world \\* chunk = 8 tokens per sequence, got a length of 9"):
        dcp_local_lengths(torch.tensor([9]), 0, 2, "contiguous", chunk=4)
    with pytest.raises(ValueError, match="layout must be one of"):
        dcp_local_lengths(torch.tensor([9]), 0, 2, "striped")
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        dcp_local_lengths(torch.tensor([9]), 2, 2)
    with pytest.raises(ValueError, match="chunk must be None or a positive int"):
        dcp_local_lengths(torch.tensor([9]), 0, 2, chunk=0)
    with pytest.raises(TypeError, match="1-D integer tensor"):
        dcp_local_lengths(torch.tensor([9.0]), 0, 2)


@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("layout,chunk", [("interleaved", None), ("interleaved", 16), ("contiguous", None)])
def test_shard_cache_round_trip(page, layout, chunk):
    lens = [0, 1, 15, 16, 17, 63, 64, 65, 200, 3]
    q, k_cache, table, seqlens = make_paged(lens, page, seed=page)
    for world in (2, 3):
        seen = [torch.zeros(L, dtype=torch.int64) for L in lens]
        for r in range(world):
            for lp in (None, 16):
                kc, tb, sl = dcp_shard_cache(k_cache, table, seqlens, r, world, layout, chunk, page_block_size=lp)
                assert sl.dtype == torch.int32 and tb.dtype == torch.int32
                assert sl.tolist() == dcp_local_lengths(seqlens, r, world, layout, chunk).tolist()
                assert kc.shape[1:] == (lp or page, 1, D) and kc.dtype == k_cache.dtype
                assert not torch.isnan(kc).any(), "an unused or tail row of the full cache was copied"
                used = 0
                for b, L in enumerate(lens):
                    n = int(sl[b])
                    pos = dcp_global_positions(L, r, world, layout, chunk)
                    got = kv_rows_bf16(kc, tb, b, n)
                    want = kv_rows_bf16(k_cache, table, b, L)[pos]
                    assert torch.equal(got, want), f"rank {r} of {world}, sequence {b}, page {page} -> {lp}"
                    if lp is None:
                        seen[b][pos] += 1
                    used += (n + (lp or page) - 1) // (lp or page)
                assert kc.shape[0] == max(1, used)
                # rows past each local length are zero
                flat = kc.view(-1, D)
                mask = torch.ones(flat.shape[0], dtype=torch.bool)
                for b in range(len(lens)):
                    n = int(sl[b])
                    p = lp or page
                    for j in range(n):
                        mask[int(tb[b, j // p]) * p + j % p] = False
                assert torch.equal(flat[mask], torch.zeros_like(flat[mask]))
        for b, L in enumerate(lens):
            assert torch.equal(seen[b], torch.ones(L, dtype=torch.int64)), f"sequence {b}: not one owner per token"


def test_shard_cache_bad_inputs():
    q, k_cache, table, seqlens = make_paged([5, 9], 4)
    with pytest.raises(TypeError, match="block_table must be an int32"):
        dcp_shard_cache(k_cache, table.long(), seqlens, 0, 2)
    with pytest.raises(ValueError, match="holds 3 blocks of 4 = 12 tokens"):
        dcp_shard_cache(k_cache, table, torch.tensor([5, 13]), 0, 2)
    bad = table.clone()
    bad[1, 0] = 999
    with pytest.raises(ValueError, match="block_table row 1 names a block outside"):
        dcp_shard_cache(k_cache, bad, seqlens, 0, 2)
    with pytest.raises(ValueError, match=r"seqlens must be \[b\] with b = 2"):
        dcp_shard_cache(k_cache, table, torch.tensor([5]), 0, 2)


# ---------------------------------------------------------------------------- (c) dcp_attention

def test_dcp_attention_argument_errors():
    q, k_cache, table, seqlens = make_paged([3, 4], 4, s_q=2)
    with pytest.raises(ValueError, match="causal=True with s_q > 1 is not supported"):
        dcp_attention(q, k_cache, table, seqlens, DV, causal=True)
    with pytest.raises(ValueError, match="last dimension must be q's d = 72"):
        dcp_attention(q, k_cache[..., :64], table, seqlens, DV)
    with pytest.raises(TypeError, match="seqlens_local must be an int32 tensor"):
        dcp_attention(q, k_cache, table, seqlens.long(), DV)
    with pytest.raises(TypeError, match="block_table_local must be an int32 tensor"):
        dcp_attention(q, k_cache, table[:1], seqlens, DV)
    with pytest.raises(ValueError, match="backend must be"):
        dcp_attention(q, k_cache, table, seqlens, DV, backend="cuda")
    with pytest.raises(RuntimeError, match="kernels are not usable"):
        dcp_attention(q, k_cache, table, seqlens, DV, backend="kernels")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
            dcp_attention(q[:, :1], k_cache, table, seqlens, DV)
    # the PyTorch backend reads lengths and ids on the host: bad ones raise (a negative id would index from the end)
    cap = table.shape[1] * k_cache.shape[1]
    for bad_lens, match in ((seqlens.clone().fill_(cap + 1), rf"seqlens_local\[0\] = {cap + 1} is outside \[0, {cap}\]"),
                            (seqlens.clone().fill_(-1), r"seqlens_local\[0\] = -1 is outside")):
        with pytest.raises(ValueError, match=match):
            dcp_attention(q[:, :1], k_cache, table, bad_lens, DV, backend="torch")
    for bad_id in (-1, k_cache.shape[0]):
        bad = table.clone()
        bad[1, 0] = bad_id
        with pytest.raises(ValueError, match=rf"block_table_local\[1, 0\] = {bad_id} is outside"):
            dcp_attention(q[:, :1], k_cache, bad, seqlens, DV, backend="torch")


def test_dcp_attention_world_of_one():
    q, k_cache, table, seqlens = make_paged(LENS, 16, s_q=2, seed=3)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out, lse = dcp_attention(q, k_cache, table, seqlens, DV, backend="torch")
    finally:
        dist.destroy_process_group()
    ro, rl = full_reference(q, k_cache, table, seqlens, D ** -0.5)
    close(out, ro, 1e-5, 1e-5, "out")
    close(lse, rl, 1e-5, 1e-6, "lse")


# every case: (layout, chunk, page, s_q, causal, dtype, lens)
CPU_CASES = [
    ("interleaved", None, 16, 1, False, torch.float32, LENS),
    ("interleaved", None, 1, 2, False, torch.float32, [1, 0, 7, 40]),
    ("contiguous", None, 64, 1, True, torch.float32, [0, 1, 65, 130, 3]),
    ("interleaved", 16, 16, 3, False, torch.bfloat16, [0, 1, 33, 70]),
    ("contiguous", 64, 1, 1, False, torch.bfloat16, [2, 1, 0, 129]),
]


def _worker(rank, world, port, dist_backend, device_kind, cases, shape, attn_backend):
    torch.set_num_threads(1)
    device = init_rank(rank, world, port, dist_backend, device_kind)
    try:
        d, dv, h_q = shape
        for i, (layout, chunk, page, s_q, causal, dtype, lens) in enumerate(cases):
            if layout == "contiguous" and chunk is not None and max(lens) > world * chunk:
                chunk = (max(lens) + world - 1) // world
            what = f"rank {rank} of {world}, case {i}: {layout} chunk={chunk} page={page} s_q={s_q} {dtype}"
            # the same full cache on every rank (made on the CPU from one seed)
            q, k_cache, table, seqlens = make_paged(lens, page, d=d, h_q=h_q, s_q=s_q, seed=100 + i, dtype=dtype)
            scale = d ** -0.5
            ro, rl = full_reference(q, k_cache, table, seqlens, scale, dv=dv)
            kc, tb, sl = dcp_shard_cache(k_cache, table, seqlens, rank, world, layout, chunk)
            out, lse = dcp_attention(q.to(device), kc.to(device), tb.to(device), sl.to(device), dv, scale,
                                     causal=causal, backend=attn_backend)
            assert out.dtype == dtype and lse.dtype == torch.float32, what
            assert out.shape == (len(lens), s_q, h_q, dv) and lse.shape == (len(lens), h_q, s_q), what
            out, lse = out.cpu(), lse.cpu()
            if dtype == torch.float32:
                close(out, ro, 1e-5, 1e-5, f"out, {what}")
            else:  # bf16: the kernels' partials rounded to bf16, then the merged result again
                close(out, ro, 1e-2, 2e-2, f"out, {what}")
            close(lse, rl, 2e-3 if device != "cpu" else 1e-5, 1e-5, f"lse, {what}")
            for b, L in enumerate(lens):
                if L == 0:
                    assert torch.equal(out[b], torch.zeros_like(out[b])) and torch.isneginf(lse[b]).all(), what
            # the rank's heads alone (a reduce-scatter over the heads)
            args_ = (q.to(device), kc.to(device), tb.to(device), sl.to(device), dv, scale)
            if h_q % world == 0:
                hs = h_q // world
                so, sls = dcp_attention(*args_, causal=causal, backend=attn_backend, scatter_heads=True)
                assert so.dtype == dtype and so.shape == (len(lens), s_q, hs, dv) and so.is_contiguous(), \
                    f"{what}: {so.dtype} {tuple(so.shape)} contiguous {so.is_contiguous()}"
                assert sls.shape == (len(lens), hs, s_q), what
                heads = slice(rank * hs, (rank + 1) * hs)
                close(so.cpu(), ro[:, :, heads], 1e-5 if dtype == torch.float32 else 1e-2, 1e-5 if dtype ==
                      torch.float32 else 2e-2, f"scattered out, {what}")
                close(sls.cpu(), rl[:, heads], 2e-3 if device != "cpu" else 1e-5, 1e-5, f"scattered lse, {what}")
            else:
                with pytest.raises(ValueError, match="multiple of the group's size"):
                    dcp_attention(*args_, causal=causal, backend=attn_backend, scatter_heads=True)
            # every rank holds the same result (gathered where the backend works: NCCL on the GPU)
            pair = torch.cat([out.float().reshape(-1), lse.reshape(-1)]).to(device)
            got = [torch.empty_like(pair) for _ in range(world)]
            dist.all_gather(got, pair)
            assert all(torch.equal(got[0].nan_to_num(), t.nan_to_num()) for t in got), f"ranks disagree, {what}"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_dcp_attention_gloo(world):
    mp.spawn(_worker, args=(world, free_port(), "gloo", "cpu", CPU_CASES, (D, DV, H_Q), "torch"), nprocs=world,
             join=True)


# ---------------------------------------------------------------------------- (d) GPUs


GPU_CASES = [
    ("interleaved", None, 64, 1, False, torch.bfloat16, [0, 1, 2, 513, 4097, 1000, 64, 65]),
    ("interleaved", None, 1, 2, False, torch.bfloat16, [1, 0, 300, 2049]),
    ("contiguous", None, 16, 1, False, torch.float16, [0, 1, 777, 3000]),
    ("interleaved", 64, 64, 4, False, torch.bfloat16, [8192, 1, 0, 129]),
]


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("world", [pytest.param(2, marks=gpus(2)), pytest.param(4, marks=gpus(4))])
def test_dcp_attention_nccl(world):
    # DeepSeek's shape: d 576, dv 512, h_q 128; the kernels on each rank, NCCL between them
    mp.spawn(_worker, args=(world, free_port(), "nccl", "cuda", GPU_CASES, (576, 512, 128), "kernels"),
             nprocs=world, join=True)
