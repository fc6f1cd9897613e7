"""custom_kernel on the GPU at the task shapes against the literal reference."""

import pytest
import torch

import mla_decode
from mla_decode.reference import decode_step_float64, generate_input, ref_kernel

from conftest import assert_drift, assert_task_rule, needs_gpu

pytestmark = [needs_gpu, pytest.mark.gpu]


@pytest.mark.parametrize("prefill", [128, 512, 1024, 2048])
def test_task_shapes(prefill):
    config, x, kv = generate_input(batch_size=128, prefill=prefill, seed=prefill, device="cuda")
    kv_ref = kv.clone()
    dec = mla_decode.MLADecoder(backend="kernels")
    y, data = dec(config, x, kv)
    y_ref, data_ref = ref_kernel((config, x, kv_ref), batch_chunk=8)
    assert dec.last_backend == "kernels"
    assert data is kv.data and kv.seq_len == prefill + 1
    assert_task_rule(y, y_ref, "y")
    assert_task_rule(data, data_ref, "cache")
    y64 = decode_step_float64(config, x, data_ref, kv_ref.seq_len)
    assert_drift(y, y_ref, y64)


def test_decode_loop_gpu():
    config, x, kv = generate_input(batch_size=8, prefill=300, seed=11, device="cuda")
    kv_ref = kv.clone()
    g = torch.Generator(device="cuda").manual_seed(2)
    for step in range(6):
        x = torch.randn(x.shape, generator=g, device="cuda").to(torch.bfloat16)
        y, _ = mla_decode.custom_kernel((config, x, kv))
        y_ref, _ = ref_kernel((config, x, kv_ref))
        assert_task_rule(y, y_ref, f"y at step {step}")
        assert_task_rule(kv.data, kv_ref.data, f"cache at step {step}")


def test_kernels_and_fallback_agree():
    config, x, kv = generate_input(batch_size=4, prefill=777, seed=5, device="cuda")
    kv2 = kv.clone()
    yk, _ = mla_decode.MLADecoder(backend="kernels")(config, x, kv)
    yt, _ = mla_decode.MLADecoder(backend="torch")(config, x, kv2)
    assert_task_rule(yk, yt, "kernels vs fallback")
    assert torch.equal(kv.data, kv2.data)


def test_full_cache_gpu_untouched():
    config, x, kv = generate_input(batch_size=2, prefill=64, max_seq_len=64, seed=1, device="cuda")
    before = kv.data.clone()
    with pytest.raises(mla_decode.MLAInputError, match="full"):
        mla_decode.custom_kernel((config, x, kv))
    assert torch.equal(kv.data, before) and kv.seq_len == 64


def test_backend_names_the_gpu():
    assert "kernels" in mla_decode.backend("cuda")


def test_captured_step_matches_eager_bitwise():
    """From the second call on one cache the step replays a captured graph;
    it must give exactly the eager step's y and cache across positions (the
    graph advances the length itself; a rewound length is written again), a
    new x every call, an in-place weight change (version counter) and a
    weight swapped through ``.data`` (new address, same version) and a write
    to the cache's rope columns (the rotated copy is rebuilt), and a returned
    y must not change under later calls."""
    config, x, kv = generate_input(batch_size=16, prefill=200, seed=21, device="cuda")
    kv_e = kv.clone()
    dg = mla_decode.MLADecoder(backend="kernels")
    de = mla_decode.MLADecoder(backend="kernels", graphs=False)
    g = torch.Generator(device="cuda").manual_seed(3)
    graphed, kept = [], []
    for step in range(32):
        x = torch.randn(x.shape, generator=g, device="cuda").to(torch.bfloat16)
        if step == 10:  # rewind both caches by three rows
            kv.seq_len -= 3
            kv_e.seq_len -= 3
        if step == 20:
            config.wo_weight.mul_(0.5)
        if step == 26:
            config.Q_proj_up_weight.data = config.Q_proj_up_weight.data * 0.5
        if step == 14:  # a write through PyTorch: the decoders' rotated keys must be rebuilt
            for c in (kv, kv_e):
                c.data[:, : c.seq_len, -64:] *= -1
            kv_fresh = kv.clone()
        yg, _ = dg(config, x, kv)
        graphed.append(dg.last_graphed)
        if step == 14:
            y_fresh, _ = mla_decode.MLADecoder(backend="kernels", graphs=False)(config, x, kv_fresh)
            assert torch.equal(yg, y_fresh), "stale rotated keys after a write to the cache"
        ye, _ = de(config, x, kv_e)
        assert not de.last_graphed
        assert torch.equal(yg, ye), f"step {step}: graphed y differs from eager"
        assert torch.equal(kv.data, kv_e.data), f"step {step}: caches differ"
        kept.append((yg, yg.clone()))
    assert kv.seq_len == kv_e.seq_len == 229
    # an in-place change keeps the addresses (the graph reads the new values); a weight at a new
    # address is a new key: eager once, then captured again
    assert graphed[0] is False and all(graphed[1:26]) and graphed[26] is False and all(graphed[27:]), graphed
    for i, (y, y_copy) in enumerate(kept):
        assert torch.equal(y, y_copy), f"y of step {i} changed under later calls"


