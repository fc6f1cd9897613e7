"""The projection stages (mla_decode.projections), stage by stage, against
float64 evaluations of the same bf16 inputs rounded where the task rounds,
with fresh random inputs: on the GPU at bs = 1, 32, 128 and the task's dims,
on the CPU at small dims. The GPU's rope_append kernel must give the bits of
its PyTorch twin."""

import pytest
import torch

import mla_decode
from mla_decode import projections
from mla_decode.reference import generate_input, rope_cos_sin, rope_rotate

from conftest import assert_task_rule, needs_gpu

# the task's dims on the GPU at bs 1/32/128; the same code on the CPU at small dims (always runs)
CASES = [pytest.param("cuda", bs, {}, marks=[needs_gpu, pytest.mark.gpu], id=f"cuda-bs{bs}") for bs in (1, 32, 128)]
CASES.append(pytest.param("cpu", 3, dict(dim=256, q_lora_rank=96, n_heads=4, kv_lora_rank=64, nope=32, rope=16, v=24),
                          id="cpu-small"))


def bf(t):
    return t.to(torch.bfloat16)


def bits(t):
    return t.view(torch.int16)


def tables(positions, rope, dev):
    cos2, sin2 = rope_cos_sin(torch.arange(positions, device=dev), rope)
    return torch.cat([cos2[:, : rope // 2], sin2[:, : rope // 2]], dim=-1).contiguous(), cos2, sin2


@pytest.mark.parametrize("dev,bs,small", CASES)
def test_down_gives_q_lora_and_the_new_row(dev, bs, small):
    config, x, _ = generate_input(batch_size=bs, prefill=0, max_seq_len=8, seed=100 + bs, device=dev, **small)
    x2 = x.view(bs, -1)
    q_lora, kv_new = projections.down(x2, config.Q_proj_down_weight, config.KV_proj_down_weight)
    assert_task_rule(q_lora, bf(x2.double() @ config.Q_proj_down_weight.double().T), "q_lora")
    assert_task_rule(kv_new, bf(x2.double() @ config.KV_proj_down_weight.double().T), "new latent row")


@pytest.mark.parametrize("dev,bs,small", CASES)
def test_query_absorbs_into_the_attention_layout(dev, bs, small):
    config, _, _ = generate_input(batch_size=bs, prefill=0, max_seq_len=8, seed=200 + bs, device=dev, **small)
    H, nope, rope, r = config.n_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank
    g = torch.Generator(device=dev).manual_seed(bs)
    q_lora = bf(torch.randn(bs, config.q_lora_rank, generator=g, device=dev))
    w_uk = config.KV_proj_up_weight.view(H, nope + config.v_head_dim, r)[:, :nope]
    qbuf = torch.full((H, bs, r + rope), float("nan"), dtype=torch.bfloat16, device=dev)
    q_pe = projections.query(q_lora, config.Q_proj_up_weight, w_uk, qbuf)
    q = bf(q_lora.double() @ config.Q_proj_up_weight.double().T).view(bs, H, nope + rope)
    q_abs = bf(torch.einsum("bhn,hnr->bhr", q[..., :nope].double(), w_uk.double()))
    assert_task_rule(qbuf[:, :, :r].transpose(0, 1), q_abs, "absorbed q_nope")
    assert_task_rule(q_pe, q[..., nope:], "q_pe")
    assert torch.isnan(qbuf[:, :, r:]).all(), "query wrote the rope columns"


@pytest.mark.parametrize("dev,bs,small", CASES)
def test_rope_append_rotates_and_writes_only_the_new_row(dev, bs, small):
    config, _, kv = generate_input(batch_size=bs, prefill=0, max_seq_len=300, seed=300 + bs, device=dev, **small)
    H, rope, r = config.n_heads, config.qk_rope_head_dim, config.kv_lora_rank
    g = torch.Generator(device=dev).manual_seed(11 + bs)
    q_pe = bf(torch.randn(bs, H, rope + 5, generator=g, device=dev))[..., 5:]  # strided, as query returns it
    kv_new = bf(torch.randn(bs, 40 + r + rope, generator=g, device=dev))[:, 40:]
    lens = torch.randint(1, 301, (bs,), generator=g, device=dev).to(torch.int32)  # one position per sequence
    kv.data.fill_(float("nan"))
    tab = tables(300, rope, dev)
    pos = lens.long() - 1
    cos, sin = rope_cos_sin(pos, rope)
    want_q = rope_rotate(q_pe, cos[:, None], sin[:, None])
    results = []
    for kernel in ([False, True] if dev == "cuda" else [False]):
        qbuf = torch.full((H, bs, r + rope), float("nan"), dtype=torch.bfloat16, device=dev)
        cache = kv.data.clone()
        q_att = projections.rope_append(q_pe, kv_new, lens, tab, qbuf, cache, kernel=kernel)
        assert q_att.shape == (bs, 1, H, r + rope) and q_att.data_ptr() == qbuf.data_ptr()
        assert torch.equal(bits(q_att[:, 0, :, r:]), bits(want_q)), f"rotated q_pe (kernel={kernel})"
        assert torch.isnan(qbuf[:, :, :r]).all(), f"absorbed columns touched (kernel={kernel})"
        rows = cache[torch.arange(bs, device=dev), pos]
        assert torch.equal(bits(rows), bits(kv_new)), f"appended rows (kernel={kernel})"
        cache[torch.arange(bs, device=dev), pos] = float("nan")
        assert torch.isnan(cache).all(), f"rows other than the new one were written (kernel={kernel})"
        results.append(bits(q_att).clone())
    if len(results) == 2:
        assert torch.equal(results[0], results[1]), "kernel and PyTorch twin differ"


@pytest.mark.parametrize("dev,bs,small", CASES)
def test_rope_append_skips_positions_outside_the_cache(dev, bs, small):
    """A sequence of length 0 or past the cache's capacity is skipped (its
    query rope columns and cache untouched), by the kernel and the twin alike;
    the others are written as usual."""
    bs = max(bs, 3)
    config, _, kv = generate_input(batch_size=bs, prefill=0, max_seq_len=40, seed=400 + bs, device=dev, **small)
    H, rope, r = config.n_heads, config.qk_rope_head_dim, config.kv_lora_rank
    g = torch.Generator(device=dev).manual_seed(17 + bs)
    q_pe = bf(torch.randn(bs, H, rope, generator=g, device=dev))
    kv_new = bf(torch.randn(bs, r + rope, generator=g, device=dev))
    lens = torch.full((bs,), 7, dtype=torch.int32, device=dev)
    lens[0], lens[1] = 0, 41  # position -1, and one past the 40 rows
    tab = tables(40, rope, dev)
    for kernel in ([False, True] if dev == "cuda" else [False]):
        qbuf = torch.full((H, bs, r + rope), float("nan"), dtype=torch.bfloat16, device=dev)
        cache = torch.full_like(kv.data, float("nan"))
        projections.rope_append(q_pe, kv_new, lens, tab, qbuf, cache, kernel=kernel)
        assert torch.isnan(qbuf[:, :2]).all() and torch.isnan(cache[:2]).all(), f"skipped rows written ({kernel=})"
        assert torch.equal(bits(cache[2:, 6]), bits(kv_new[2:])), f"appended rows ({kernel=})"
        assert not torch.isnan(qbuf[:, 2:, r:]).any(), f"rotated q_pe ({kernel=})"


@needs_gpu
def test_rope_append_checks_its_inputs():
    q_pe = torch.zeros(2, 4, 64, dtype=torch.bfloat16, device="cuda")
    kv_new = torch.zeros(2, 576, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(2, 16, 576, dtype=torch.bfloat16, device="cuda")
    lens = torch.ones(2, dtype=torch.int32, device="cuda")
    cs = torch.zeros(16, 64, dtype=torch.bfloat16, device="cuda")
    op = torch.ops.mla_decode.rope_append
    with pytest.raises(ValueError, match="cover every cache position"):
        op(q_pe, kv_new, lens, cs[:8], q_pe.clone(), cache)
    with pytest.raises(ValueError, match=r"cache must have shape \[bs, max_seq_len, width\]"):
        op(q_pe, kv_new, lens, cs, q_pe.clone(), cache[:, :, :512])
    with pytest.raises(TypeError, match="seqlens"):
        op(q_pe, kv_new, lens.long(), cs, q_pe.clone(), cache)
    with pytest.raises(ValueError, match="rope even"):
        op(q_pe[..., :63], kv_new, lens, cs[:, :63], q_pe[..., :63].clone(), cache)


@pytest.mark.parametrize("dev,bs,small", CASES)
def test_output_from_a_given_o(dev, bs, small):
    config, _, _ = generate_input(batch_size=bs, prefill=0, max_seq_len=8, seed=400 + bs, device=dev, **small)
    H, nope, v, r = config.n_heads, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
    g = torch.Generator(device=dev).manual_seed(7 + bs)
    # o as the attention leaves it: [bs, 1, H, r] viewed [bs, H, r]
    o_lat = bf(torch.randn(bs, 1, H, r, generator=g, device=dev)).view(bs, H, r)
    w_uv_t = config.KV_proj_up_weight.view(H, nope + v, r)[:, nope:].transpose(1, 2)
    obuf = torch.full((bs, H, v), float("nan"), dtype=torch.bfloat16, device=dev)
    y = torch.full((bs, config.dim), float("nan"), dtype=torch.bfloat16, device=dev)
    out = projections.output(o_lat, w_uv_t, config.wo_weight, obuf, y)
    assert out.data_ptr() == y.data_ptr()
    ov = bf(torch.einsum("bhr,hrv->bhv", o_lat.double(), w_uv_t.double()))
    y_ref = bf(ov.reshape(bs, H * v).double() @ config.wo_weight.double().T)
    assert_task_rule(y, y_ref, "y")


def test_stages_take_parameter_weights_outside_no_grad():
    """The stage functions on nn.Parameter weights with autograd on: the
    same bits as on plain tensors, and no graph recorded."""
    small = dict(dim=256, q_lora_rank=96, n_heads=4, kv_lora_rank=64, nope=32, rope=16, v=24)
    config, x, _ = generate_input(batch_size=3, prefill=0, max_seq_len=8, seed=7, **small)
    H, nope, r, v = config.n_heads, config.qk_nope_head_dim, config.kv_lora_rank, config.v_head_dim
    x2 = x.view(3, -1)
    results = []
    for wrap in (lambda w: w, torch.nn.Parameter):
        w = {n: wrap(getattr(config, n).clone()) for n in ("Q_proj_down_weight", "KV_proj_down_weight",
                                                            "Q_proj_up_weight", "KV_proj_up_weight", "wo_weight")}
        q_lora, kv_new = projections.down(x2, w["Q_proj_down_weight"], w["KV_proj_down_weight"])
        wkv = w["KV_proj_up_weight"].view(H, nope + v, r)
        qbuf = torch.zeros(H, 3, r + config.qk_rope_head_dim, dtype=torch.bfloat16)
        q_pe = projections.query(q_lora, w["Q_proj_up_weight"], wkv[:, :nope], qbuf)
        obuf, y = torch.empty(3, H, v, dtype=torch.bfloat16), torch.empty(3, config.dim, dtype=torch.bfloat16)
        projections.output(qbuf[:, :, :r].transpose(0, 1), wkv[:, nope:].transpose(1, 2), w["wo_weight"], obuf, y)
        outs = (q_lora, kv_new, q_pe, qbuf, y)
        assert not any(t.requires_grad for t in outs)
        results.append(outs)
    for a, b in zip(*results):
        assert torch.equal(bits(a), bits(b))


def test_stage_weight_bytes_match_the_weights():
    small = dict(dim=64, q_lora_rank=32, n_heads=2, kv_lora_rank=16, nope=8, rope=4, v=8)
    config, _, _ = generate_input(batch_size=1, prefill=0, max_seq_len=8, device="cpu", **small)
    d = mla_decode.Dims(1, 64, 2, 32, 16, 8, 4, 8, 8)
    b = projections.stage_weight_bytes(d)
    wkv = config.KV_proj_up_weight.numel() * 2
    assert b["down"] == (config.Q_proj_down_weight.numel() + config.KV_proj_down_weight.numel()) * 2
    assert b["query"] + b["output"] == (config.Q_proj_up_weight.numel() + config.wo_weight.numel()) * 2 + wkv
