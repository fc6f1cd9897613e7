"""The PyTorch fallback against the literal reference, the cache contract and
a decode loop. Runs on the CPU everywhere (and on the GPU where one exists,
through the fallback backend)."""

import warnings

import pytest
import torch

import mla_decode
from mla_decode.reference import decode_step_float64, generate_input, ref_kernel

from conftest import SMALL, assert_drift, assert_task_rule


def run_both(config, x, kv, backend="torch"):
    kv_ref = kv.clone()
    y_ref, data_ref = ref_kernel((config, x, kv_ref))
    dec = mla_decode.MLADecoder(backend=backend)
    y, data = dec(config, x, kv)
    return y, data, y_ref, data_ref, kv_ref, dec


@pytest.mark.parametrize("over", [
    {},
    dict(n_heads=2, nope=8, rope=4, v=8),
    dict(n_heads=8, kv_lora_rank=64, rope=16, v=32),
    dict(dim=128, q_lora_rank=64, n_heads=3, nope=32, rope=32, v=16),
])
@pytest.mark.parametrize("bs,prefill", [(1, 40), (3, 60), (2, 62)])
def test_fallback_matches_reference_small(small_input, over, bs, prefill):
    config, x, kv = small_input(bs=bs, prefill=prefill, seed=bs * 100 + prefill, **over)
    y, data, y_ref, data_ref, kv_ref, _ = run_both(config, x, kv)
    assert_task_rule(y, y_ref, "y")
    assert_task_rule(data, data_ref, "cache")
    assert kv.seq_len == kv_ref.seq_len == prefill + 1
    assert_drift(y, y_ref, decode_step_float64(config, x, data_ref, kv_ref.seq_len))


@pytest.mark.parametrize("bs,prefill", [(1, 0), (3, 1), (2, 5)])
def test_fallback_short_sequences_against_float64(small_input, bs, prefill):
    # With a handful of keys y is O(1) and the task's bf16 chain itself strays
    # near (sometimes past) its own tolerance against float64, so two correct
    # implementations need not agree under the task rule here: judge by the
    # error against float64, relative to the reference's own.
    config, x, kv = small_input(bs=bs, prefill=prefill, seed=bs + 10 * prefill)
    y, data, y_ref, data_ref, kv_ref, _ = run_both(config, x, kv)
    assert torch.equal(data[:, :prefill], data_ref[:, :prefill])
    assert_task_rule(data, data_ref, "cache")
    assert_drift(y, y_ref, decode_step_float64(config, x, data_ref, kv_ref.seq_len))


@pytest.mark.parametrize("bs,prefill", [(1, 100), (2, 130)])
def test_fallback_matches_reference_real_dims(bs, prefill):
    config, x, kv = generate_input(batch_size=bs, prefill=prefill, max_seq_len=160, seed=7 + bs)
    y, data, y_ref, data_ref, kv_ref, _ = run_both(config, x, kv)
    assert_task_rule(y, y_ref, "y")
    assert_task_rule(data, data_ref, "cache")
    assert_drift(y, y_ref, decode_step_float64(config, x, data_ref, kv_ref.seq_len))


def test_wo_scaled_by_dim(small_input):
    config, x, kv = small_input(bs=2, prefill=50, wo_scale="dim")
    y, data, y_ref, data_ref, _, _ = run_both(config, x, kv)
    assert_task_rule(y, y_ref, "y")


def test_cache_contract(small_input):
    config, x, kv = small_input(bs=3, prefill=6)
    buf = kv.data
    before = buf.clone()
    y, data = mla_decode.MLADecoder(backend="torch")(config, x, kv)
    assert data is buf and kv.data is buf, "the returned cache must be the caller's buffer"
    assert kv.seq_len == 7
    assert y.shape == (3, 1, SMALL["dim"]) and y.dtype == torch.bfloat16
    assert torch.equal(data[:, :6], before[:, :6]), "rows before seq_len changed"
    assert torch.equal(data[:, 7:], before[:, 7:]), "rows after the new one changed"
    kv_new = x.view(3, -1) @ config.KV_proj_down_weight.T
    assert_task_rule(data[:, 6], kv_new, "new row")
    assert not torch.equal(data[:, 6], before[:, 6])


