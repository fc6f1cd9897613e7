"""The attention kernel (split-KV absorbed MQA + combine) against a float64
evaluation on the GPU. Unused cache rows and the outputs are NaN-poisoned."""

import math
import random

import pytest
import torch

import mla_decode
from mla_decode import attention_reference, mla_attention, mla_combine, rope_table
from mla_decode.attention import plan_part_base

from conftest import load_plan_model, needs_gpu, rel_err

pytestmark = [needs_gpu, pytest.mark.gpu]
D, DV = 576, 512


def make_case(lens, h_q=128, s_q=1, max_seq=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bs = len(lens)
    max_seq = max_seq or max(max(lens), 1)
    kv = torch.randn(bs, max_seq, D, device="cuda", generator=g).to(torch.bfloat16)
    for b, L in enumerate(lens):
        kv[b, L:] = float("nan")  # never to be read
    q = torch.randn(bs, s_q, h_q, D, device="cuda", generator=g).to(torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q, kv, seqlens


def poisoned_out(q):
    bs, s_q, h_q, _ = q.shape
    return (torch.full((bs, s_q, h_q, DV), float("nan"), dtype=torch.bfloat16, device="cuda"),
            torch.full((bs, h_q, s_q), float("nan"), dtype=torch.float32, device="cuda"))


def check(out, lse, ref_o, ref_lse, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in out (unwritten or poisoned rows leaked)"
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    e = rel_err(out, ref_o)
    assert e < 8e-3, f"{what}: relative error of out {e:.2e}"
    err = (out.double() - ref_o).abs().max().item()
    assert err < 3e-2 * ref_o.abs().max().item() + 1e-3, f"{what}: max abs error of out {err:.3g}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse)), f"{what}: lse finite positions differ"
    lerr = (lse.double()[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    assert lerr < 2e-3, f"{what}: max abs error of lse {lerr:.3g}"


@pytest.mark.parametrize("L", [1, 2, 63, 64, 65, 513, 777, 4097, 8192])
@pytest.mark.parametrize("bs", [1, 3])
@pytest.mark.parametrize("rope", [False, True])
def test_attention_lengths(L, bs, rope):
    q, kv, seqlens = make_case([L] * bs, max_seq=L + 7, seed=L + bs)
    cs = rope_table(kv.shape[1], device="cuda") if rope else None
    scale = 1 / math.sqrt(192)
    out, lse = poisoned_out(q)
    mla_attention(q, kv, seqlens, scale, rope_cs=cs, out=out, lse=lse)
    ro, rl = attention_reference(q, kv, seqlens, scale, rope_cs=cs)
    check(out, lse, ro, rl, f"L={L} bs={bs} rope={rope}")


@pytest.mark.parametrize("L", [1, 2, 63, 64, 65, 513, 777, 4097, 8192])
def test_attention_bs128(L):
    q, kv, seqlens = make_case([L] * 128, max_seq=L + 3, seed=L)
    cs = rope_table(kv.shape[1], device="cuda")
    out, lse = poisoned_out(q)
    mla_attention(q, kv, seqlens, 0.07, rope_cs=cs, out=out, lse=lse)
    ro, rl = attention_reference(q, kv, seqlens, 0.07, rope_cs=cs)
    check(out, lse, ro, rl, f"bs=128 L={L}")


def test_attention_mixed_lengths_and_empty():
    lens = [0, 1, 300, 8192, 65, 4000, 0, 2]
    q, kv, seqlens = make_case(lens, max_seq=8192, seed=3)
    out, lse = poisoned_out(q)
    mla_attention(q, kv, seqlens, 0.1, out=out, lse=lse)
    ro, rl = attention_reference(q, kv, seqlens, 0.1)
    check(out, lse, ro, rl, "mixed lengths")
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()


@pytest.mark.parametrize("h_q,s_q", [(16, 1), (24, 1), (128, 2), (64, 4)])
def test_attention_heads_and_causal(h_q, s_q):
    lens = [5, 700, 129]
    q, kv, seqlens = make_case(lens, h_q=h_q, s_q=s_q, max_seq=800, seed=h_q + s_q)
    out, lse = poisoned_out(q)
    mla_attention(q, kv, seqlens, 0.05, causal=True, out=out, lse=lse)
    ro, rl = attention_reference(q, kv, seqlens, 0.05, causal=True)
    check(out, lse, ro, rl, f"h_q={h_q} s_q={s_q} causal")


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("s_q", [1, 2])
def test_one_key_last_pair(rope, s_q):
    """Lengths of 128 k + 1 (every task length): the Hopper kernel adds a last
    pair's only key on the CUDA cores after its pair loop. Mixed with split
    sequences (the key in their last part), L = 1 (no pair at all), and last
    keys scaled up so that their scores move the running max far (the
    rescaling path of that step)."""
    lens = [1, 129, 513, 2049, 4097, 1, 257, 8193, 641, 385]
    q, kv, seqlens = make_case(lens, s_q=s_q, max_seq=8200, seed=77 + s_q + 2 * rope)
    for b in (1, 2, 5, 8):
        kv[b, lens[b] - 1] *= 6
    cs = rope_table(kv.shape[1], device="cuda") if rope else None
    out, lse = poisoned_out(q)
    mla_attention(q, kv, seqlens, 0.07, rope_cs=cs, causal=s_q > 1, out=out, lse=lse)
    ro, rl = attention_reference(q, kv, seqlens, 0.07, rope_cs=cs, causal=s_q > 1)
    check(out, lse, ro, rl, f"one-key last pair rope={rope} s_q={s_q}")


def make_paged(lens, block_size, h_q=128, s_q=1, seed=0, dtype=torch.bfloat16):
    """Pages [num_blocks, block_size, 576] in a random order; NaN in every
    unused page, every row past a sequence's length, and an invalid id
    (2**30) in every unused block-table slot."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    bs = len(lens)
    max_blocks = max(1, max((L + block_size - 1) // block_size for L in lens))
    used = [(L + block_size - 1) // block_size for L in lens]
    num_blocks = sum(used) + 5
    pages = torch.full((num_blocks, block_size, D), float("nan"), device="cuda", dtype=dtype)
    ids = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    table = torch.full((bs, max_blocks), 2 ** 30, dtype=torch.int32, device="cuda")
    nxt = 0
    for b, L in enumerate(lens):
        for j in range(used[b]):
            pid = ids[nxt].item()
            nxt += 1
            table[b, j] = pid
            n = min(block_size, L - j * block_size)
            pages[pid, :n] = torch.randn(n, D, device="cuda", generator=g).to(dtype)
    q = torch.randn(bs, s_q, h_q, D, device="cuda", generator=g).to(dtype)
    return q, pages, table, torch.tensor(lens, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("block_size", [1, 16, 64, 128])
@pytest.mark.parametrize("rope", [False, True])
def test_attention_paged(block_size, rope):
    lens = [1, 700, 129, 64, 0, 1000, 65]
    q, pages, table, seqlens = make_paged(lens, block_size, seed=block_size)
    cs = rope_table(table.shape[1] * block_size, device="cuda") if rope else None
    out, lse = poisoned_out(q)
    mla_attention(q, pages, seqlens, 0.07, block_table=table, rope_cs=cs, out=out, lse=lse)
    ro, rl = attention_reference(q, pages, seqlens, 0.07, block_table=table, rope_cs=cs)
    check(out, lse, ro, rl, f"paged block_size={block_size} rope={rope}")


@pytest.mark.parametrize("rope", [False, True])
def test_attention_many_items_per_block(rope):
    """Several work items per persistent block (bs 3 x 128 heads), lengths
    around the 64-key half and 128-key pair boundaries mixed with long split
    sequences and empty ones: exercises each item boundary, where the next
    item's first key half and Q may be loaded during the current item's
    last pair (or not: partial first halves, split current items)."""
    g = torch.Generator().manual_seed(41)
    pool = [0, 1, 2, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 513, 640, 3000]
    lens = [pool[i] for i in torch.randint(len(pool), (384,), generator=g).tolist()]
    q, kv, seqlens = make_case(lens, max_seq=3001, seed=42)
    cs = rope_table(kv.shape[1], device="cuda") if rope else None
    out, lse = poisoned_out(q)
    mla_attention(q, kv, seqlens, 0.07, rope_cs=cs, out=out, lse=lse)
    ro, rl = attention_reference(q, kv, seqlens, 0.07, rope_cs=cs)
    check(out, lse, ro, rl, f"384 sequences, rope={rope}")


def test_planner_fills_the_slots_in_one_wave_at_one_length():
    """A batch of one (long) length is cut into k = slots // bs parts per
    sequence: the most that run in one wave on the GPU's slots (more parts
    would leave a second wave on some slots; fewer leave slots idle). The
    parts of a sequence cover its tiles once, in order."""
    ext = mla_decode._ext.module()
    tile = mla_decode._ext.attention_info(0).keys_per_tile  # (the same tile at every head block)
    for h_q, bs, L in [(16, 128, 16384), (128, 8, 131073), (128, 16, 65537), (32, 32, 8193)]:
        slots = ext.plan_target_parts(0, 1, h_q)
        seqlens = torch.full((bs,), L, dtype=torch.int32, device="cuda")
        plan = torch.ops.mla_decode.plan(seqlens, 1, h_q, L).cpu()
        k = max(1, slots // bs)
        assert int(plan[0]) == k * bs, f"h_q {h_q}, bs {bs}, L {L}: {int(plan[0])} parts on {slots} slots, want {k * bs}"
        base = (2 + 2 * bs + 7) // 8 * 8  # plan layout: plan.h (count, per_part, then (splits, first) per sequence)
        parts = plan[base:base + 8 * k * bs].view(-1, 8)
        for b in range(bs):
            assert plan[2 + 2 * b].item() == k
            mine = parts[parts[:, 0] == b]
            assert mine[0, 1].item() == 0 and (mine[1:, 1] == mine[:-1, 2]).all(), f"sequence {b}: parts not contiguous"
            assert mine[-1, 2].item() == -(-L // tile) and (mine[:, 6] == L).all(), f"sequence {b}: {mine.tolist()}"


def test_planner_hangs_a_one_key_tile_on_the_last_part():
    """Lengths of 128 k + 1 (the task's): the Hopper kernel adds a last
    tile's only key outside its pair loop, so the planner cuts the parts
    from the 128 k keys before it and the last part ends with that tile (a
    part of the one key alone is a work item of its own: at bs 8, L 8193,
    16 such items beside 128 others on 132 SMs). The portable kernel runs
    such a tile as any other and is planned over all of them. The parts
    cover the tiles once, in order; the result against the reference."""
    info = mla_decode._ext.attention_info(0)
    bs, L, h_q = 8, 8193, 128
    q, kv, seqlens = make_case([L] * bs, h_q=h_q, max_seq=L, seed=8)
    plan = torch.ops.mla_decode.plan(seqlens, 1, h_q, kv.shape[1])
    p = plan.cpu()
    base = (2 + 2 * bs + 7) // 8 * 8  # plan layout: plan.h
    parts = p[base:base + 8 * int(p[0])].view(-1, 8)
    tiles = -(-L // info.keys_per_tile)
    for b in range(bs):
        mine = parts[parts[:, 0] == b]
        assert mine[0, 1].item() == 0 and (mine[1:, 1] == mine[:-1, 2]).all(), f"sequence {b}: parts not contiguous"
        assert mine[-1, 2].item() == tiles, f"sequence {b}: {mine.tolist()}"
        assert len(mine) > 1, "no sequence was split: the planner's cut went untested"
        if info.kernel == "hopper":
            sizes = mine[:, 2] - mine[:, 1]
            assert int(sizes.min()) > 1, f"sequence {b}: a part of the one-key tile alone: {mine.tolist()}"
    out, lse = poisoned_out(q)
    mla_attention(q, kv, seqlens, 0.07, out=out, lse=lse, plan=plan)
    ro, rl = attention_reference(q, kv, seqlens, 0.07)
    check(out, lse, ro, rl, "bs 8, L 8193, the one-key tile on the last part")


@pytest.mark.parametrize("h_q,bs,mean", [(16, 128, 4096), (64, 100, 16384), (128, 40, 4096), (16, 12, 30000)])
def test_planner_cuts_differing_lengths_longest_part_first(h_q, bs, mean):
    """Lengths that differ (normal(mean, mean / 2), as serving batches),
    fewer sequences than slots: every sequence is cut into chunks of the
    plan's size c and a last part of the rest, and the plan lists the parts
    longest first (the blocks take them in plan order as they free up). The
    parts cover each sequence's tiles once; a sequence's (splits, first
    part) follow its parts; taken in plan order the parts end within 1.2x
    of the work per slot, a tile per part counted (the planner's earlier
    equal parts in sequence order: 1.5-1.75x at the first three shapes).
    Against the reference, planned once and in the call."""
    ext = mla_decode._ext.module()
    tile = mla_decode._ext.attention_info(0).keys_per_tile
    slots = ext.plan_target_parts(0, 1, h_q)
    if bs >= slots:
        pytest.skip(f"{slots} slots at h_q {h_q} on this GPU: a batch of {bs} is planned as before")
    g = torch.Generator().manual_seed(h_q + bs)
    lens = [max(1, int(mean + mean / 2 * float(x))) for x in torch.randn(bs, generator=g)]
    lens[0] = 128 * (lens[0] // 128) + 1  # a one-key tile (the Hopper kernel's tail) on a split sequence
    q, kv, seqlens = make_case(lens, h_q=h_q, seed=bs)
    plan = torch.ops.mla_decode.plan(seqlens, 1, h_q, kv.shape[1])
    p = plan.cpu()
    n_parts, c = int(p[0]), int(p[1])
    assert n_parts <= slots + bs
    base = (2 + 2 * bs + 7) // 8 * 8  # plan layout: plan.h
    parts = p[base:base + 8 * n_parts].view(-1, 8)
    hopper = mla_decode._ext.attention_info(0).kernel == "hopper"
    first = 0
    for b, L in enumerate(lens):
        mine = parts[parts[:, 0] == b]
        n = int(p[2 + 2 * b])
        assert len(mine) == n and int(p[3 + 2 * b]) == first, f"sequence {b}: {n} splits, first {int(p[3 + 2 * b])}"
        assert (mine[:, 3] == torch.arange(n)).all() and (mine[:, 4] == n).all() and (mine[:, 5] == first).all()
        assert mine[0, 1].item() == 0 and (mine[1:, 1] == mine[:-1, 2]).all(), f"sequence {b}: parts not contiguous"
        assert mine[-1, 2].item() == -(-L // tile) and (mine[:, 6] == L).all(), f"sequence {b}: {mine.tolist()}"
        assert (mine[:-1, 2] - mine[:-1, 1] == c).all(), f"sequence {b}: chunks other than {c} tiles: {mine.tolist()}"
        first += n
    cut = parts[:, 2] - parts[:, 1]
    if hopper:  # (a last part's one-key tile is not counted when the parts are cut)
        tail = torch.tensor([(L - 1) % tile == 0 and L > tile for L in lens])[parts[:, 0]] & (parts[:, 3] == parts[:, 4] - 1)
        cut = cut - tail.long()
    assert (cut[1:] <= cut[:-1]).all(), f"parts not longest first: {cut.tolist()}"
    assert max(cut.tolist()) == c and int((p[2:2 + 2 * bs:2] > 1).sum()) > 0, "nothing was split"
    per_slot = (int(cut.sum()) + n_parts) / slots
    span = load_plan_model().span(cut.tolist(), slots)  # (each part costing a tile more)
    assert span <= 1.2 * per_slot, f"the parts end at {span} tiles on {slots} slots, the work per slot is {per_slot:.1f}"
    ro, rl = attention_reference(q, kv, seqlens, 0.08)
    for pl in (None, plan):
        out, lse = poisoned_out(q)
        mla_attention(q, kv, seqlens, 0.08, out=out, lse=lse, plan=pl)
        check(out, lse, ro, rl, f"h_q {h_q} bs {bs} mean {mean}, plan {'once' if pl is not None else 'in the call'}")


def test_planner_cut_is_the_documented_one():
    """The planner's cut of lengths that differ is tools/plan_model.py's
    fixed_chunks (the model the docs' span figures come from), part for part
    and in order, over random batches (empty sequences and one-key tails
    among them) at three head counts."""
    model = load_plan_model()
    ext = mla_decode._ext.module()
    info = mla_decode._ext.attention_info(0)
    tile = info.keys_per_tile
    tail = info.kernel == "hopper"  # (the one-key tail of lengths 128 k + 1: not counted when cutting)
    g = torch.Generator().manual_seed(3)
    checked = 0
    for h_q in (16, 64, 128):
        slots = ext.plan_target_parts(0, 1, h_q)
        for trial in range(6):
            bs = int(torch.randint(2, min(slots, 200), (1,), generator=g))
            mean = int(torch.randint(200, 40000, (1,), generator=g))
            lens = [max(0, int(mean * (1 + 0.6 * float(x)))) for x in torch.randn(bs, generator=g)]
            lens[0], lens[-1] = 0, 128 * (lens[-1] // 128) + 1
            if len(set(lens)) < 2:
                continue
            tiles = [-(-L // tile) if L > 0 else 0 for L in lens]
            cut = [t - 1 if tail and t > 1 and L - (t - 1) * tile == 1 else t for t, L in zip(tiles, lens)]
            c, want = model.fixed_chunks(cut, slots, slots + bs)
            want = [(b, s0, tiles[b] if s == n - 1 else s1, s, n) for b, s0, s1, s, n in want]
            seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
            p = torch.ops.mla_decode.plan(seqlens, 1, h_q, max(lens)).cpu()
            base = plan_part_base(bs)
            got = [tuple(int(v) for v in p[base + 8 * i: base + 8 * i + 5]) for i in range(int(p[0]))]
            assert int(p[1]) == c and got == want, f"h_q {h_q}, lens {lens}: chunk {int(p[1])} (model {c})"
            checked += 1
    assert checked >= 12


@pytest.mark.parametrize("lens,h_q", [([131072, 1, 32769, 8193], 128), ([1, 131073, 0, 65537, 513], 16),
                                      ([32769], 128)])
def test_small_batch_long_contexts_split_and_merged(lens, h_q):
    """Small batches at long contexts, as long-context serving runs them:
    lengths up to 131073 beside 1 (and 0) in one batch, NaN past every
    length. The planner cuts the long sequences into many parts (tens, a
    wave's worth at bs 1) that the combine merges; planned in the call and
    with a plan made beforehand. Against the float64 reference."""
    q, kv, seqlens = make_case(lens, h_q=h_q, seed=len(lens) + h_q)
    ro, rl = attention_reference(q, kv, seqlens, 0.08)
    plan = torch.ops.mla_decode.plan(seqlens, 1, h_q, kv.shape[1])
    for p in (None, plan):
        out, lse = poisoned_out(q)
        mla_attention(q, kv, seqlens, 0.08, out=out, lse=lse, plan=p)
        check(out, lse, ro, rl, f"lens {lens} h_q {h_q} plan {'once' if p is not None else 'in the call'}")
    longest = max(range(len(lens)), key=lambda b: lens[b])
    assert int(plan[2 + 2 * longest]) >= 8, "the longest sequence was not split: the combine went untested"


def test_large_batch_with_few_split_sequences_merged():
    """A batch past one wave of the combine's warps (40 x 128 rows x 4
    chunks, far above SMs x 32), where a few long sequences are split and
    the rest are not: the combine's looped form, whose warps each take a
    run of tasks and skip the unsplit sequences, must merge every split row
    and leave the attention's own rows alone. NaN past every length."""
    g = torch.Generator().manual_seed(7)
    lens = [int(x) for x in torch.randint(1, 700, (40,), generator=g)]
    lens[3], lens[17], lens[38] = 20000, 12289, 16385
    q, kv, seqlens = make_case(lens, h_q=128, seed=40)
    ro, rl = attention_reference(q, kv, seqlens, 0.08)
    plan = torch.ops.mla_decode.plan(seqlens, 1, 128, kv.shape[1])
    splits = [int(plan[2 + 2 * b]) for b in range(len(lens))]
    assert max(splits) > 1 and min(splits) == 1, f"want split and unsplit sequences, got {splits}"
    for p in (None, plan):
        out, lse = poisoned_out(q)
        mla_attention(q, kv, seqlens, 0.08, out=out, lse=lse, plan=p)
        check(out, lse, ro, rl, f"plan {'once' if p is not None else 'in the call'}")


def test_attention_plan_made_once_serves_many_calls():
    """plan= (as FlashMLA's metadata): one plan from the plan op serves call
    after call with the same lengths (new q each time, as the layers of a
    step), bit for bit what planning inside each call gives; the kernel
    leaves the plan's work counter at 0. A plan made for other lengths still
    gives the right answer (the lengths are read at the call). Refused: a
    plan of another size or dtype, and a kernel configuration that splits
    the work differently."""
    g = torch.Generator().manual_seed(45)
    lens = torch.randint(0, 700, (300,), generator=g).tolist() + [2000, 1, 0, 64]
    q, kv, seqlens = make_case(lens, max_seq=2001, seed=46)
    plan = torch.ops.mla_decode.plan(seqlens, 1, q.shape[2], kv.shape[1])
    assert plan[-2:].tolist() == [0, 0]
    gq = torch.Generator(device="cuda").manual_seed(47)
    for call in range(4):
        qc = torch.randn(q.shape, device="cuda", generator=gq).to(torch.bfloat16)
        cs = rope_table(kv.shape[1], device="cuda") if call == 3 else None
        out, lse = poisoned_out(qc)
        mla_attention(qc, kv, seqlens, 0.07, rope_cs=cs, out=out, lse=lse)
        out2, lse2 = poisoned_out(qc)
        mla_attention(qc, kv, seqlens, 0.07, rope_cs=cs, out=out2, lse=lse2, plan=plan)
        assert torch.equal(out, out2) and torch.equal(lse, lse2), f"call {call}"
        assert plan[-2:].tolist() == [0, 0], f"work counter left at {plan[-2:].tolist()} after call {call}"
        if call == 0:
            ro, rl = attention_reference(qc, kv, seqlens, 0.07)
            check(out2, lse2, ro, rl, "with a plan made beforehand")
    # a plan of other lengths: the lengths are read at the call, so the answer is still right
    for what, other in [("longer", (seqlens + 900).clamp(max=kv.shape[1])), ("shorter", seqlens // 3),
                        ("empty", torch.zeros_like(seqlens))]:
        stale = torch.ops.mla_decode.plan(other, 1, q.shape[2], kv.shape[1])
        cs = rope_table(kv.shape[1], device="cuda")
        out, lse = poisoned_out(q)
        mla_attention(q, kv, seqlens, 0.07, rope_cs=cs, out=out, lse=lse, plan=stale)
        ro, rl = attention_reference(q, kv, seqlens, 0.07, rope_cs=cs)
        check(out, lse, ro, rl, f"a plan made for {what} lengths")
    short = torch.ops.mla_decode.plan(seqlens[:3], 1, q.shape[2], kv.shape[1])
    with pytest.raises(ValueError, match="plan"):
        mla_attention(q, kv, seqlens, 0.07, plan=short)
    with pytest.raises(TypeError, match="plan"):
        mla_attention(q, kv, seqlens, 0.07, plan=plan.float())
    shifted = torch.zeros(plan.numel() + 1, dtype=torch.int32, device="cuda")[1:]  # contiguous, 4 bytes off
    shifted.copy_(plan)
    with pytest.raises(ValueError, match="plan must be 16-byte aligned"):
        mla_attention(q, kv, seqlens, 0.07, plan=shifted)
    # per-head rope keys: on the Hopper kernel 32-row work items, not what the plan op plans for (refused);
    # the portable kernel splits them as it splits the rope-in-key shape, so the plan serves them
    kv_lat = kv[:, :8, :DV].contiguous()
    kh = torch.randn(len(lens), 8, q.shape[2], D - DV, device="cuda").to(torch.bfloat16)
    a, b = (mla_decode._ext.attention_info(q.device.index, DV, r) for r in (D - DV, 0))
    if (a.kernel, a.rows_per_block, a.keys_per_tile, a.blocks_per_sm) != (b.kernel, b.rows_per_block,
                                                                          b.keys_per_tile, b.blocks_per_sm):
        with pytest.raises(ValueError, match="plan"):
            mla_attention(q, kv_lat, seqlens.clamp(max=8), 0.07, kpe_heads=kh, plan=plan)
    else:
        out, lse = mla_attention(q, kv_lat, seqlens.clamp(max=8), 0.07, kpe_heads=kh, plan=plan)
        ro, rl = attention_reference(q, kv_lat, seqlens.clamp(max=8), 0.07, kpe_heads=kh)
        check(out, lse, ro, rl, "per-head rope keys with the plan op's plan")


def test_attention_returns_new_tensors():
    q, kv, seqlens = make_case([100, 33], seed=9)
    out, lse = mla_attention(q, kv, seqlens, 0.1)
    ro, rl = attention_reference(q, kv, seqlens, 0.1)
    check(out, lse, ro, rl, "allocating call")


def test_attention_bad_inputs():
    q, kv, seqlens = make_case([10, 10], seed=1)
    with pytest.raises(ValueError, match=r"unsupported attention shape: head dim d=512 with head_dim_v=512"):
        mla_attention(q[..., :512].contiguous(), kv, seqlens, 0.1)
    with pytest.raises(TypeError, match=r"seqlens must be Int, got Long"):
        mla_attention(q, kv, seqlens.long(), 0.1)
    with pytest.raises(ValueError, match=r"kv must have shape \[bs, max_seq_len, 576\], got \[3, 10, 576\]"):
        mla_attention(q, torch.cat([kv, kv[:1]]), seqlens, 0.1)
    with pytest.raises(ValueError, match=r"seqlens must be on cuda:0 \(where q is\), got cpu"):
        mla_attention(q, kv, seqlens.cpu(), 0.1)
    with pytest.raises(ValueError, match=r"rope_cs must cover every cache position"):
        mla_attention(q, kv, seqlens, 0.1, rope_cs=rope_table(4, device="cuda"))
    # out must be 16-byte aligned (rows are written whole); nothing is written on refusal
    bs, s_q, h_q = q.shape[:3]
    buf = torch.full((bs * s_q * h_q * 512 + 1,), 7.0, device="cuda", dtype=q.dtype)
    lse = torch.empty(bs, h_q, s_q, device="cuda")
    with pytest.raises(ValueError, match=r"out must be 16-byte aligned"):
        mla_attention(q, kv, seqlens, 0.1, out=buf[1:].view(bs, s_q, h_q, 512), lse=lse)
    assert bool((buf == 7.0).all())


@pytest.mark.parametrize("bs,n,dv,h_q", [(3, 5, 512, 16), (1, 45, 512, 16), (2, 70, 64, 16), (2, 9, 128, 16),
                                        (1, 33, 256, 16), (40, 45, 512, 64), (40, 9, 256, 64)])
def test_combine_op(bs, n, dv, h_q):
    # n past a warp's width and not a whole number of the kernel's unrolled steps; every value width; at
    # bs 40, h_q 64 rows enough for a warp per whole row (NVIDIA GPUs of up to 640 SMs)
    g = torch.Generator(device="cuda").manual_seed(4 + n)
    s_q = 2
    o_part = torch.randn(bs, n, s_q, h_q, dv, device="cuda", generator=g)
    lse_part = torch.randn(bs, n, s_q, h_q, device="cuda", generator=g) * 3
    for i in {2, n - 1}:  # empty splits: their partials (NaN here) must be ignored
        lse_part[0, i] = float("-inf")
        o_part[0, i] = float("nan")
    out, lse = mla_combine(o_part, lse_part)
    lp = lse_part.double()
    ref_lse = torch.logsumexp(lp, dim=1)                      # [bs, s_q, h_q]
    w = torch.exp(lp - ref_lse[:, None])
    ref_o = (w[..., None] * torch.nan_to_num(o_part.double())).sum(1)
    assert rel_err(out, ref_o) < 5e-3
    assert (lse.double() - ref_lse.permute(0, 2, 1)).abs().max().item() < 1e-4
    assert lse.shape == (bs, h_q, s_q) and out.shape == (bs, s_q, h_q, dv)


@pytest.mark.parametrize("h_q,bs", [(32, 160), (64, 24)])
def test_combine_whole_rows(h_q, bs):
    """Batches with query rows enough that on an H200 (132 SMs) the
    attention's combine takes a whole row per warp (a warp per (row, chunk)
    would pass a wave of SMs x 32 warps; at h_q 32, bs 160 the rows pass it
    too: warps that each take a run of rows; elsewhere the other forms, the
    same results), lengths that split into several parts, empty and one-key
    sequences, NaN tails."""
    rng = random.Random(bs + h_q)
    lens = [0, 1, 4096, 3000] + [rng.randrange(1, 4097) for _ in range(bs - 4)]
    q, kv, seqlens = make_case(lens, h_q=h_q, max_seq=4096, seed=bs)
    plan = torch.ops.mla_decode.plan(seqlens, 1, h_q, kv.shape[1])
    assert int(plan.cpu()[2::2][:bs].max()) > 1, "no sequence was split: the combine is not exercised"
    out, lse = poisoned_out(q)
    mla_attention(q, kv, seqlens, 0.07, out=out, lse=lse, plan=plan)
    ro, rl = attention_reference(q, kv, seqlens, 0.07)
    check(out, lse, ro, rl, f"whole-row combine h_q={h_q} bs={bs}")


def test_combine_refuses_a_misaligned_partial():
    buf = torch.zeros(1 * 2 * 1 * 8 * DV + 1, device="cuda")
    lse_part = torch.zeros(1, 2, 1, 8, device="cuda")
    with pytest.raises(ValueError, match=r"o_part must start on a 16-byte boundary"):
        mla_combine(buf[1:].view(1, 2, 1, 8, DV), lse_part)


def test_combine_all_empty_gives_zero_not_nan():
    o_part = torch.zeros(1, 2, 1, 8, DV, device="cuda")
    lse_part = torch.full((1, 2, 1, 8), float("-inf"), device="cuda")
    out, lse = mla_combine(o_part, lse_part)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_attention_under_torch_compile():
    q, kv, seqlens = make_case([300, 77], seed=21)

    @torch.compile(fullgraph=True)
    def f(q, kv, seqlens):
        out, lse = torch.ops.mla_decode.attention(q, kv, seqlens, None, None, 0.1, False)
        return out.float() * 2, lse

    out2, lse = f(q, kv, seqlens)
    ro, rl = attention_reference(q, kv, seqlens, 0.1)
    check((out2 / 2).to(torch.bfloat16), lse, ro, rl, "torch.compile")


def test_attention_graph_capture_replays_new_lengths():
    q, kv, seqlens = make_case([500, 40], max_seq=600, seed=22)
    out, lse = poisoned_out(q)
    mla_attention(q, kv, seqlens, 0.1, out=out, lse=lse)  # warm-up outside the graph
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mla_attention(q, kv, seqlens, 0.1, out=out, lse=lse)
    g_rand = torch.Generator(device="cuda").manual_seed(23)
    for lens in ([500, 40], [37, 599], [1, 2]):
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        kv.copy_(torch.randn(kv.shape, device="cuda", generator=g_rand).to(torch.bfloat16))  # in place: same address
        for b, L in enumerate(lens):
            kv[b, L:] = float("nan")
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ro, rl = attention_reference(q, kv, seqlens, 0.1)
        check(out, lse, ro, rl, f"graph replay with lengths {lens}")


@pytest.mark.parametrize("lens", [[1, 64, 65, 777], [4097] * 3, [0, 300, 2049], [513, 129, 1, 8193]])
def test_separate_rotated_rope_keys_give_the_on_the_fly_bits(lens):
    """kpe (the decoder's rotated copy of the keys' rope columns, a separate
    buffer with its own strides) must give exactly what rotating on the fly
    gives; the cache's own rope columns are then never read (NaN there)."""
    max_seq = max(lens) + 5
    q, kv, seqlens = make_case(lens, max_seq=max_seq, seed=sum(lens))
    cs = rope_table(max_seq, device="cuda")
    out_a, lse_a = poisoned_out(q)
    mla_attention(q, kv, seqlens, 0.07, rope_cs=cs, out=out_a, lse=lse_a)
    half = 32
    cos2 = torch.cat([cs[:, :half], cs[:, :half]], dim=-1)
    sin2 = torch.cat([cs[:, half:], cs[:, half:]], dim=-1)
    from mla_decode.reference import rope_rotate

    kpe_wide = torch.full((len(lens), max_seq + 3, 64 + 16), float("nan"), dtype=torch.bfloat16, device="cuda")
    kpe = kpe_wide[:, :, 16:]  # strides of a wider buffer
    kpe[:, :max_seq] = rope_rotate(kv[:, :, 512:], cos2[:max_seq], sin2[:max_seq])
    kv_no_rope = kv.clone()
    kv_no_rope[:, :, 512:] = float("nan")
    out_b, lse_b = poisoned_out(q)
    mla_attention(q, kv_no_rope, seqlens, 0.07, kpe=kpe, out=out_b, lse=lse_b)
    assert torch.equal(out_a.view(torch.int16), out_b.view(torch.int16))
    assert torch.equal(lse_a, lse_b)


@pytest.mark.parametrize("with_kpe", [False, True])
def test_dense_partial_key_halves(with_kpe):
    """A contiguous cache whose lengths end inside a 64-key half: the Hopper
    kernel loads such a half whole by TMA (rows past the cache's end arrive
    as zeros, the others hold the cache's NaN) and zeroes the rows past the
    length before P V; with kpe the rope rows come from their own buffer,
    NaN past each length too. Right against the reference, the same for a
    copy at another address."""
    lens = [1, 2, 63, 64, 65, 100, 129, 200, 513, 520, 777, 1000, 2050, 0]
    max_seq = 2100
    q, kv, seqlens = make_case(lens, max_seq=max_seq, seed=11 + with_kpe)
    kpe = None
    if with_kpe:  # a separate buffer with rows past the cache's, NaN past each length too
        kpe = torch.full((len(lens), max_seq + 9, 64), float("nan"), dtype=torch.bfloat16, device="cuda")
        kpe[:, :max_seq] = kv[:, :, 512:]
    kv2, kpe2 = kv.clone(), (kpe.clone() if with_kpe else None)
    out_a, lse_a = poisoned_out(q)
    mla_attention(q, kv, seqlens, 0.07, kpe=kpe, out=out_a, lse=lse_a)
    out_b, lse_b = poisoned_out(q)
    mla_attention(q, kv2, seqlens, 0.07, kpe=kpe2, out=out_b, lse=lse_b)
    assert torch.equal(out_a.view(torch.int16), out_b.view(torch.int16))
    assert torch.equal(lse_a.view(torch.int32), lse_b.view(torch.int32))
    ro, rl = attention_reference(q, kv, seqlens, 0.07)
    check(out_a, lse_a, ro, rl, f"dense partial halves, kpe={with_kpe}")


def test_kpe_checks():
    q, kv, seqlens = make_case([10, 20], max_seq=32, seed=1)
    kpe = torch.zeros(2, 32, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="kpe must have a row for every cache position"):
        mla_attention(q, kv, seqlens, 0.1, kpe=kpe[:, :16])
    with pytest.raises(ValueError, match=r"kpe must have shape \[bs, >= max_seq_len, 64\]"):
        mla_attention(q, kv, seqlens, 0.1, kpe=kpe[:1])
    with pytest.raises(TypeError, match="kpe"):
        mla_attention(q, kv, seqlens, 0.1, kpe=kpe.float())


@pytest.mark.parametrize("heads", [(0, 0, 0, 0), (0, 37, 101, 6)])
def test_row_max_jumps_late(heads):
    """Both kernels move a row's softmax reference lazily (only when a tile's
    max exceeds it by more than 8 log2 units; the portable one skips the
    exchange of row maxima when a warp vote says no row moves): keys late in
    a sequence whose scores jump far above the earlier ones for one head
    each (by about 29 log2 units), at positions in different tiles, halves
    and splits: one head throughout (its third jump only about 3 above its
    second: kept under the old reference, P up to 2^3), or a different head
    (row, warp, block) at each jump; against float64."""
    lens = [1500, 777, 4100]
    q, kv, seqlens = make_case(lens, max_seq=4103, seed=13)
    for b, L in enumerate(lens):
        for h, (pos, alpha) in zip(heads, [(L // 5, 0.5), (L // 2, 1.0), (L // 2 + 70, 1.05), (L - 2, 1.5)]):
            kv[b, pos] = (alpha * q[b, 0, h].float()).to(torch.bfloat16)
    out, lse = poisoned_out(q)
    mla_attention(q, kv, seqlens, 0.07, out=out, lse=lse)
    ro, rl = attention_reference(q, kv, seqlens, 0.07)
    check(out, lse, ro, rl, f"late row-max jumps, heads {heads}")


@pytest.mark.parametrize("lens", [[1, 65, 777], [4097, 2049], [0, 64, 513]])
def test_attention_fp16(lens):
    """fp16 q and cache (out in fp16), against float64; the rotated-key
    buffer in fp16 too; RoPE on the fly is bf16 only and says so."""
    q, kv, seqlens = make_case(lens, max_seq=max(lens) + 3, seed=len(lens) + sum(lens))
    q, kv = q.half(), kv.half()
    out = torch.full((len(lens), 1, 128, 512), float("nan"), dtype=torch.float16, device="cuda")
    lse = torch.full((len(lens), 128, 1), float("nan"), device="cuda")
    mla_attention(q, kv, seqlens, 0.07, out=out, lse=lse)
    ro, rl = attention_reference(q, kv, seqlens, 0.07)
    check(out, lse, ro, rl, f"fp16 lens={lens}")
    out2, lse2 = mla_attention(q, kv, seqlens, 0.07, kpe=kv[:, :, 512:])
    assert out2.dtype == torch.float16
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    with pytest.raises(TypeError, match="bf16 only"):
        mla_attention(q, kv, seqlens, 0.07, rope_cs=rope_table(kv.shape[1], device="cuda"))
    with pytest.raises(TypeError, match="kv \\(the same dtype as q, or the fp8 cache format\\)"):
        mla_attention(q, kv.bfloat16(), seqlens, 0.07)


def test_no_split_plan_and_call():
    """split=False: every sequence one part and no combine launch. Where the
    planner cannot split (a batch of one length at least its target parts,
    as the decode step uses it) the output is the default call's bit for
    bit; where it would split, still correct (one part per sequence); a plan
    of the other kind raises (the two differ in size)."""
    from mla_decode import splits_possible

    info = mla_decode._ext.attention_info(0)
    bs = max(1, info.sms * info.blocks_per_sm // -(-128 // info.rows_per_block))  # the smallest batch the planner cannot split
    assert not splits_possible(bs, 1, 128, torch.device("cuda")) and splits_possible(bs - 1, 1, 128, torch.device("cuda"))
    q, kv, seqlens = make_case([700] * bs, max_seq=704, seed=91)
    cs = rope_table(kv.shape[1], device="cuda")
    out_a, lse_a = poisoned_out(q)
    mla_attention(q, kv, seqlens, 0.07, rope_cs=cs, out=out_a, lse=lse_a)
    out_b, lse_b = poisoned_out(q)
    mla_attention(q, kv, seqlens, 0.07, rope_cs=cs, out=out_b, lse=lse_b, split=False)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    plan = torch.ops.mla_decode.plan(seqlens, 1, 128, kv.shape[1], False)
    out_c, lse_c = poisoned_out(q)
    mla_attention(q, kv, seqlens, 0.07, rope_cs=cs, out=out_c, lse=lse_c, plan=plan, split=False)
    assert torch.equal(out_a, out_c) and torch.equal(lse_a, lse_c)
    with pytest.raises(ValueError, match="split"):
        mla_attention(q, kv, seqlens, 0.07, rope_cs=cs, plan=plan)  # a no-split plan where splits are allowed
    with pytest.raises(ValueError, match="split"):
        mla_attention(q, kv, seqlens, 0.07, rope_cs=cs, split=False,
                      plan=torch.ops.mla_decode.plan(seqlens, 1, 128, kv.shape[1]))
    # a batch the planner would split: one part per sequence, still exact
    lens = [3000, 17, 4097]
    q, kv, seqlens = make_case(lens, max_seq=4100, seed=92)
    assert splits_possible(len(lens), 1, 128, torch.device("cuda"))
    out, lse = poisoned_out(q)
    mla_attention(q, kv, seqlens, 0.07, out=out, lse=lse, split=False)
    ro, rl = attention_reference(q, kv, seqlens, 0.07)
    check(out, lse, ro, rl, "split=False on a batch the planner splits")
