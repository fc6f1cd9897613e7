"""Bad input raises a clear exception naming what was expected, and leaves the cache untouched."""

import dataclasses

import pytest
import torch

import mla_decode
from mla_decode import MLAInputError


def call_and_check_untouched(config, x, kv, exc, match):
    before, seq = kv.data.clone(), kv.seq_len
    with pytest.raises(exc, match=match):
        mla_decode.MLADecoder(backend="torch")(config, x, kv)
    assert torch.equal(kv.data, before), "the cache changed on a failed call"
    assert kv.seq_len == seq


def test_x_dtype(small_input):
    config, x, kv = small_input()
    call_and_check_untouched(config, x.float(), kv, TypeError, r"x must be torch.bfloat16, got torch.float32")


def test_x_shape(small_input):
    config, x, kv = small_input()
    call_and_check_untouched(config, x.view(x.shape[0], -1)[:, :-1].reshape(x.shape[0], 1, -1).contiguous(), kv,
                             MLAInputError, r"x must have shape \[bs, 1, 96\] with bs >= 1, got \[3, 1, 95\]")
    call_and_check_untouched(config, torch.cat([x, x], 1), kv, MLAInputError, r"x must have shape \[bs, 1, 96\]")


@pytest.mark.parametrize("name,expect", [
    ("Q_proj_down_weight", r"\[q_lora_rank, dim\] = \[48, 96\]"),
    ("KV_proj_down_weight", r"\[kv_lora_rank \+ rope, dim\] = \[40, 96\]"),
    ("Q_proj_up_weight", r"\[n_heads \* \(nope \+ rope\), q_lora_rank\] = \[96, 48\]"),
    ("KV_proj_up_weight", r"\[n_heads \* \(nope \+ v\), kv_lora_rank\] = \[160, 32\]"),
    ("wo_weight", r"\[dim, n_heads \* v\] = \[96, 96\]"),
])
def test_weight_shapes(small_input, name, expect):
    config, x, kv = small_input()
    w = getattr(config, name)
    bad = dataclasses.replace(config, **{name: w[:-1].contiguous()})
    call_and_check_untouched(bad, x, kv, MLAInputError, f"config.{name} must have shape {expect}")


def test_weight_dtype(small_input):
    config, x, kv = small_input()
    bad = dataclasses.replace(config, wo_weight=config.wo_weight.half())
    call_and_check_untouched(bad, x, kv, TypeError, r"config.wo_weight must be torch.bfloat16, got torch.float16")


def test_weight_on_another_device(small_input):
    config, x, kv = small_input()
    bad = dataclasses.replace(config, Q_proj_up_weight=config.Q_proj_up_weight.to("meta"))
    call_and_check_untouched(bad, x, kv, MLAInputError, r"config.Q_proj_up_weight must be on cpu \(where x is\), got meta")


def test_weight_not_contiguous(small_input):
    config, x, kv = small_input()
    w = config.wo_weight
    strided = torch.empty(w.shape[0], w.shape[1] * 2, dtype=w.dtype)[:, ::2]
    strided.copy_(w)
    bad = dataclasses.replace(config, wo_weight=strided)
    call_and_check_untouched(bad, x, kv, MLAInputError, r"config.wo_weight must be contiguous in its last dimension")
    t = torch.empty(w.shape[1], w.shape[0], dtype=w.dtype).T
    t.copy_(w)
    bad = dataclasses.replace(config, wo_weight=t)
    call_and_check_untouched(bad, x, kv, MLAInputError, r"config.wo_weight must be contiguous")


def test_x_not_contiguous(small_input):
    config, x, kv = small_input()
    xs = torch.empty(x.shape[0], 2, x.shape[2], dtype=x.dtype)[:, :1]
    xs.copy_(x)
    xs = torch.empty(x.shape[0], 1, x.shape[2] * 2, dtype=x.dtype)[:, :, ::2]
    xs.copy_(x)
    call_and_check_untouched(config, xs, kv, MLAInputError, r"x must be contiguous")


def test_cache_width(small_input):
    config, x, kv = small_input()
    kv.data = torch.zeros(3, 64, 41, dtype=torch.bfloat16)
    call_and_check_untouched(config, x, kv, MLAInputError,
                             r"kv_cache.data must have shape \[bs=3, max_seq_len, kv_lora_rank \+ rope = 40\]")


def test_cache_batch(small_input):
    config, x, kv = small_input()
    kv.data = kv.data[:2].clone()
    call_and_check_untouched(config, x, kv, MLAInputError, r"x's batch \(3\) differs from kv_cache.data's \(2\)")