def test_decode_loop(small_input):
    config, x, kv = small_input(bs=2, prefill=40, max_seq_len=64)
    kv_ref = kv.clone()
    dec = mla_decode.MLADecoder(backend="torch")
    gen = torch.Generator().manual_seed(5)
    for step in range(8):
        x = torch.randn(x.shape, generator=gen).to(torch.bfloat16)
        y_ref, _ = ref_kernel((config, x, kv_ref))
        y, _ = dec(config, x, kv)
        assert_task_rule(y, y_ref, f"y at step {step}")
        assert_task_rule(kv.data, kv_ref.data, f"cache at step {step}")
        assert kv.seq_len == kv_ref.seq_len == 41 + step


def test_fill_to_the_last_row_then_full(small_input):
    config, x, kv = small_input(bs=1, prefill=14, max_seq_len=16)
    dec = mla_decode.MLADecoder(backend="torch")
    dec(config, x, kv)
    dec(config, x, kv)
    assert kv.seq_len == 16
    before = kv.data.clone()
    with pytest.raises(mla_decode.MLAInputError, match="full"):
        dec(config, x, kv)
    assert torch.equal(kv.data, before) and kv.seq_len == 16


def test_weights_changed_in_place_are_not_served_stale(small_input):
    config, x, kv = small_input(bs=2, prefill=40)
    dec = mla_decode.MLADecoder(backend="torch")
    kv2, kv_ref = kv.clone(), kv.clone()
    y_old, _ = dec(config, x, kv)
    with torch.no_grad():
        config.KV_proj_up_weight.mul_(-1.5)  # in place: same object, new version
    y, _ = dec(config, x, kv2)
    y_ref, _ = ref_kernel((config, x, kv_ref))
    assert not torch.equal(y, y_old)
    assert_task_rule(y, y_ref, "y after an in-place weight change")


def test_new_weight_objects(small_input):
    config, x, kv = small_input(bs=2, prefill=40)
    dec = mla_decode.MLADecoder(backend="torch")
    dec(config, x, kv.clone())
    config.wo_weight = -config.wo_weight  # a new object (negation is exact)
    kv_a = kv.clone()
    y, _ = dec(config, x, kv_a)
    y_ref, _ = ref_kernel((config, x, kv.clone()))
    assert_task_rule(y, y_ref, "y with new weights")


def test_custom_kernel_entry_point(small_input):
    config, x, kv = small_input(bs=2, prefill=40)
    kv_ref = kv.clone()
    y, data = mla_decode.custom_kernel((config, x, kv))
    y_ref, data_ref = ref_kernel((config, x, kv_ref))
    assert data is kv.data
    assert_task_rule(y, y_ref, "y")
    assert_task_rule(data, data_ref, "cache")


def test_cache_made_under_inference_mode_stepped_outside_it(small_input):
    """A cache (and inputs) made under torch.inference_mode() and stepped
    outside it: the fallback writes it as the kernels would, in any mode."""
    config, x, kv = small_input(bs=2, prefill=10)
    kv_ref = kv.clone()
    with torch.inference_mode():
        kv.data = kv.data.clone()
    assert kv.data.is_inference()
    y, data = mla_decode.MLADecoder(backend="torch")(config, x, kv)
    y_ref, data_ref = ref_kernel((config, x, kv_ref))
    assert_task_rule(y, y_ref, "y")
    assert torch.equal(data, data_ref) and kv.seq_len == 11
    assert not y.is_inference()  # (an ordinary tensor, as the kernels return: only the cache write ran in inference mode)
    y.add_(0)


