"""The FlashMLA-compatible serving API (mla_decode.serving) on the GPU, in the
manner of FlashMLA's own test: variable lengths (mean 4096, spread 2048),
paged cache in a random block order, NaN in every unused block, every tail
and every unused block-table slot (invalid ids), out and lse against an fp32
evaluation; bf16 and fp16."""

import random
import warnings

import pytest
import torch

import mla_decode
from mla_decode import attention_reference, flash_mla_with_kvcache, get_mla_metadata, serving

from conftest import needs_gpu
from test_gpu_attention import check, make_paged

pytestmark = [needs_gpu, pytest.mark.gpu]


def varlen(b, mean, s_q, seed):
    rnd = random.Random(seed)
    return [max(int(rnd.normalvariate(mean, mean / 2)), s_q) for _ in range(b)]


def run_case(lens, block_size, h_q, s_q, causal, seed, dtype=torch.bfloat16):
    q, pages, table, seqlens = make_paged(lens, block_size, h_q=h_q, s_q=s_q, seed=seed)
    q, pages = q.to(dtype), pages.to(dtype)
    k_cache = pages.unsqueeze(2)  # [num_blocks, block_size, 1, 576], FlashMLA's layout
    meta, splits = get_mla_metadata(seqlens, s_q * h_q, 1)
    out, lse = flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, splits, causal=causal)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ro, rl = attention_reference(q, pages, seqlens, 576 ** -0.5, block_table=table, causal=causal,
                                 dtype=torch.float32)
    check(out, lse, ro.double(), rl.double(), f"b={len(lens)} block={block_size} h_q={h_q} s_q={s_q} {dtype}")
    return out, lse, splits


@pytest.mark.parametrize("block_size,h_q,s_q", [
    (64, 128, 1), (64, 128, 2), (16, 128, 1), (1, 128, 1), (32, 64, 2), (128, 16, 1), (64, 32, 4), (16, 24, 3),
    (8, 128, 1), (256, 64, 1),
])
def test_serving_varlen(block_size, h_q, s_q):
    lens = varlen(16, 4096, s_q, seed=block_size * 7 + h_q + s_q)
    run_case(lens, block_size, h_q, s_q, causal=s_q > 1, seed=block_size + h_q)


@pytest.mark.parametrize("block_size,h_q,s_q", [(64, 128, 1), (1, 128, 1), (16, 64, 2), (32, 16, 4)])
def test_serving_varlen_fp16(block_size, h_q, s_q):
    lens = varlen(16, 4096, s_q, seed=block_size * 5 + h_q + s_q)
    run_case(lens, block_size, h_q, s_q, causal=s_q > 1, seed=block_size + h_q + 1, dtype=torch.float16)


@pytest.mark.parametrize("block_size", [64, 16, 128])
def test_serving_partial_key_halves_at_every_boundary(block_size):
    """Lengths on each side of the 64-key half and 128-key pair boundaries
    (a sequence's last half partial, full, or a lone key), the rows past
    every length NaN: the Hopper kernel loads a partial half whole by TMA and
    zeroes its rows past the length before P V, so any row it missed shows."""
    lens = [1, 2, 63, 64, 65, 66, 127, 128, 129, 130, 191, 192, 193, 255, 256, 257, 320, 383]
    for h_q in (128, 64):
        run_case(lens, block_size, h_q, 1, causal=False, seed=block_size + h_q)


