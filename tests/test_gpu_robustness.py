"""The decode step and the attention op as inference code calls them: weights
that are nn.Parameters, torch.inference_mode, a GPU other than the current
one, several threads, caches written by other kernels, unaligned views,
bad block ids, and a long randomized soak with device memory flat."""

import dataclasses
import os
import random
import threading
import types

import pytest
import torch

import mla_decode
from mla_decode.reference import generate_input, ref_kernel

from conftest import assert_task_rule, needs_gpu

pytestmark = [needs_gpu, pytest.mark.gpu]

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
NAMES = ("Q_proj_down_weight", "KV_proj_down_weight", "Q_proj_up_weight", "KV_proj_up_weight", "wo_weight")


def _inputs(bs=8, prefill=100, seed=0, device="cuda", **kw):
    return generate_input(batch_size=bs, prefill=prefill, seed=seed, device=device, **kw)


def _checked_step(dec, config, x, kv, what):
    """One step of `dec`, y and the cache checked against the reference
    under the task rule; returns (y, the launch that ran)."""
    ref = kv.clone()
    y, data = dec(config, x, kv)
    launch = dec.last_paths["launch"]
    y_ref, data_ref = ref_kernel((config, x, ref), batch_chunk=8)
    assert_task_rule(y, y_ref, f"y at {what}")
    assert_task_rule(data, data_ref, f"cache at {what}")
    return y, launch


def _check_against_reference(config, x, kv, run):
    ref = kv.clone()
    y, data = run(config, x, kv)
    y_ref, data_ref = ref_kernel((config, x, ref), batch_chunk=8)
    assert_task_rule(y, y_ref, "y")
    assert_task_rule(data, data_ref, "cache")
    return y


def test_parameter_weights():
    config, x, kv = _inputs(seed=1)
    params = {n: torch.nn.Parameter(getattr(config, n).clone()) for n in NAMES}
    cfg = dataclasses.replace(config, **params)
    dec = mla_decode.MLADecoder(backend="kernels")
    for call in range(4):  # (the last ones replays of the captured step)
        y = _check_against_reference(cfg, x, kv, dec)
        assert not y.requires_grad, f"call {call}"
    if os.environ.get("MLA_DECODE_STEP_GRAPH") != "0":
        assert dec.last_paths["launch"] == "graph replay"
    y_t, _ = mla_decode.MLADecoder(backend="torch")(cfg, x, kv.clone())  # the fallback too
    assert not y_t.requires_grad


def test_inference_mode():
    with torch.inference_mode():
        config, x, kv = _inputs(seed=2)
        _check_against_reference(config, x, kv, mla_decode.MLADecoder(backend="kernels"))
        for call in range(3):  # (the last ones replays of the captured step)
            y = _check_against_reference(config, x, kv, lambda c, xx, k: mla_decode.custom_kernel((c, xx, k)))
            assert y.is_inference(), f"call {call}"
        if os.environ.get("MLA_DECODE_STEP_GRAPH") != "0":
            assert mla_decode.decoder._DEFAULT.last_paths["launch"] == "graph replay"
    # inference tensors made elsewhere, called outside inference mode
    config, x, kv = _inputs(seed=3)
    with torch.inference_mode():
        kv.data = kv.data.clone()
    _check_against_reference(config, x, kv, mla_decode.MLADecoder(backend="kernels"))


@two_gpus
def test_second_gpu_while_the_first_is_current():
    torch.cuda.set_device(0)
    config, x, kv = _inputs(seed=4, device="cuda:1")
    dec = mla_decode.MLADecoder(backend="kernels")
    for _ in range(3):
        y = _check_against_reference(config, x, kv, dec)
        assert y.device == torch.device("cuda:1")
    assert torch.cuda.current_device() == 0