def test_captures_are_bounded_across_caches():
    config, x, _ = generate_input(batch_size=2, prefill=0, max_seq_len=16, seed=8, device="cuda")
    dec = mla_decode.MLADecoder(backend="kernels")
    caches = [generate_input(batch_size=2, prefill=3, max_seq_len=16, seed=9 + i, device="cuda")[2] for i in range(7)]
    for kv in caches:
        for _ in range(3):
            y, _ = dec(config, x, kv)
        assert dec.last_graphed
    assert len(dec._caches) <= 4


def test_no_device_memory_growth_over_1000_calls():
    config, x, kv = generate_input(batch_size=4, prefill=0, max_seq_len=1024 + 16, seed=12, device="cuda")
    dec = mla_decode.MLADecoder(backend="kernels")
    for _ in range(10):
        y, _ = dec(config, x, kv)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(1000):
        y, _ = dec(config, x, kv)
    torch.cuda.synchronize()
    assert dec.last_graphed and kv.seq_len == 1010
    assert torch.cuda.memory_allocated() == before


def test_new_weight_objects_every_call_as_the_ranked_harness_passes_them():
    """The task's ranked mode passes new weight objects on every call: each
    call must read the weights it is given (here: clones, some with new
    values), graphed or not."""
    import dataclasses

    config, x, kv = generate_input(batch_size=8, prefill=100, seed=31, device="cuda")
    kv_e = kv.clone()
    dg = mla_decode.MLADecoder(backend="kernels")
    de = mla_decode.MLADecoder(backend="kernels", graphs=False)
    names = ("Q_proj_down_weight", "KV_proj_down_weight", "Q_proj_up_weight", "KV_proj_up_weight", "wo_weight")
    for step in range(12):
        scale = 1.0 if step % 4 else 0.5  # every fourth call new values too
        cfg = dataclasses.replace(config, **{n: getattr(config, n).clone() * scale for n in names})
        yg, _ = dg(cfg, x, kv)
        ye, _ = de(cfg, x, kv_e)
        assert torch.equal(yg, ye), f"step {step}"
        del cfg
    assert torch.equal(kv.data, kv_e.data)


