"""Decode context parallelism for custom_kernel's layer (mla_decode.dcp_step): N
ranks each holding the interleaved share of the cache give y as close to the
float64 evaluation of the step on the whole cache as the task's bf16 reference
is (conftest.assert_drift; at the small dims with a handful of keys the bf16
chain itself strays near its own tolerance, so two correct implementations
need not agree under the task rule there: see test_fallback_cpu), within the
task rule of the reference at the task's shapes, and their rows stay equal to
the one-process decoder's cache's. On the CPU with gloo (2 and 3 processes,
the PyTorch backend, small dims); on 2 and 4 GPUs with NCCL and the kernels at
the task's shapes where they are visible (skipped with the reason otherwise)."""

import pytest
import torch
import torch.multiprocessing as mp

import mla_decode
from mla_decode.dcp_step import DCPCache, DCPDecoder, dcp_shard_task_cache
from mla_decode.reference import decode_step_float64, generate_input, ref_kernel

from conftest import SMALL, assert_drift, assert_task_rule, free_port, gpus, init_rank, needs_gpu


def _worker(rank, world, port, dist_backend, device_kind, cases, steps, backend, shape):
    import torch.distributed as dist

    device = init_rank(rank, world, port, dist_backend, device_kind)
    single_backend = backend
    if backend == "oracle":  # the kernels branch on the CPU, the attention op replaced by its oracle
        import mla_decode.dcp_step as ds

        def op(q, kv, seqlens, scale, *, rope_cs=None, head_dim_v=512):
            out, lse = mla_decode.attention_reference(q, kv, seqlens, scale, rope_cs=rope_cs, dtype=torch.float32,
                                                      head_dim_v=head_dim_v)
            return out.to(q.dtype), lse.float()
        ds.mla_attention = op
        ds.kernels_usable = lambda device=None: True
        backend, single_backend = "kernels", "torch"
    try:
        for bs, prefill in cases:
            config, x, kv = generate_input(batch_size=bs, prefill=prefill, seed=prefill + bs, device=device, **shape)
            local = dcp_shard_task_cache(kv, rank, world)
            kv_ref = kv.clone()
            single = mla_decode.MLADecoder(backend=single_backend)
            dec = DCPDecoder(backend=backend)
            g = torch.Generator(device=device).manual_seed(7)  # the same x on every rank
            for step in range(steps):
                if step:
                    x = torch.randn(x.shape, generator=g, device=device).to(torch.bfloat16)
                y_ref, _ = ref_kernel((config, x, kv_ref), batch_chunk=16)
                y64 = decode_step_float64(config, x, kv_ref.data, kv_ref.seq_len) if device == "cpu" else None
                single(config, x, kv)
                y, data = dec(config, x, local)
                what = f"rank {rank} of {world}, bs={bs} prefill={prefill} step {step}"
                assert data is local.data and local.seq_len == kv.seq_len, what
                assert dec.last_backend == backend, what
                if y64 is not None:
                    assert_drift(y, y_ref, y64, f"y, {what}")
                else:
                    assert_task_rule(y, y_ref, f"y, {what}")
                mine = kv.data[:, rank::world]
                assert torch.equal(local.data[:, :mine.shape[1]], mine), f"rank's rows differ, {what}"
            ys = [torch.empty_like(y) for _ in range(world)]
            dist.all_gather(ys, y)
            assert all(torch.equal(ys[0], t) for t in ys), f"ranks disagree on y, bs={bs} prefill={prefill}"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_dcp_step_gloo(world):
    # prefill 0 and 1: some ranks hold no row at first
    cases = [(3, 0), (2, 1), (3, 5), (2, 20)]
    mp.spawn(_worker, args=(world, free_port(), "gloo", "cpu", cases, 12, "torch", SMALL), nprocs=world, join=True)


@pytest.mark.parametrize("world", [2, 4])
def test_dcp_step_kernel_branch_with_the_attention_oracle(world):
    # the kernels branch's own logic (each rank's RoPE rows at its tokens' global positions, its local lengths,
    # the op's (out, lse) merged) with the attention op replaced by attention_reference, the op's semantics in
    # PyTorch (the oracle of the attention tests), on the CPU: the sizes the kernels take (latent 512, rope 64)
    shape = dict(dim=128, q_lora_rank=64, n_heads=2, kv_lora_rank=512, nope=16, rope=64, v=16, max_seq_len=40)
    mp.spawn(_worker, args=(world, free_port(), "gloo", "cpu", [(2, 0), (2, 9)], 8, "oracle", shape), nprocs=world,
             join=True)


def test_shard_task_cache_and_errors():
    config, x, kv = generate_input(batch_size=2, prefill=9, seed=3, **SMALL)
    parts = [dcp_shard_task_cache(kv, r, 3) for r in range(3)]
    cap = SMALL["max_seq_len"]
    assert all(p.data.shape == (2, (cap + 2) // 3, kv.data.shape[2]) and p.seq_len == 9 for p in parts)
    for r, p in enumerate(parts):
        assert torch.equal(p.data[:, :len(range(r, cap, 3))], kv.data[:, r::3])
    with pytest.raises(ValueError, match="need 0 <= rank < world"):
        dcp_shard_task_cache(kv, 3, 3)
    with pytest.raises(ValueError, match="backend must be"):
        DCPDecoder(backend="cuda")
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        DCPDecoder()(config, x, parts[0])


def test_dcp_step_full_and_bad_inputs_world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        config, x, kv = generate_input(batch_size=2, prefill=3, seed=4, **SMALL)
        local = dcp_shard_task_cache(kv, 0, 1)
        y_ref, _ = ref_kernel((config, x, kv))
        y, _ = DCPDecoder(backend="torch")(config, x, local)
        assert_drift(y, y_ref, decode_step_float64(config, x, kv.data, kv.seq_len), "y, world of one")
        full = DCPCache(local.data, local.data.shape[1])
        before = full.data.clone()
        with pytest.raises(mla_decode.MLAInputError, match="kv_cache is full"):
            DCPDecoder(backend="torch")(config, x, full)
        with pytest.raises(mla_decode.MLAInputError, match="x must have shape"):
            DCPDecoder(backend="torch")(config, x[:, :, :-1].contiguous(), local)
        assert torch.equal(full.data, before) and full.seq_len == local.data.shape[1]
    finally:
        dist.destroy_process_group()


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("world", [pytest.param(2, marks=gpus(2)), pytest.param(4, marks=gpus(4))])
def test_dcp_step_gpus_task_shapes(world):
    # bs 128 at prefill 512 and 6144 (two steps each), then an 8-step loop from 511
    mp.spawn(_worker, args=(world, free_port(), "nccl", "cuda", [(128, 512), (128, 6144)], 2, "kernels", {}),
             nprocs=world, join=True)
    mp.spawn(_worker, args=(world, free_port(), "nccl", "cuda", [(128, 511)], 8, "kernels", {}), nprocs=world,
             join=True)