@pytest.mark.parametrize("dynamic", [False, True])
def test_serving_api_under_torch_compile_fullgraph(dynamic):
    """get_mla_metadata and flash_mla_with_kvcache compiled as one graph (FlashMLA's calling code under
    torch.compile), with no dynamo setting: on a GPU the plan's fake knows its length (the batch symbolic
    with dynamic=True), so nothing in the trace is data-dependent."""
    lens = [300, 77, 1, 128, 0, 641]
    q, pages, table, seqlens = make_paged(lens, 64, seed=5)
    k_cache = pages.unsqueeze(2)

    def step(q, k_cache, table, seqlens):
        meta, splits = get_mla_metadata(seqlens, q.shape[1] * q.shape[2], 1)
        return flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, splits)

    torch._dynamo.reset()
    out, lse = torch.compile(step, fullgraph=True, dynamic=dynamic)(q, k_cache, table, seqlens)
    ro, rl = attention_reference(q, pages, seqlens, 576 ** -0.5, block_table=table, dtype=torch.float32)
    check(out, lse, ro.double(), rl.double(), "torch.compile(fullgraph=True)")


def test_plan_fake_has_the_plans_length():
    """The plan op's fake (what a trace sees) gives the length the op makes, for batches below and above
    the target parts, split or not, and head counts that change the head blocks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mla_decode.attention import plan_elems

    for bs in (1, 7, 66, 131, 1000):
        for s_q, h_q in ((1, 128), (1, 16), (2, 64), (4, 32)):
            for split in (True, False):
                seqlens = torch.full((bs,), 300, dtype=torch.int32, device="cuda")
                real = torch.ops.mla_decode.plan(seqlens, s_q, h_q, 4096, split)
                assert real.numel() == plan_elems(bs, s_q, h_q, split, seqlens.device), (bs, s_q, h_q, split)
                with FakeTensorMode() as mode:
                    fake = torch.ops.mla_decode.plan(mode.from_tensor(seqlens), s_q, h_q, 4096, split)
                assert fake.shape == real.shape, (bs, s_q, h_q, split)


def test_serving_flashmla_batch():
    # FlashMLA's published setting: b=128, h_q=128, s_q=1, block 64, mean 4096
    lens = varlen(128, 4096, 1, seed=1)
    out, lse, splits = run_case(lens, 64, 128, 1, causal=False, seed=2)
    assert splits.shape == (129,) and splits[0].item() == 0
    assert bool((splits[1:] >= splits[:-1] + 1).all()), "every sequence has at least one split"


def test_serving_empty_sequence_gives_zero_and_neg_inf():
    lens = [0, 300, 0, 1]
    out, lse, _ = run_case(lens, 16, 64, 2, causal=True, seed=5)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isneginf(lse[2]).all()


def test_serving_lengths_outside_the_table_are_held_to_it():
    # a negative length reads as 0 (out 0, lse -inf); one past the table's rows reads as that many rows:
    # nothing outside the sequence's block-table row is read; check_block_table=True refuses both
    q, pages, table, seqlens = make_paged([320, 128], 64, h_q=16, seed=11)  # sequence 0 fills its 5 slots
    k_cache = pages.unsqueeze(2)
    meta, splits = get_mla_metadata(seqlens, 16, 1)
    held, held_lse = flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, splits)
    odd = torch.tensor([10 ** 6, -5], dtype=torch.int32, device="cuda")
    out, lse = flash_mla_with_kvcache(q, k_cache, table, odd, 512, meta, splits)
    assert torch.equal(out[0], held[0]) and torch.equal(lse[0], held_lse[0])
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[1]).all()
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 1000000 is outside \[0, 320\]"):
        flash_mla_with_kvcache(q, k_cache, table, odd, 512, meta, splits, check_block_table=True)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = -5 is outside \[0, 320\]"):
        flash_mla_with_kvcache(q, k_cache, table, odd[[0, 1]].clamp(max=320), 512, meta, splits,
                               check_block_table=True)


def test_serving_graph_capture_replays_new_lengths_and_tables():
    torch.manual_seed(0)
    block_size, h_q, s_q, b = 16, 64, 2, 4
    lens0 = [700, 33, 1000, 1]
    q, pages, table, seqlens = make_paged(lens0, block_size, h_q=h_q, s_q=s_q, seed=11)
    # room for the later cases: a table wide enough for 1200 rows, pages for all
    extra = 1200 // block_size + 1
    table = torch.cat([table, torch.full((b, extra), 2 ** 30, dtype=torch.int32, device="cuda")], 1)
    pages = torch.cat([pages, torch.full((b * extra, block_size, 576), float("nan"), dtype=pages.dtype,
                                         device="cuda")])
    k_cache = pages.unsqueeze(2)
    meta, splits = get_mla_metadata(seqlens, s_q * h_q, 1)  # outside the graph
    flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, splits, causal=True)  # warm-up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, splits, causal=True)
    gen = torch.Generator(device="cuda").manual_seed(12)
    for lens in ([700, 33, 1000, 1], [1200, 0, 5, 640], [3, 1199, 64, 65]):
        # new lengths, a fresh random block assignment, new data: all in place
        pages.fill_(float("nan"))
        table.fill_(2 ** 30)
        ids = torch.randperm(pages.shape[0], device="cuda", generator=gen).to(torch.int32)
        nxt = 0
        for i, L in enumerate(lens):
            for j in range((L + block_size - 1) // block_size):
                table[i, j] = ids[nxt]
                n = min(block_size, L - j * block_size)
                pages[ids[nxt], :n] = torch.randn(n, 576, device="cuda", generator=gen).to(pages.dtype)
                nxt += 1
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ro, rl = attention_reference(q, pages, seqlens, 576 ** -0.5, block_table=table, causal=True,
                                     dtype=torch.float32)
        check(out, lse, ro.double(), rl.double(), f"graph replay, lengths {lens}")


def test_serving_graph_of_several_layers_replayed_many_times():
    """Several calls on one metadata captured in one graph (a decode step's
    layers), replayed again and again on new data: each captured call's work
    counter must start every replay at zero (every item taken once), also
    after many replays, whatever the kernel keeps between them."""
    torch.manual_seed(1)
    lens = [900, 65, 1, 2049, 300]
    layers = 3
    cases = [make_paged(lens, 64, h_q=128, s_q=1, seed=40 + i) for i in range(layers)]
    seqlens = cases[0][3]
    meta, splits = get_mla_metadata(seqlens, 128, 1)  # outside the graph
    outs = [None] * layers
    for i, (q, pages, table, _) in enumerate(cases):  # warm-up
        flash_mla_with_kvcache(q, pages.unsqueeze(2), table, seqlens, 512, meta, splits)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i, (q, pages, table, _) in enumerate(cases):
            outs[i] = flash_mla_with_kvcache(q, pages.unsqueeze(2), table, seqlens, 512, meta, splits)
    gen = torch.Generator(device="cuda").manual_seed(41)
    for rep in range(6):
        for q, _, _, _ in cases:
            q.copy_(torch.randn(q.shape, device="cuda", generator=gen).to(q.dtype))
        for out, lse in outs:
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        for i, (q, pages, table, _) in enumerate(cases):
            ro, rl = attention_reference(q, pages, seqlens, 576 ** -0.5, block_table=table, dtype=torch.float32)
            check(outs[i][0], outs[i][1], ro.double(), rl.double(), f"replay {rep}, layer {i}")


def test_serving_metadata_of_other_lengths_and_shared_by_streams():
    """The call uses get_mla_metadata's plan (no planner launch) but reads
    the lengths as they are now: metadata made for other lengths (longer,
    shorter, empty, split differently) still gives the right answer, and one
    plan serves calls on two streams at once (each call its own work counter)."""
    h_q, block_size = 128, 64
    lens_now = varlen(16, 4096, 1, seed=21)
    q, pages, table, seqlens = make_paged(lens_now, block_size, h_q=h_q, seed=22)
    k_cache = pages.unsqueeze(2)
    ro, rl = attention_reference(q, pages, seqlens, 576 ** -0.5, block_table=table, dtype=torch.float32)
    rnd = random.Random(23)
    for what, lens_then in [("the same", lens_now), ("all longer", [L + 3000 for L in lens_now]),
                            ("all shorter", [L // 5 for L in lens_now]), ("empty", [0] * 16),
                            ("shuffled", rnd.sample(lens_now, 16))]:
        meta, splits = get_mla_metadata(torch.tensor(lens_then, dtype=torch.int32, device="cuda"), h_q, 1)
        out, lse = flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, splits)
        check(out, lse, ro.double(), rl.double(), f"metadata of {what} lengths")
    # one plan, two streams at once (and the default stream after them)
    meta, splits = get_mla_metadata(seqlens, h_q, 1)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    outs = []
    for _ in range(3):
        for st in streams:
            with torch.cuda.stream(st):
                outs.append(flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, splits))
    torch.cuda.synchronize()
    outs.append(flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, splits))
    for i, (out, lse) in enumerate(outs):
        check(out, lse, ro.double(), rl.double(), f"call {i} sharing one plan across streams")


def test_serving_metadata_of_other_sizes_warns_once():
    """Metadata made for another head count than the call's gives the right
    answer by planning inside the call, and says so once (a slower path);
    metadata of the call's sizes says nothing."""
    h_q = 128
    q, pages, table, seqlens = make_paged([300, 700, 1500], 64, h_q=h_q, seed=31)
    k_cache = pages.unsqueeze(2)
    ro, rl = attention_reference(q, pages, seqlens, 576 ** -0.5, block_table=table, dtype=torch.float32)
    meta, splits = get_mla_metadata(seqlens, h_q, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, splits)
    check(out, lse, ro.double(), rl.double(), "metadata of the call's sizes")
    other, other_splits = get_mla_metadata(seqlens, 16, 1)  # made for 16 heads
    assert other.shape != meta.shape, "the test needs metadata of another size"
    with serving._warned_lock:  # (the warning is once per process and sizes: an earlier test may have had it)
        serving._warned_sizes.discard((q.device, q.shape[0], q.shape[1], q.shape[2]))
    with pytest.warns(RuntimeWarning, match="made for other sizes"):
        out, lse = flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, other, other_splits)
    check(out, lse, ro.double(), rl.double(), "metadata made for 16 heads")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (once per batch and head count)
        out, lse = flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, other, other_splits)
    check(out, lse, ro.double(), rl.double(), "metadata made for 16 heads, again")