def test_repeated_call_rechecks_every_input():
    """After graphed calls with the same objects (the decoder then replays
    the last step after comparing the inputs with the last call's), every
    bad input must still raise before anything is written, and a good call
    afterwards must still match the eager step."""
    config, x, kv = generate_input(batch_size=4, prefill=30, max_seq_len=40, seed=41, device="cuda")
    kv_e = kv.clone()
    dg = mla_decode.MLADecoder(backend="kernels")
    de = mla_decode.MLADecoder(backend="kernels", graphs=False)
    for _ in range(3):
        yg, _ = dg(config, x, kv)
        ye, _ = de(config, x, kv_e)
    assert dg.last_graphed and torch.equal(yg, ye)
    before, L = kv.data.clone(), kv.seq_len
    w = config.Q_proj_up_weight
    bad = [
        (lambda: dg(config, x[:, :, :-8].contiguous(), kv), mla_decode.MLAInputError, "x must have shape"),
        (lambda: dg(config, x[:2], kv), mla_decode.MLAInputError, r"kv_cache.data must have shape \[bs=2"),
        (lambda: dg(config, x.float(), kv), TypeError, "x must be torch.bfloat16"),
        (lambda: dg(config, torch.cat([x, x], -1)[..., :x.shape[-1]], kv), mla_decode.MLAInputError,
         "x must be contiguous"),
    ]
    for fn, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            fn()
    # a weight viewed at the same address with another shape (no version bump)
    w.data = w.data.view(w.shape[0] // 2, w.shape[1] * 2)
    with pytest.raises(mla_decode.MLAInputError, match="Q_proj_up_weight must have shape"):
        dg(config, x, kv)
    w.data = w.data.view(w.shape[0] * 2, w.shape[1] // 2)
    config.n_heads //= 2
    with pytest.raises(mla_decode.MLAInputError, match="must have shape"):
        dg(config, x, kv)
    config.n_heads *= 2
    kv.seq_len = kv.data.shape[1]
    with pytest.raises(mla_decode.MLAInputError, match="full"):
        dg(config, x, kv)
    kv.seq_len = L
    assert torch.equal(kv.data, before), "a refused call wrote the cache"
    yg, _ = dg(config, x, kv)
    ye, _ = de(config, x, kv_e)
    assert dg.last_graphed and torch.equal(yg, ye) and torch.equal(kv.data, kv_e.data)
    # new weight objects over the same memory (as the ranked mode's clones often land), one
    # with new values: the replay of the last step serves them and reads the new values
    import dataclasses

    names = ("Q_proj_down_weight", "KV_proj_down_weight", "Q_proj_up_weight", "KV_proj_up_weight", "wo_weight")
    last = dg._last
    cfg2 = dataclasses.replace(config, **{n: getattr(config, n).view(getattr(config, n).shape) for n in names})
    cfg2.wo_weight.mul_(0.5)
    yg, _ = dg(cfg2, x, kv)
    ye, _ = de(cfg2, x, kv_e)
    assert dg._last is last, "new objects at the same addresses did not take the replay path"
    assert dg.last_graphed and torch.equal(yg, ye) and torch.equal(kv.data, kv_e.data)


def test_replay_follows_moved_storage_and_new_x():
    """The repeated-call fast path pins the cache's address (the captured
    step writes the new row there): a cache tensor given new storage in
    place (same object, same shape) must not be written through the old
    address, and x may sit at a new address on every call (it is copied in)."""
    config, x, kv = generate_input(batch_size=4, prefill=20, max_seq_len=40, seed=43, device="cuda")
    kv_e = kv.clone()
    dg = mla_decode.MLADecoder(backend="kernels")
    de = mla_decode.MLADecoder(backend="kernels", graphs=False)
    for _ in range(3):
        x = x.clone()  # a new address each call
        yg, _ = dg(config, x, kv)
        ye, _ = de(config, x, kv_e)
        assert torch.equal(yg, ye)
    assert dg.last_graphed
    fresh = kv.data.clone()
    kv.data.set_(fresh.untyped_storage(), fresh.storage_offset(), fresh.shape, fresh.stride())
    yg, _ = dg(config, x, kv)  # the same object, now over new storage
    ye, _ = de(config, x, kv_e)
    assert torch.equal(yg, ye) and torch.equal(kv.data, kv_e.data)
    assert kv.data.data_ptr() == fresh.data_ptr()


def test_step_reads_a_repeated_x_where_it_lies():
    """Two consecutive calls with x at one address capture the step a second
    time on that x (no copy in): it must give the eager step's y and cache
    bit for bit while x is rewritten in place between calls, and an x at
    another address must be copied in as before."""
    config, x, kv = generate_input(batch_size=16, prefill=130, seed=31, device="cuda")
    kv_e = kv.clone()
    dg = mla_decode.MLADecoder(backend="kernels")
    de = mla_decode.MLADecoder(backend="kernels", graphs=False)
    g = torch.Generator(device="cuda").manual_seed(4)
    other = torch.empty_like(x)
    for step in range(9):
        use = other if step == 6 else x
        use.copy_(torch.randn(x.shape, generator=g, device="cuda").to(torch.bfloat16))  # same address, new values
        yg, _ = dg(config, use, kv)
        ye, _ = de(config, use, kv_e)
        assert torch.equal(yg, ye), f"y at step {step}"
        assert torch.equal(kv.data, kv_e.data), f"cache at step {step}"
        if step >= 3:
            st = dg._last.step
            if st.launcher is None:
                pytest.skip("this PyTorch gives no CUDAGraph.raw_cuda_graph_exec: no C++ launcher, no direct graph")
            assert st.direct is not None and st.launcher.direct_address == x.data_ptr()
    assert dg.last_graphed


def test_captured_step_without_split_matches_eager():
    """At a batch the split planner cannot split (one length for all, bs at
    least its target parts: the task's bs 128 on an H100/H200) the step
    plans one part per sequence and launches no combine; graphed and eager
    steps must still agree bit for bit and with the reference."""
    rows_per_block, _, _, _, _, per_sm, sms, _ = mla_decode._ext.module().attention_info(0)
    bs = max(1, sms * per_sm // -(-128 // rows_per_block))
    config, x, kv = generate_input(batch_size=bs, prefill=130, max_seq_len=160, seed=51, device="cuda")
    kv_e, kv_r = kv.clone(), kv.clone()
    dg = mla_decode.MLADecoder(backend="kernels")
    de = mla_decode.MLADecoder(backend="kernels", graphs=False)
    assert dg._split(mla_decode.Dims(bs, 0, 128, 0, 0, 0, 0, 0, 0), x.device) is False
    for step in range(5):
        yg, _ = dg(config, x, kv)
        ye, _ = de(config, x, kv_e)
        assert torch.equal(yg, ye) and torch.equal(kv.data, kv_e.data), f"step {step}"
        if step == 0:
            y_ref, _ = ref_kernel((config, x, kv_r), batch_chunk=8)
            assert_task_rule(yg, y_ref, "y")
    assert dg.last_graphed


def test_decoder_call_inside_a_user_capture():
    """A call made while the user's stream is capturing (after graphed calls,
    so the fast path is armed) runs the step eagerly into the user's graph;
    replaying that graph does what the eager step does."""
    config, x, kv = generate_input(batch_size=4, prefill=20, max_seq_len=40, seed=44, device="cuda")
    kv_e = kv.clone()
    dg = mla_decode.MLADecoder(backend="kernels")
    de = mla_decode.MLADecoder(backend="kernels", graphs=False)
    for _ in range(3):
        dg(config, x, kv)
        de(config, x, kv_e)
    assert dg.last_graphed
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg, _ = dg(config, x, kv)
    assert not dg.last_graphed
    g.replay()
    ye, _ = de(config, x, kv_e)
    torch.cuda.synchronize()
    assert torch.equal(yg, ye) and torch.equal(kv.data, kv_e.data)
    # and the decoder's own graphs serve the calls after it
    for _ in range(3):
        yg, _ = dg(config, x, kv)
        ye, _ = de(config, x, kv_e)
    assert dg.last_graphed and torch.equal(yg, ye) and torch.equal(kv.data, kv_e.data)


def test_captured_step_of_a_tp_rank_matches_eager_across_a_pair_boundary():
    """A tensor-parallel rank's step (rank 0 of 2: 64 of 128 heads) captured
    and replayed gives the eager step's bits at every position, across a
    128-key boundary: the captured step plans the next step's split inside
    the graph, and the plan's shape (tiles per sequence) changes there."""
    from mla_decode.tp import shard_config

    config, x, kv = generate_input(batch_size=8, prefill=250, seed=5, device="cuda")
    cfg = shard_config(config, 0, 2)
    runs = {"graphed": (mla_decode.MLADecoder(backend="kernels"), kv),
            "eager": (mla_decode.MLADecoder(backend="kernels", graphs=False), kv.clone())}
    for step in range(10):
        y = {name: dec(cfg, x, cache)[0] for name, (dec, cache) in runs.items()}
        assert torch.equal(y["graphed"], y["eager"]), f"step {step}: y"
        assert torch.equal(kv.data, runs["eager"][1].data), f"step {step}: cache"
    assert runs["graphed"][0].last_graphed and kv.seq_len == 260
