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