def test_cublaslt_is_never_asked_of_a_missing_extension(monkeypatch):
    """The output stage asks for cuBLASLt only where the extension (which
    holds that call) is built: the fallback on a CUDA machine without it
    takes PyTorch's product."""
    from mla_decode import _ext, kernel_choice

    gpu_like = type("GpuLike", (), {"is_cuda": True})()
    monkeypatch.setattr(_ext, "_C", None)
    assert not kernel_choice.blas_lt_path(gpu_like)


def test_outgrown_rope_tables_live_until_release_cached():
    """A longer cache replaces the RoPE table with a longer one; the old one
    stays alive (a captured graph may read it) until release_cached()."""
    import gc
    import weakref

    from mla_decode.decoder import rope_tables

    mla_decode.release_cached()
    old = rope_tables(torch.device("cpu"), 8, 100)
    assert old[0].shape == (128, 8)  # (a power of two)
    gone = [weakref.ref(t) for t in old]
    del old
    new = rope_tables(torch.device("cpu"), 8, 1000)
    assert new[0].shape == (1024, 8)
    gc.collect()
    assert all(w() is not None for w in gone)
    mla_decode.release_cached()
    gc.collect()
    assert all(w() is None for w in gone)


def test_fallback_warnings_of_the_dcp_code_come_once_per_place_and_only_for_gpus():
    from mla_decode.dcp import warn_fallback

    with pytest.warns(RuntimeWarning, match="mla_decode: test_place runs the PyTorch backend on cuda:7: why"):
        warn_fallback("test_place", torch.device("cuda", 7), "why")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_fallback("test_place", torch.device("cuda", 7), "why")  # (said already)
        warn_fallback("test_place", torch.device("cpu"), "why")  # (the CPU's own path: nothing to say)


def test_backend_is_named():
    text = mla_decode.backend("cpu")
    assert text.startswith("torch-fallback (") and len(text) > 20


def test_the_step_kernels_sizes_are_named_in_one_place():
    # decoder.py and dcp_step.py both ask kernel_choice whether the step's kernels take these sizes
    from types import SimpleNamespace

    from mla_decode import kernel_choice
    assert kernel_choice.step_sizes_refused(SimpleNamespace(kv_lora=512, rope=64)) is None
    why = kernel_choice.step_sizes_refused(SimpleNamespace(kv_lora=256, rope=64))
    assert why is not None and "kv_lora_rank=256" in why and "512 and 64" in why
    assert kernel_choice.step_sizes_refused(SimpleNamespace(kv_lora=512, rope=32)) is not None


def test_the_step_backend_is_decided_in_one_place():
    # MLADecoder and DCPDecoder both take kernel_choice.step_backend's answer: auto falls back with the reason,
    # "kernels" raises RuntimeError naming it (the kernels not usable, or sizes they do not take), "torch" is kept
    from types import SimpleNamespace

    from mla_decode import kernel_choice
    cpu, ok, odd = torch.device("cpu"), SimpleNamespace(kv_lora=512, rope=64), SimpleNamespace(kv_lora=256, rope=64)
    assert kernel_choice.step_backend("torch", odd, False, cpu) == ("torch", None)
    assert kernel_choice.step_backend("auto", ok, True, cpu) == ("kernels", None)
    assert kernel_choice.step_backend("kernels", ok, True, cpu) == ("kernels", None)
    which, why = kernel_choice.step_backend("auto", odd, True, cpu)
    assert which == "torch" and "kv_lora_rank=256" in why
    which, why = kernel_choice.step_backend("auto", ok, False, cpu)
    assert which == "torch" and why == mla_decode.backend(cpu)
    with pytest.raises(RuntimeError, match="backend='kernels' requested but not usable: kv_lora_rank=256"):
        kernel_choice.step_backend("kernels", odd, True, cpu)
    with pytest.raises(RuntimeError, match="backend='kernels' requested but not usable: torch-fallback"):
        kernel_choice.step_backend("kernels", ok, False, cpu)
