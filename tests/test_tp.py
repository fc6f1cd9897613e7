"""Tensor-parallel decode (mla_decode.tp): the sharding logic on the CPU with
the gloo backend and the PyTorch fallback (2 processes, always runs), and the
kernels on 2 GPUs with NCCL (skips with the reason where fewer are visible).
Every rank's y must match the single-process result under the task rule, and
every rank's cache the single-process cache exactly."""

import dataclasses

import pytest
import torch
import torch.multiprocessing as mp

import mla_decode
from mla_decode.reference import generate_input
from mla_decode.tp import TPDecoder, shard_config

from conftest import SMALL, assert_task_rule, free_port, gpus, init_rank

TP = 2


def _worker(rank, world, port, dist_backend, device_kind, cases, steps, decoder_backend, shape):
    import torch.distributed as dist

    device = init_rank(rank, world, port, dist_backend, device_kind)
    try:
        for bs, prefill in cases:
            config, x, kv = generate_input(batch_size=bs, prefill=prefill, seed=prefill + bs, device=device, **shape)
            kv1 = kv.clone()
            single = mla_decode.MLADecoder(backend=decoder_backend)
            tp = TPDecoder(config, rank, world, backend=decoder_backend)
            g = torch.Generator(device=device).manual_seed(7)  # same stream on every rank
            for step in range(steps):
                if step:
                    x = torch.randn(x.shape, generator=g, device=device).to(torch.bfloat16)
                y1, _ = single(config, x, kv1)
                y, data = tp(x, kv)
                what = f"rank {rank} bs={bs} prefill={prefill} step {step}"
                assert data is kv.data and kv.seq_len == kv1.seq_len
                assert tp.last_backend == decoder_backend or decoder_backend == "auto", what
                assert_task_rule(y, y1, f"y, {what}")
                assert torch.equal(kv.data, kv1.data), f"cache differs from the single-process cache, {what}"
            # every rank holds the same y
            ys = [torch.empty_like(y) for _ in range(world)]
            dist.all_gather(ys, y)
            assert all(torch.equal(ys[0], t) for t in ys), f"ranks disagree on y, bs={bs} prefill={prefill}"
    finally:
        dist.destroy_process_group()


def test_shard_config_slices():
    config, _, _ = generate_input(batch_size=2, prefill=3, seed=0, **SMALL)
    H, dq, dkv, v = SMALL["n_heads"], SMALL["nope"] + SMALL["rope"], SMALL["nope"] + SMALL["v"], SMALL["v"]
    parts = [shard_config(config, r, 2) for r in range(2)]
    assert all(p.n_heads == H // 2 for p in parts)
    assert torch.equal(torch.cat([p.Q_proj_up_weight for p in parts]), config.Q_proj_up_weight)
    assert torch.equal(torch.cat([p.KV_proj_up_weight for p in parts]), config.KV_proj_up_weight)
    assert torch.equal(torch.cat([p.wo_weight for p in parts], 1), config.wo_weight)
    assert parts[1].Q_proj_down_weight is config.Q_proj_down_weight
    assert parts[0].wo_weight.shape == (SMALL["dim"], H // 2 * v) and parts[0].Q_proj_up_weight.shape[0] == H // 2 * dq
    assert parts[0].KV_proj_up_weight.shape[0] == H // 2 * dkv
    # shards are copies of their own: nothing shared with the full weights (which may then be freed), no autograd
    for name in ("Q_proj_up_weight", "KV_proj_up_weight", "wo_weight"):
        w, s = getattr(config, name), getattr(parts[1], name)
        assert s.is_contiguous() and s.untyped_storage().nbytes() == s.numel() * s.element_size(), name
        assert s.untyped_storage().data_ptr() != w.untyped_storage().data_ptr(), name
    params = dataclasses.replace(config, **{n: torch.nn.Parameter(getattr(config, n).clone())
                                            for n in ("Q_proj_up_weight", "KV_proj_up_weight", "wo_weight")})
    assert not any(getattr(shard_config(params, 0, 2), n).requires_grad
                   for n in ("Q_proj_up_weight", "KV_proj_up_weight", "wo_weight"))
    with pytest.raises(ValueError, match="tp must divide n_heads: n_heads=4, tp=3"):
        shard_config(config, 0, 3)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        shard_config(config, 2, 2)


def test_tp2_cpu_gloo():
    mp.spawn(_worker, args=(TP, free_port(), "gloo", "cpu", [(3, 5), (2, 20)], 16, "torch", SMALL), nprocs=TP,
             join=True)


two_gpus = gpus(2)


@two_gpus
@pytest.mark.gpu
def test_tp2_gpus_task_shapes():
    # prefill 512 and 6144 at bs=128 (one step each), then a 16-step loop from 512
    mp.spawn(_worker, args=(TP, free_port(), "nccl", "cuda", [(128, 512), (128, 6144)], 1, "kernels", {}),
             nprocs=TP, join=True)
    mp.spawn(_worker, args=(TP, free_port(), "nccl", "cuda", [(128, 512)], 16, "kernels", {}), nprocs=TP, join=True)