def test_two_threads_two_decoders_and_a_busy_third():
    """Two threads decode on their own caches and streams while a third keeps
    the GPU busy with its own work; every y equals a single-threaded run."""
    inputs = [_inputs(seed=10 + i, prefill=300) for i in range(2)]
    expect = []
    for config, x, kv in inputs:
        c = kv.clone()
        d = mla_decode.MLADecoder(backend="kernels")
        expect.append([d(config, x, c)[0].clone() for _ in range(20)])
    torch.cuda.synchronize()
    errors, stop = [], threading.Event()

    def decode(i):
        try:
            config, x, kv = inputs[i]
            d = mla_decode.MLADecoder(backend="kernels")
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for k in range(20):
                    y, _ = d(config, x, kv)
                    s.synchronize()
                    if not torch.equal(y, expect[i][k]):
                        errors.append(f"thread {i} step {k}: y differs")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    def busy():
        a = torch.randn(2048, 2048, device="cuda")
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            while not stop.is_set():
                a = (a @ a).tanh_()
                s.synchronize()

    b = threading.Thread(target=busy)
    b.start()
    ts = [threading.Thread(target=decode, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    stop.set()
    b.join()
    assert not errors, errors


def test_one_decoder_shared_by_threads():
    """custom_kernel's one decoder called from several threads at once, each
    on its own cache."""
    inputs = [_inputs(bs=4, seed=20 + i, prefill=64 + 50 * i) for i in range(4)]
    copies = [kv.clone() for _, _, kv in inputs]
    errors = []

    def run(i):
        try:
            config, x, kv = inputs[i]
            with torch.cuda.stream(torch.cuda.Stream()):
                for _ in range(10):
                    mla_decode.custom_kernel((config, x, kv))
                torch.cuda.current_stream().synchronize()
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")

    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    dec = mla_decode.MLADecoder(backend="kernels")
    for (config, x, kv), c in zip(inputs, copies):
        for _ in range(10):
            dec(config, x, c)
        assert torch.equal(kv.data, c.data)


def _new_xs_and_expected(inputs, steps, seed):
    """For each (config, x, kv) of `inputs`, `steps` new x tensors (x's
    shape, drawn from `seed`), and the y of each step of a single-threaded
    decoder run on a clone of kv with them in order."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs = [[torch.randn(x.shape, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(steps)]
          for _, x, _ in inputs]
    d = mla_decode.MLADecoder(backend="kernels")
    expect = []
    for (cfg, _, kv), xi in zip(inputs, xs):
        c = kv.clone()
        expect.append([d(cfg, x, c)[0].clone() for x in xi])
    torch.cuda.synchronize()
    return xs, expect


def _decode_in_threads(inputs, xs, expect, own_streams):
    """One thread per entry of `inputs`, each with a decoder of its own
    stepping its cache with its x's (a clone of each), on the current
    stream or (own_streams) on a new stream of its own; returns the
    messages of every y that differs from `expect` and of every error."""
    errors = []

    def run(i):
        try:
            cfg, _, kv = inputs[i]
            dec = mla_decode.MLADecoder(backend="kernels")
            with torch.cuda.stream(torch.cuda.Stream() if own_streams else torch.cuda.current_stream()):
                ys = [dec(cfg, x.clone(), kv)[0] for x in xs[i]]
                torch.cuda.current_stream().synchronize()
            errors.extend(f"thread {i} step {k}: y differs" for k, y in enumerate(ys) if not torch.equal(y, expect[i][k]))
        except Exception as e:  # noqa: BLE001 - reported by the caller
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return errors


def test_threads_sharing_one_stream_with_new_inputs_every_call():
    """Threads on one stream (the default one) each decode their own cache
    with a new x every call, so most calls run eagerly and take turns on
    that stream's one kept workspace (the GIL orders their enqueues; the
    kernels of one call may still run while another's are enqueued); every
    y equals a single-threaded run."""
    n, steps = 4, 8
    inputs = [_inputs(bs=8, seed=40 + i, prefill=90 + 7 * i) for i in range(n)]
    xs, expect = _new_xs_and_expected(inputs, steps, 5)
    errors = _decode_in_threads(inputs, xs, expect, own_streams=False)
    assert not errors, errors


def _unsplit_bs():
    info = mla_decode._ext.attention_info(0)
    return max(1, info.sms * info.blocks_per_sm // -(-128 // info.rows_per_block))


def test_unsplit_batch_with_parameters_in_inference_mode_on_the_last_gpu():
    """The task's kind of batch (not split: the fused query writes the plan,
    eager calls use the stream's kept workspace) with nn.Parameter weights,
    under inference_mode, on the process's last GPU while GPU 0 is current
    (the current one where there is a single GPU), with new x every call."""
    if not mla_decode.kernel_choice.hopper("cuda"):
        pytest.skip("the fused query runs on Hopper GPUs only")
    dev = f"cuda:{torch.cuda.device_count() - 1}"
    config, x, kv = _inputs(bs=_unsplit_bs(), seed=7, prefill=70, max_seq_len=96, device=dev)
    cfg = dataclasses.replace(config, **{n: torch.nn.Parameter(getattr(config, n).clone()) for n in NAMES})
    dec = mla_decode.MLADecoder(backend="kernels")
    gen = torch.Generator(device=dev).manual_seed(8)
    xs = [torch.randn(x.shape, generator=gen, device=dev).to(torch.bfloat16) for _ in range(3)]  # (all alive:
    with torch.inference_mode():                                                                # new addresses)
        for call, xi in enumerate(xs):
            y = _check_against_reference(cfg, xi, kv, dec)
            assert y.device == torch.device(dev) and not y.requires_grad, f"call {call}"
            assert dec.last_paths["launch"] == "eager" and dec.last_paths["plan"] == "fused query", dec.last_paths
    assert torch.cuda.current_device() == 0


def test_unsplit_batch_from_two_threads_on_their_own_streams():
    """Two threads run the unsplit batch's eager step (new x every call) on
    streams of their own, each with its kept workspace; every y equals a
    single-threaded run."""
    if not mla_decode.kernel_choice.hopper("cuda"):
        pytest.skip("the fused query runs on Hopper GPUs only")
    bs, steps = _unsplit_bs(), 4
    inputs = [_inputs(bs=bs, seed=50 + i, prefill=40 + 9 * i, max_seq_len=64) for i in range(2)]
    xs, expect = _new_xs_and_expected(inputs, steps, 9)
    errors = _decode_in_threads(inputs, xs, expect, own_streams=True)
    assert not errors, errors


def test_eager_steps_rotating_over_more_streams_than_kept_workspaces():
    """Six streams take turns (each its own cache, new x every call, so the
    calls run eagerly): more streams than the workspaces kept per GPU, so
    workspaces are dropped while their stream's last kernels may still run
    and made again later. Every y equals a single-stream run bit for bit."""
    n, rounds = 6, 3
    inputs = [_inputs(bs=8, seed=60 + i, prefill=50 + 5 * i, max_seq_len=80) for i in range(n)]
    xs, expect = _new_xs_and_expected(inputs, rounds, 11)
    streams = [torch.cuda.Stream() for _ in range(n)]
    dec = mla_decode.MLADecoder(backend="kernels")
    got = [[] for _ in range(n)]
    for k in range(rounds):
        for i, s in enumerate(streams):
            cfg, _, kv = inputs[i]
            with torch.cuda.stream(s):
                got[i].append(dec(cfg, xs[i][k].clone(), kv)[0])
    torch.cuda.synchronize()
    bad = [f"stream {i} round {k}" for i in range(n) for k in range(rounds) if not torch.equal(got[i][k], expect[i][k])]
    assert not bad, bad


@pytest.mark.skipif(not hasattr(torch.cuda, "use_mem_pool"), reason="this PyTorch has no torch.cuda.use_mem_pool")
def test_steps_inside_a_private_memory_pool_then_after_it_is_gone():
    """A caller's private pool (torch.cuda.use_mem_pool): a decoder's first
    step (which captures) and an eager step on a new stream (which makes
    that stream's kept workspace) run inside it; after the pool is dropped
    and the cache emptied, further steps (replayed and eager, new x every
    call) stay within the task rule, and the memory the pool held is reused
    by other tensors without disturbing them."""
    config, x, kv = _inputs(bs=8, seed=12, prefill=60, max_seq_len=96)
    gen = torch.Generator(device="cuda").manual_seed(13)
    side = torch.cuda.Stream()
    pool = torch.cuda.MemPool()
    dec = mla_decode.MLADecoder(backend="kernels")
    with torch.cuda.use_mem_pool(pool):
        _check_against_reference(config, x, kv, dec)
        with torch.cuda.stream(side):
            xi = torch.randn(x.shape, generator=gen, device="cuda").to(torch.bfloat16)
            _check_against_reference(config, xi, kv, dec)
            torch.cuda.current_stream().synchronize()
    del pool
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    filler = [torch.full((1 << 22,), 7.0, device="cuda") for _ in range(32)]  # 512 MB that may land where the pool was
    for call in range(3):
        _check_against_reference(config, x, kv, dec)
        with torch.cuda.stream(side):
            xi = torch.randn(x.shape, generator=gen, device="cuda").to(torch.bfloat16)
            _check_against_reference(config, xi, kv, dec)
            torch.cuda.current_stream().synchronize()
    assert all(bool((f == 7.0).all()) for f in filler), "a step wrote into memory it does not own"


def test_cache_written_by_another_kernel_between_steps():
    """A new request reusing a slot: another kernel (a Triton-like raw write,
    here a graph replay) replaces a sequence's rows; the step reads them."""
    config, x, kv = _inputs(seed=30, prefill=200)
    dec = mla_decode.MLADecoder(backend="kernels")
    dec(config, x, kv)
    fresh = torch.randn(1, kv.data.shape[1], 576, device="cuda").to(torch.bfloat16)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        kv.data[3:4].copy_(fresh)
    g.replay()
    _check_against_reference(config, x, kv, dec)


def test_attention_op_conditions():
    """mla_attention under inference_mode, on a second stream and with an
    unaligned kv or q view (a clear error, nothing launched)."""
    bs, L, h = 4, 300, 16
    kv = torch.randn(bs, 512, 576, device="cuda").to(torch.bfloat16)
    q = torch.randn(bs, 1, h, 576, device="cuda").to(torch.bfloat16)
    lens = torch.full((bs,), L, dtype=torch.int32, device="cuda")
    ref, _ = mla_decode.attention_reference(q, kv, lens, 0.1)
    with torch.inference_mode():
        out, _ = mla_decode.mla_attention(q, kv, lens, 0.1)
    assert_task_rule(out, ref.to(torch.bfloat16), "inference_mode")
    with torch.cuda.stream(torch.cuda.Stream()):
        out2, _ = mla_decode.mla_attention(q, kv, lens, 0.1)
        torch.cuda.current_stream().synchronize()
    assert torch.equal(out, out2)
    wide = torch.zeros(bs, 512, 577, device="cuda", dtype=torch.bfloat16)
    wide[..., 1:] = kv
    with pytest.raises(ValueError, match="16-byte aligned"):
        mla_decode.mla_attention(q, wide[..., 1:], lens, 0.1)
    wq = torch.zeros(bs, 1, h, 577, device="cuda", dtype=torch.bfloat16)
    wq[..., 1:] = q
    with pytest.raises(ValueError, match="16-byte aligned"):
        mla_decode.mla_attention(wq[..., 1:], kv, lens, 0.1)
    torch.cuda.synchronize()  # the context is alive


@two_gpus
def test_attention_op_on_the_second_gpu():
    torch.cuda.set_device(0)
    kv = torch.randn(2, 256, 576, device="cuda:1").to(torch.bfloat16)
    q = torch.randn(2, 1, 16, 576, device="cuda:1").to(torch.bfloat16)
    lens = torch.tensor([100, 256], dtype=torch.int32, device="cuda:1")
    out, _ = mla_decode.mla_attention(q, kv, lens, 0.1)
    ref, _ = mla_decode.attention_reference(q, kv, lens, 0.1)
    assert_task_rule(out, ref.to(torch.bfloat16), "cuda:1")


def test_serving_block_ids_out_of_range():
    """An id outside k_cache in a used block-table slot never reads outside
    k_cache (it reads block 0 in its place): the context lives, the other
    sequences are exact; the checked mode raises before launching."""
    b, page, h = 3, 64, 16
    k_cache = torch.randn(12, page, 1, 576, device="cuda").to(torch.bfloat16)
    table = torch.arange(12, dtype=torch.int32, device="cuda").view(3, 4)
    lens = torch.tensor([200, 256, 100], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, 576, device="cuda").to(torch.bfloat16)
    meta, splits = mla_decode.get_mla_metadata(lens, h, 1)
    good, _ = mla_decode.flash_mla_with_kvcache(q, k_cache, table, lens, 512, meta, splits)
    bad_table = table.clone()
    bad_table[1, 2] = 10 ** 6
    bad_table[2, 0] = -5
    out, lse = mla_decode.flash_mla_with_kvcache(q, k_cache, bad_table, lens, 512, meta, splits)
    torch.cuda.synchronize()
    assert torch.equal(out[0], good[0])
    with pytest.raises(ValueError, match=r"block_table\[1, 2\] = 1000000 is outside"):
        mla_decode.flash_mla_with_kvcache(q, k_cache, bad_table, lens, 512, meta, splits, check_block_table=True)
    long = lens.clone()
    long[2] = 4 * page + 1  # one row past the table's 4 slots
    with pytest.raises(ValueError, match=r"cache_seqlens\[2\] = 257 is outside \[0, 256\]"):
        mla_decode.flash_mla_with_kvcache(q, k_cache, table, long, 512, meta, splits, check_block_table=True)
    torch.cuda.synchronize()


def test_replay_after_a_longer_cache_grew_the_rope_table():
    """A captured step reads the RoPE table it was captured with. A longer
    cache then grows the table (a new tensor; the decoder drops the old one),
    and the old table's memory is handed out again and poisoned: the next
    replay of the first cache's step must still be right (the captured step
    keeps its table alive)."""
    if os.environ.get("MLA_DECODE_STEP_GRAPH") == "0":
        pytest.skip("MLA_DECODE_STEP_GRAPH=0: no replays")
    mla_decode.release_cached()
    config, x, kv = _inputs(bs=4, prefill=20, seed=47, max_seq_len=64)
    dec = mla_decode.MLADecoder(backend="kernels")
    _check_against_reference(config, x, kv, dec)
    _check_against_reference(config, x, kv, dec)
    assert dec.last_paths["launch"] == "graph replay"
    config_b, x_b, kv_b = _inputs(bs=4, prefill=20, seed=48, max_seq_len=4096)
    _check_against_reference(config_b, x_b, kv_b, dec)
    torch.cuda.synchronize()
    poison = [torch.full((64, 64), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(64)]
    _check_against_reference(config, x, kv, dec)
    assert dec.last_paths["launch"] == "graph replay"
    del poison


def test_release_cached():
    config, x, kv = _inputs(seed=40)
    mla_decode.custom_kernel((config, x, kv))
    mla_decode.release_cached()
    _check_against_reference(config, x, kv, mla_decode.MLADecoder(backend="kernels"))


def test_soak_mixed_calls_memory_flat():
    """2,000+ calls mixing batch sizes, lengths, head counts (full and a TP
    rank's), several decoders and caches, two GPUs where present, calls
    inside a user's CUDA graph, in-place weight updates and foreign cache
    writes; every call's y and cache are compared with a second run of the
    same call on copies (bitwise) and, every 50th, with the reference."""
    from mla_decode.tp import shard_config

    rng = random.Random(0)
    devices = [f"cuda:{i}" for i in range(min(2, torch.cuda.device_count()))]
    setups = []
    for i, dev in enumerate(devices):
        config, _, _ = generate_input(batch_size=1, prefill=0, max_seq_len=8, seed=100 + i, device=dev)
        setups.append((dev, config))
        setups.append((dev, shard_config(config, 1, 2)))
    decs = [mla_decode.MLADecoder(backend="kernels") for _ in range(3)]
    caches = []
    for k in range(6):
        dev, config = setups[k % len(setups)]
        bs = rng.choice([1, 3, 8, 32])
        _, _, kv = generate_input(batch_size=bs, prefill=rng.randrange(0, 400), max_seq_len=1024, seed=200 + k,
                                  device=dev, n_heads=config.n_heads)
        caches.append((dev, config, kv, kv.clone()))
    for dev in devices:
        torch.cuda.synchronize(dev)
    seen = []
    calls = 0
    g = None
    warm = set()
    capture_streams = {dev: torch.cuda.Stream(device=dev) for dev in devices}  # (PyTorch keeps a BLAS workspace per stream)

    def allocated():  # (every device together: the captured steps are per process, kept where a cache lives)
        torch.cuda.synchronize()
        return sum(torch.cuda.memory_allocated(d) for d in devices)

    for it in range(2100):
        dev, config, kv, twin = caches[rng.randrange(len(caches))]
        if kv.seq_len >= kv.data.shape[1] - 1:  # full: start the sequence again
            kv.seq_len = twin.seq_len = rng.randrange(0, 50)
        bs = kv.data.shape[0]
        x = torch.randn(bs, 1, config.dim, device=dev).to(torch.bfloat16)
        if it % 97 == 0:  # an in-place weight update
            config.wo_weight.mul_(1.0 + 0.01 * rng.random())
        if it % 89 == 0:  # a foreign write to both copies
            rows = torch.randn(bs, 16, 576, device=dev).to(torch.bfloat16)
            at = rng.randrange(0, max(1, kv.seq_len - 16))
            kv.data[:, at:at + 16] = rows
            twin.data[:, at:at + 16] = rows
            del rows
        dec = decs[rng.randrange(len(decs))]
        ref = kv.clone() if it % 50 == 0 else None
        with torch.cuda.device(dev):
            if it % 41 == 40 and (dev, id(config)) in warm:  # inside a user's graph, replayed once (after an eager call there,
                # as PyTorch asks before capturing: cuBLAS sets itself up on a device's first call)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=capture_streams[dev]):  # (one capture stream per device)
                    y, _ = dec(config, x, kv)
                g.replay()
            else:
                y, _ = dec(config, x, kv)
            y2, _ = decs[0](config, x, twin)
        warm.add((dev, id(config)))
        calls += 1
        assert torch.equal(y, y2), f"call {it}: y differs from a second run"
        assert torch.equal(kv.data, twin.data), f"call {it}: caches differ"
        if ref is not None:
            y_ref, _ = ref_kernel((config, x, ref), batch_chunk=8)
            assert_task_rule(y, y_ref, f"call {it}: y")
            del y_ref, ref, _  # (the reference returns its cache copy's data)
        del y, y2, x
        if it in (200, 700, 1400):
            g = None
            seen.append(allocated())
    g = None
    assert calls >= 2000
    seen.append(allocated())
    # bounded: at most 4 captured steps, each keeping its y (their sizes differ, so the total moves
    # as one replaces another); release_cached() gives back what they hold
    assert max(seen) - min(seen) < 16 << 20, f"device memory grew (after calls 200, 700, 1400, 2100): {seen}"
    mla_decode.release_cached()  # (the soak repeats operands often enough that some steps are captured)
    assert allocated() < seen[-1], f"release_cached() freed nothing: {allocated()} bytes against {seen[-1]}"


def test_repeated_steps_replay_and_read_everything_anew():
    """Repeated calls on the same operands replay the step's captured graph:
    every replay reads x, the weights and the cache as they are now, returns
    a y of its own, and follows the caller's stream."""
    config, x, kv = _inputs(bs=8, prefill=100, seed=21)
    dec = mla_decode.MLADecoder(backend="kernels")
    dec(config, x, kv.clone())  # (a device's first step is captured at once: not this test's subject)
    mla_decode.release_cached()  # (no step captured by an earlier test)
    launches, kept, captured = [], [], []
    side = torch.cuda.Stream()
    for step in range(6):
        if step == 3:  # the cache written by another kernel, x rewritten in place
            kv.data[:, :50].copy_(torch.randn_like(kv.data[:, :50]))
            x.copy_(torch.randn_like(x))
        ref = kv.clone()
        if step == 4:  # another stream of the caller's
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                y, data = dec(config, x, kv)
            torch.cuda.current_stream().wait_stream(side)
        else:
            y, data = dec(config, x, kv)
        launches.append(dec.last_paths["launch"])
        captured.append(dec.last_paths["captured"])
        y_ref, data_ref = ref_kernel((config, x, ref), batch_chunk=8)
        assert_task_rule(y, y_ref, f"y at step {step}")
        assert_task_rule(data, data_ref, f"cache at step {step}")
        kept.append((y, y.clone()))
    # the length moved back (a cache rewound, as a benchmark loop does), repeated (as fresh caches of
    # one length would be), then forward again: the replays take the call's length, not the one the
    # last replay's pattern would give
    for step, seq_len in enumerate([103, 103, 103, 104, 105, 101, 101, 102], start=6):
        kv.seq_len = seq_len
        y, launch = _checked_step(dec, config, x, kv, f"step {step}, seq_len {seq_len}")
        launches.append(launch)
        assert kv.seq_len == seq_len + 1
        kept.append((y, y.clone()))
    for i, (y, y0) in enumerate(kept):
        assert torch.equal(y, y0), f"the y of step {i} changed after later steps"
    if os.environ.get("MLA_DECODE_STEP_GRAPH") != "0":
        # nothing captured: the first call runs eagerly, then is captured; from the second call on: replays
        assert launches == ["eager"] + ["graph replay"] * 13, launches
        assert captured == [True, False, False, False, False, False], captured
    mla_decode.release_cached()
    ref = kv.clone()
    y, data = dec(config, x, kv)
    assert dec.last_paths["launch"] == "eager"
    assert_task_rule(y, ref_kernel((config, x, ref), batch_chunk=8)[0], "y after release_cached")


_FIRST_STEPS = r"""
import torch, mla_decode
from mla_decode.reference import generate_input, ref_kernel
from conftest import assert_task_rule
config, x, kv = generate_input(batch_size=8, prefill=100, seed=5, device="cuda")
dec = mla_decode.MLADecoder(backend="kernels")
launches = []
for step in range(4):
    ref = kv.clone()
    y, data = dec(config, x, kv)
    launches.append(dec.last_paths["launch"])
    y_ref, data_ref = ref_kernel((config, x, ref), batch_chunk=8)
    assert_task_rule(y, y_ref, f"y at step {step}")
    assert_task_rule(data, data_ref, f"cache at step {step}")
print(launches)
"""


def test_first_step_of_a_process_is_captured_at_once():
    """A process's first step on a GPU runs eagerly and is captured at once
    (the one-time costs of a first capture go to the call that already pays
    the libraries' start-up), so a repeat of it replays from the second call."""
    import subprocess
    import sys
    if os.environ.get("MLA_DECODE_STEP_GRAPH") == "0":
        pytest.skip("MLA_DECODE_STEP_GRAPH=0: no captured steps")
    here = os.path.dirname(os.path.abspath(__file__))
    # the mla_decode this process imported, and conftest
    paths = [os.path.dirname(os.path.dirname(mla_decode.__file__)), here]
    paths += [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    r = subprocess.run([sys.executable, "-c", _FIRST_STEPS], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == str(["eager"] + ["graph replay"] * 3), r.stdout


def test_steps_taking_turns_are_captured_only_when_they_come_back_soon():
    """While fewer than four steps are captured, a new step is captured by its
    first call (two caches taking turns replay from their second calls). Once
    four are: a step seen again within four other first sights replaces the
    least recently replayed one only if that one has not run since (a new
    working set, as a benchmark's next shape), so that six caches taking
    turns (as the layers of a model on one decoder) keep the four captured
    ones replaying and the other two eager, with no capture after the first
    round."""
    if os.environ.get("MLA_DECODE_STEP_GRAPH") == "0":
        pytest.skip("MLA_DECODE_STEP_GRAPH=0: no captured steps")
    config, x, kv = _inputs(bs=8, prefill=100, seed=31)
    dec = mla_decode.MLADecoder(backend="kernels")
    dec(config, x, kv.clone())  # (a device's first step is captured at once: not this test's subject)
    six = ["eager"] * 6 + (["graph replay"] * 4 + ["eager"] * 2) * 2
    for turns, want in ((2, ["eager"] * 2 + ["graph replay"] * 6), (6, six)):
        mla_decode.release_cached()
        caches = [kv.clone() for _ in range(turns)]
        launches, captured = [], []
        for i in range(len(want)):
            _, launch = _checked_step(dec, config, x, caches[i % turns], f"call {i} of {turns} caches taking turns")
            launches.append(launch)
            captured.append(dec.last_paths["captured"])
        assert launches == want, (turns, launches)
        assert captured == [i < min(turns, 4) for i in range(len(want))], (turns, captured)
    # a new cache used again and again after those: its second call replaces the least recently replayed
    # step (not run since the new one's first call) and its third replays
    new = kv.clone()
    launches = [_checked_step(dec, config, x, new, f"call {i} on a new cache")[1] for i in range(3)]
    assert launches == ["eager", "eager", "graph replay"], launches
    mla_decode.release_cached()


def test_lean_replay_matches_only_a_captured_step():
    """custom_kernel's lean path (mla_decode._C.fast_step) replays a captured
    step whose operands the call repeats, with the call's length; for new
    operands at sizes the decoder has run on this GPU it runs the checked
    step itself; it does nothing (None) for anything else, which the checked
    path in Python then takes: it raises for a bad length or a refused
    cache, registers a first call's sizes."""
    if os.environ.get("MLA_DECODE_STEP_GRAPH") == "0":
        pytest.skip("MLA_DECODE_STEP_GRAPH=0: no captured steps")
    fast = mla_decode._ext.module().fast_step
    config, x, kv = _inputs(bs=8, prefill=100, seed=41)
    dec = mla_decode.MLADecoder(backend="kernels")
    dec(config, x, kv.clone())  # (a device's first step is captured at once: not this test's subject)
    mla_decode.release_cached()
    assert fast((config, x, kv)) is None and kv.seq_len == 100  # nothing captured yet
    for step in range(2):  # captured after the first call (nothing else is), replayed by the second
        _checked_step(dec, config, x, kv, f"step {step}")
    for seq_len in (102, 102, 90, 91):  # the next length, a rewound one, then on from there
        kv.seq_len = seq_len
        ref = kv.clone()
        r = fast((config, x, kv))
        assert r is not None and len(r) == 3 and r[1] is kv.data and kv.seq_len == seq_len + 1
        assert r[2] & mla_decode.kernel_choice.step_bit("graph")
        y_ref, data_ref = ref_kernel((config, x, ref), batch_chunk=8)
        assert_task_rule(r[0], y_ref, f"y of the lean replay at seq_len {seq_len}")
        assert_task_rule(r[1], data_ref, f"cache of the lean replay at seq_len {seq_len}")
    before = kv.data.clone()
    for what, seq_len in [("a full cache", kv.data.shape[1]), ("a negative length", -1), ("a bool length", True)]:
        other = types.SimpleNamespace(data=kv.data, seq_len=seq_len)
        assert fast((config, x, other)) is None, what
        with pytest.raises(mla_decode.MLAInputError):
            dec(config, x, other)
    assert fast((dataclasses.replace(config, n_heads=config.n_heads + 1), x, kv)) is None  # sizes never run
    assert fast((config, x)) is None and fast(None) is None and fast((config, x.cpu(), kv)) is None
    # a cache the checks refuse (rows not 16-byte aligned): None from the lean path, the error from the checked one
    wide = torch.zeros(kv.data.shape[0], kv.data.shape[1], kv.data.shape[2] + 8, dtype=kv.data.dtype, device="cuda")
    misaligned = types.SimpleNamespace(data=wide[:, :, 4:4 + kv.data.shape[2]], seq_len=50)
    assert fast((config, x, misaligned)) is None and misaligned.seq_len == 50
    with pytest.raises(mla_decode.MLAInputError):
        dec(config, x, misaligned)
    assert torch.equal(kv.data, before), "a refused lean call wrote the cache"
    assert not wide.any(), "a refused lean call wrote the misaligned cache"
    # new operands (no captured step) at sizes the decoder has run: the lean path runs the checked step
    other_x = x.clone().normal_()
    seq_len = kv.seq_len
    ref = kv.clone()
    r = fast((config, other_x, kv))
    assert r is not None and r[1] is kv.data and kv.seq_len == seq_len + 1
    assert not r[2] & mla_decode.kernel_choice.step_bit("graph")
    y_ref, data_ref = ref_kernel((config, other_x, ref), batch_chunk=8)
    assert_task_rule(r[0], y_ref, "y of the lean path's checked step")
    assert_task_rule(r[1], data_ref, "cache of the lean path's checked step")
    mla_decode.release_cached()  # (forgets the decoder's registered choices too)
    assert fast((config, x.clone(), kv)) is None


def test_reloaded_settings_reach_every_path(gemm_env):
    """kernel_choice.reload_settings() after an environment change: the next
    call at sizes run before takes the new wished paths, whether its operands
    are new (the lean path's registered choices are dropped) or repeat a
    captured step (captured steps are dropped), and still gives the task's
    answer."""
    if not mla_decode.kernel_choice.hopper(torch.device("cuda")):
        pytest.skip("the own GEMM runs on Hopper GPUs only")
    config, x, kv = _inputs(bs=8, prefill=100, seed=43)
    dec = mla_decode.decoder._DEFAULT
    gemm_env(None)
    for _ in range(3):  # new x each call, then a repeated one
        mla_decode.custom_kernel((config, x.clone(), kv))
    mla_decode.custom_kernel((config, x, kv))
    mla_decode.custom_kernel((config, x, kv))
    assert dec.last_paths["down"] == "sm90 GEMM", dec.last_paths
    gemm_env("vendor")
    for what, xx in [("new operands", x.clone()), ("repeated operands", x)]:
        ref = kv.clone()
        y, data = mla_decode.custom_kernel((config, xx, kv))
        assert dec.last_paths["down"] == "vendor BLAS", (what, dec.last_paths)
        y_ref, data_ref = ref_kernel((config, xx, ref), batch_chunk=8)
        assert_task_rule(y, y_ref, f"y after the reload, {what}")
        assert_task_rule(data, data_ref, f"cache after the reload, {what}")
    mla_decode.release_cached()