def test_x_batch_differs_from_the_cache(small_input):
    config, x, kv = small_input()
    call_and_check_untouched(config, x[:1].contiguous(), kv, MLAInputError,
                             r"x's batch \(1\) differs from kv_cache.data's \(3\): .*got x \[1, 1, 96\] and kv_cache.data "
                             r"\[3, 64, 40\]")


def test_cache_dtype(small_input):
    config, x, kv = small_input()
    kv.data = kv.data.float()
    call_and_check_untouched(config, x, kv, TypeError, r"kv_cache.data must be torch.bfloat16, got torch.float32")


def test_cache_full(small_input):
    config, x, kv = small_input(prefill=64)
    call_and_check_untouched(config, x, kv, MLAInputError, r"kv_cache is full: seq_len 64 leaves no row free in max_seq_len 64")


def test_cache_with_shared_rows(small_input):
    """A cache whose sequences (or rows) share memory, such as an expanded
    prefix, would have every sequence's new row land in one place: refused."""
    config, x, kv = small_input()
    base = kv.data[:1].clone()
    kv.data = base.expand(3, -1, -1)
    call_and_check_untouched(config, x, kv, MLAInputError, r"kv_cache.data must give every sequence and row memory "
                                                           r"of its own .* strides \(0, 40, 1\)")
    kv.data = torch.zeros(3, 1, 40, dtype=torch.bfloat16).expand(3, 64, 40)  # (rows shared, sequences apart)
    call_and_check_untouched(config, x, kv, MLAInputError, r"memory of its own.* strides \(40, 0, 1\)")


def test_cache_not_contiguous_last_dim(small_input):
    config, x, kv = small_input()
    big = torch.zeros(3, 64, 80, dtype=torch.bfloat16)[:, :, ::2]
    big.copy_(kv.data)
    kv.data = big
    call_and_check_untouched(config, x, kv, MLAInputError, r"kv_cache.data must be contiguous in its last dimension")


def test_bad_seq_len(small_input):
    config, x, kv = small_input()
    kv.seq_len = -1
    call_and_check_untouched(config, x, kv, MLAInputError, r"kv_cache.seq_len must be a non-negative int, got -1")


def test_bad_backend_name():
    with pytest.raises(ValueError, match="backend must be"):
        mla_decode.MLADecoder(backend="fast")


def test_kernels_backend_refuses_clearly_without_kernels(small_input):
    config, x, kv = small_input()
    before = kv.data.clone()
    with pytest.raises(RuntimeError, match="backend='kernels' requested but not usable"):
        mla_decode.MLADecoder(backend="kernels")(config, x, kv)
    assert torch.equal(kv.data, before) and kv.seq_len == 5


@pytest.mark.parametrize("swap,exc,match", [
    (lambda w: w.float(), TypeError, r"config.wo_weight must be torch.bfloat16"),
    (lambda w: w[:, :-1].contiguous(), MLAInputError, r"config.wo_weight must have shape \[dim, n_heads \* v\]"),
    (lambda w: w.t().contiguous().t(), MLAInputError, r"config.wo_weight must be contiguous"),
])
def test_weights_checked_again_after_a_swap_behind_the_same_object(small_input, swap, exc, match):
    """The decoder skips re-checking weights whose layouts (address, shape,
    strides, dtype, device) are the last good call's; a weight whose storage
    was swapped through ``.data`` (same object, same version counter) must
    be checked again and refused."""
    config, x, kv = small_input()
    dec = mla_decode.MLADecoder(backend="torch")
    dec(config, x, kv)  # a good call: the decoder now vouches for these weights
    config.wo_weight.data = swap(config.wo_weight.data)
    before, seq = kv.data.clone(), kv.seq_len
    with pytest.raises(exc, match=match):
        dec(config, x, kv)
    assert torch.equal(kv.data, before) and kv.seq_len == seq


@pytest.mark.parametrize("d,dv,match", [
    (512, 512, r"head dim d=512 with head_dim_v=512 \(rope width d - dv = 0\)"),
    (576, 256, r"head dim d=576 with head_dim_v=256 \(rope width d - dv = 320\)"),
    (200, 192, r"head dim d=200 with head_dim_v=192 \(rope width d - dv = 8\)"),
])
def test_attention_shape_refused_with_the_supported_list(d, dv, match):
    """An unsupported (d, dv) raises before anything needs a GPU, and the
    message lists what is supported."""
    q = torch.zeros(1, 1, 8, d, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match + r".*supported: value width dv in \{64, 128, 256, 512\} with rope "
                                                 r"width in \{8, 16, 32, 64\}"):
        mla_decode.mla_attention(q, q, torch.zeros(1, dtype=torch.int32), 0.1, head_dim_v=dv)
    with pytest.raises(ValueError, match=match):
        mla_decode.flash_mla_with_kvcache(q, q, None, torch.zeros(1, dtype=torch.int32), dv, None, None)


