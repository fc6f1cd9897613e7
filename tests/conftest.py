import math
import os
import socket

import pytest
import torch

import mla_decode
from mla_decode.reference import generate_input

# the task's acceptance rule (docs/architecture.md): |out - ref| <= ATOL + RTOL * |ref|, NaN/inf positions identical
ATOL, RTOL = 8e-3, 2e-2

GPU_REASON = f"needs a GPU with the compiled kernels: {mla_decode.backend('cuda')}"
needs_gpu = pytest.mark.skipif(not mla_decode.kernels_usable("cuda"), reason=GPU_REASON)


def gpus(n):
    """Skip unless n GPUs with the compiled kernels are visible (the reason says how many are)."""
    return pytest.mark.skipif(
        not (mla_decode.kernels_usable("cuda") and torch.cuda.device_count() >= n),
        reason=f"needs {n} GPUs with the compiled kernels (visible: "
               f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}; {mla_decode.backend('cuda')})")


def load_plan_model():
    """tools/plan_model.py (the split planner modelled on the CPU; tools/ is not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "plan_model", os.path.join(os.path.dirname(__file__), "..", "tools", "plan_model.py"))
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    return model


def free_port():
    """A free TCP port on 127.0.0.1 for a spawned process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank, world, port, dist_backend, device_kind):
    """A spawned test process's setup: NVLink multicast off, its GPU current
    (device_kind "cuda": rank r on cuda:r), the process group joined. Returns
    its device ("cpu" or "cuda:r")."""
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    device = "cpu" if device_kind == "cpu" else f"cuda:{rank}"
    if device != "cpu":
        torch.cuda.set_device(rank)
    dist.init_process_group(dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return device

SMALL = dict(dim=96, q_lora_rank=48, n_heads=4, kv_lora_rank=32, nope=16, rope=8, v=24, max_seq_len=64)


def assert_task_rule(out, ref, name="output", atol=ATOL, rtol=RTOL):
    """The task checker: element-wise tolerance and identical non-finite positions."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o, r = out.double(), ref.double()
    for kind, fn in (("NaN", torch.isnan), ("+inf", lambda t: t == math.inf), ("-inf", lambda t: t == -math.inf)):
        assert torch.equal(fn(o), fn(r)), f"{name}: {kind} positions differ"
    fin = torch.isfinite(r)
    err = (o[fin] - r[fin]).abs()
    lim = atol + rtol * r[fin].abs()
    bad = (err > lim).sum().item()
    assert bad == 0, (f"{name}: {bad} of {fin.sum().item()} elements outside the task tolerance; "
                      f"max excess {(err - lim).max().item():.3g}, max abs err {err.max().item():.3g}")


def assert_drift(out, ref, ref64, name="y", factor=1.5):
    """Tighter than the task rule and independent of the reference's own
    rounding luck: against a float64 evaluation, our relative (Frobenius)
    error must stay within `factor` times the literal bf16 reference's."""
    ours, theirs = rel_err(out, ref64), rel_err(ref, ref64)
    assert ours <= factor * theirs + 1e-4, (
        f"{name}: relative error {ours:.3e} against float64, the bf16 reference has {theirs:.3e} (allowed x{factor})")


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture
def small_input():
    def make(bs=3, prefill=5, seed=0, device="cpu", **over):
        kw = dict(SMALL)
        kw.update(over)
        return generate_input(batch_size=bs, prefill=prefill, seed=seed, device=device, **kw)
    return make


@pytest.fixture
def gemm_env(monkeypatch):
    """set(value): MLA_DECODE_GEMM set (None: unset) and the kernel choice
    re-read; put back after the test."""
    from mla_decode import kernel_choice

    def set_mode(value):
        if value is None:
            monkeypatch.delenv("MLA_DECODE_GEMM", raising=False)
        else:
            monkeypatch.setenv("MLA_DECODE_GEMM", value)
        kernel_choice.reload_settings()

    yield set_mode
    monkeypatch.undo()
    kernel_choice.reload_settings()