def test_serving_bad_inputs():
    q, pages, table, seqlens = make_paged([10, 20], 16, h_q=16, seed=3)
    k_cache = pages.unsqueeze(2)
    meta, splits = get_mla_metadata(seqlens, 16, 1)
    with pytest.raises(TypeError, match="must both be bfloat16 or both float16"):
        flash_mla_with_kvcache(q.half(), k_cache, table, seqlens, 512, meta, splits)
    with pytest.raises(TypeError, match="must both be bfloat16 or both float16"):
        flash_mla_with_kvcache(q.float(), k_cache.float(), table, seqlens, 512, meta, splits)
    with pytest.raises(ValueError, match=r"unsupported attention shape: head dim d=576 with head_dim_v=256"):
        flash_mla_with_kvcache(q, k_cache, table, seqlens, 256, meta, splits)
    with pytest.raises(ValueError, match="num_heads_k must be 1"):
        get_mla_metadata(seqlens, 16, 2)
    with pytest.raises(ValueError, match="num_splits must be int32"):
        flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, splits[:-1])
    with pytest.raises(TypeError, match="cache_seqlens must be an int32 tensor"):
        get_mla_metadata(seqlens.long(), 16, 1)
    with pytest.raises(ValueError, match="one KV head"):
        flash_mla_with_kvcache(q, k_cache.expand(-1, -1, 2, -1), table, seqlens, 512, meta, splits)


def test_serving_is_exported():
    assert mla_decode.flash_mla_with_kvcache is flash_mla_with_kvcache
    assert mla_decode.get_mla_metadata is get_mla_metadata