@pytest.mark.parametrize("dv", [64, 128, 256, 512])
@pytest.mark.parametrize("rope", [8, 16, 32, 64])
def test_attention_shape_accepted(dv, rope):
    from mla_decode.attention import check_attention_shape

    assert check_attention_shape(dv + rope, dv) == rope


@pytest.mark.skipif(not mla_decode._ext.kernels_built(), reason="the extension is not built")
def test_lean_replay_declines_what_it_does_not_match():
    """mla_decode._C.fast_step (custom_kernel's lean replay) returns None, with
    nothing written, for anything but a call matching a captured GPU step:
    here CPU tensors and objects that are not the task's."""
    from mla_decode.reference import generate_input
    fast = mla_decode._ext.module().fast_step
    config, x, kv = generate_input(batch_size=2, prefill=3, dim=64, q_lora_rank=32, n_heads=2, max_seq_len=8)
    before = kv.data.clone()
    for data in [(config, x, kv), (config, x), None, (1, 2, 3), (config, x, object()), [config, x, kv]]:
        assert fast(data) is None
    assert kv.seq_len == 3 and torch.equal(kv.data, before)
    y, _ = mla_decode.custom_kernel((config, x, kv))  # (the checked path: the CPU fallback)
    assert kv.seq_len == 4 and y.shape == (2, 1, 64)


@pytest.mark.skipif(not mla_decode._ext.kernels_built(), reason="the extension is not built")
def test_plan_and_attention_trace_with_fake_tensors():
    """torch.compile's tracing sees through the ops: the plan (a length that
    depends on the GPU, so data-dependent for the tracer) feeding the
    attention traces without a GPU or real data."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def step(seqlens, q, kv):
        plan = torch.ops.mla_decode.plan(seqlens, 1, q.shape[2], kv.shape[1])
        return torch.ops.mla_decode.attention(q, kv, seqlens, None, None, 0.1, False, None, 512, None, plan, True)

    seqlens = torch.full((4,), 10, dtype=torch.int32)
    q = torch.zeros(4, 1, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    graph = make_fx(step, tracing_mode="symbolic")(seqlens, q, kv)
    called = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert torch.ops.mla_decode.plan.default in called and torch.ops.mla_decode.attention.default in called

    def step_fp8(seqlens, q, kv8):  # an fp8 cache: kv_scale, the schema's last argument, reaches the fake too
        return torch.ops.mla_decode.attention(q, kv8, seqlens, None, None, 0.1, False, None, 512, None, None, True, 0.5)

    from mla_decode.fp8 import FP8_KV_DTYPE

    kv8 = torch.zeros(4, 64, 576).to(FP8_KV_DTYPE)
    graph = make_fx(step_fp8, tracing_mode="symbolic")(seqlens, q, kv8)
    assert torch.ops.mla_decode.attention.default in [n.target for n in graph.graph.nodes if n.op == "call_function"]


@pytest.mark.skipif(not mla_decode._ext.kernels_built(), reason="the extension is not built")
def test_serving_metadata_traces_with_its_split_count_known():
    """get_mla_metadata's num_splits is [b + 1] to a tracer, as flash_mla_with_kvcache checks it: on CPU
    tensors (no GPU to ask its SM count) the plan's length is data-dependent, but the fake says it holds at
    least the 2 + 2 b ints num_splits is sliced from
    (without that bound the check `num_splits.shape != (b + 1,)` cannot be decided while tracing:
    "Could not guard on data-dependent expression")."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from mla_decode.serving import _num_splits

    def meta(seqlens):
        plan = torch.ops.mla_decode.plan(seqlens, 1, 128, 2 ** 31 - 1)
        num_splits = _num_splits(plan, seqlens.shape[0])
        if num_splits.shape != (seqlens.shape[0] + 1,):  # (flash_mla_with_kvcache's check)
            raise AssertionError(f"num_splits {num_splits.shape}")
        return plan, num_splits

    seqlens = torch.full((8,), 10, dtype=torch.int32)
    make_fx(meta, tracing_mode="symbolic")(seqlens)
    # torch.compile with the batch static, as a first compile traces it; a backend that keeps the graph and
    # runs nothing (these ops have no CPU kernels)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        n = len(next(iter(gm.graph.find_nodes(op="output"))).args[0])
        return lambda *args: [None] * n

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch.compile(meta, fullgraph=True, backend=keep, dynamic=False)(seqlens)
    assert len(graphs) == 1
