"""Which kernel runs each product, decided in one place.

The environment is read once, at import (``reload_settings()`` reads it
again, for tests and benchmarks that switch it):

- ``MLA_DECODE_GEMM``: unset: the down-projection on our Hopper GEMM and the
  query on our fused Hopper kernel where they run, every other product on
  the vendor BLAS; ``vendor``: every product on the vendor BLAS; ``sm90``:
  the stage functions of mla_decode.projections put every product they can
  on the Hopper GEMM (a measurement switch; the decode step keeps its
  default choice for W_UV and wo).
- ``MLA_DECODE_BLASLT=0``: the decode step's W_UV and wo (the stage
  functions' wo) on PyTorch's default BLAS
  instead of cuBLASLt.
- The attention kernel (Hopper or portable) is chosen by the extension
  (``MLA_DECODE_ATTN_KERNEL=portable|hopper`` overrides it there);
  ``attention_kernel(device)`` says which.

Every ``*_path`` function returns "sm90" (ours) or "vendor: <why>", so a
slower path is never taken silently. docs/projections.md has the
measurements behind the defaults.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass

import torch

from . import _ext

__all__ = ["Settings", "settings", "reload_settings", "hopper", "sm_count", "attention_kernel", "gemm_path",
           "query_path", "blas_lt_path", "step_want", "step_bit", "describe_step_paths", "STEP_KV_LORA", "STEP_ROPE",
           "step_sizes_refused", "step_backend"]

# the latent and rope widths the decode step's kernels are built for (the extension's decode_step checks them too)
STEP_KV_LORA, STEP_ROPE = 512, 64


def step_bit(name: str) -> int:
    """The decode step's path bit ``name``, as the extension defines it
    (``mla_decode._C.step_bits()``, csrc/api/ops.h): what ``decode_step``'s
    ``want`` asks for (down_own, query_fused, wo_lt) and what its report says
    ran (those, and graph: the call replayed the step's captured graph;
    captured: it ran eagerly, then captured the step for the next call to
    replay; plan_in_query: the fused query wrote the attention's lengths and
    plan, no planner kernel). Needs the built extension (only kernel steps
    have paths)."""
    return _step_bits()[name]


@functools.cache
def _step_bits() -> dict:
    return dict(_ext.module().step_bits())  # (fixed for the process: read once)


def step_sizes_refused(dims) -> str | None:
    """None where the decode step's kernels take these sizes (validate's Dims), else why not."""
    if dims.kv_lora == STEP_KV_LORA and dims.rope == STEP_ROPE:
        return None
    return f"kv_lora_rank={dims.kv_lora}, rope={dims.rope} (the kernels take {STEP_KV_LORA} and {STEP_ROPE})"


def step_backend(backend: str, dims, usable: bool | None = None, device=None) -> tuple[str, str | None]:
    """The backend a decode step (MLADecoder, DCPDecoder) takes: ``("kernels",
    None)`` where the kernels are usable on ``device`` (``usable``: given, or
    ``_ext.kernels_usable(device)`` asked here) and take these sizes, else
    ``("torch", why)`` for ``backend="auto"`` (the caller warns) and
    ``RuntimeError`` naming why for ``backend="kernels"``;
    ``backend="torch"`` gives ``("torch", None)``."""
    if backend == "torch":
        return "torch", None
    if usable is None:
        usable = _ext.kernels_usable(device)
    refused = step_sizes_refused(dims)
    if usable and refused is None:
        return "kernels", None
    why = refused if usable else _ext.backend(device)
    if backend == "kernels":
        raise RuntimeError(f"backend='kernels' requested but not usable: {why}")
    return "torch", why


@dataclass(frozen=True)
class Settings:
    gemm: str  # "", "vendor" or "sm90"
    blaslt: bool

    @staticmethod
    def from_env() -> "Settings":
        gemm = os.environ.get("MLA_DECODE_GEMM", "")
        if gemm not in ("", "vendor", "sm90"):
            raise ValueError(f"MLA_DECODE_GEMM must be unset, 'vendor' or 'sm90', got {gemm!r}")
        return Settings(gemm=gemm, blaslt=os.environ.get("MLA_DECODE_BLASLT") != "0")


_settings = Settings.from_env()
_lock = threading.Lock()
_device_facts = {}  # device index -> (hopper kernels run there, SM count)
_want = {}          # (settings, device index, sizes) -> the step's want bits


def settings() -> Settings:
    return _settings


def reload_settings() -> Settings:
    """Read the environment again (the choices made since are recomputed):
    the decoders choose anew, and the captured steps and the choices
    registered for the lean path, made under the old settings, are dropped."""
    global _settings
    with _lock:
        _settings = Settings.from_env()
        _want.clear()
    if _ext.kernels_built():
        _ext.module().release_cached()  # (the captured steps; their replays would run the old paths)
        _ext.module().clear_step_plans()  # (the lean path's registry lives in the Python module's C++ part,
        # which CMake's libtorch library leaves out: not part of release_cached)
    return _settings


def _facts(device):
    idx = _ext.device_index(device)
    f = _device_facts.get(idx)
    if f is None:
        info = _ext.attention_info(idx)
        f = (info.kernel == "hopper", info.sms)
        with _lock:
            _device_facts[idx] = f
    return f


def hopper(device) -> bool:
    """True where our Hopper kernels run: an sm_90a build on a compute 9.x GPU."""
    try:
        return _facts(device)[0]
    except RuntimeError:  # the kernels cannot run on this device: the vendor paths
        return False


def sm_count(device) -> int:
    return _facts(device)[1]


def attention_kernel(device) -> str:
    """"hopper" or "portable": the attention kernel the extension runs on device."""
    return _ext.attention_info(_ext.device_index(device)).kernel


def _aligned(t) -> bool:
    return t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1])


def _hopper_unusable(device, tensors, what):
    """Why our Hopper kernel `what` cannot run on these bf16 operands here
    ("vendor: ..."), or None."""
    if not _ext.kernels_usable(device):
        return "vendor: " + _ext.backend(device)
    if not hopper(device):
        return f"vendor: the {what} is Hopper-only (sm_90a build on a compute 9.x GPU)"
    if any(t.dtype != torch.bfloat16 for t in tensors):
        return "vendor: bf16 only"
    return None


def gemm_path(x, w, y=None, own=False) -> str:
    """"sm90" when mla_decode.projections.gemm runs x w^T on our Hopper GEMM,
    else "vendor: why". ``own``: a product that takes ours by default (the
    down stage); the others only with MLA_DECODE_GEMM=sm90."""
    mode = _settings.gemm
    if mode == "vendor":
        return "vendor: MLA_DECODE_GEMM=vendor"
    if mode != "sm90" and not own:
        return "vendor: the default for this product (MLA_DECODE_GEMM=sm90 puts every product on the Hopper GEMM)"
    why = _hopper_unusable(x.device, (x, w), "skinny GEMM")
    if why is not None:
        return why
    why = _ext.module().gemm_sm90_sizes(x.shape[-2], x.shape[-1], w.shape[-2], batch=x.shape[0] if x.dim() == 3 else 1)
    if why is not None:
        return f"vendor: {why}"
    if not all(_aligned(t) for t in (x, w) + ((y,) if y is not None else ())):
        return "vendor: operands not 16-byte aligned (base and strides)"
    return "sm90"


def _query_sizes_unusable(device, bs, k, heads, nope, rope, r):
    why = _ext.module().query_sm90_sizes(bs, k, heads, nope, rope, r)
    if why is not None:
        return f"vendor: {why}"
    sms = sm_count(device)
    if 4 * heads < 3 * sms:
        return f"vendor: {heads} heads on {sms} SMs (the fused query runs one block per head: at least 3/4 of the SMs)"
    return None


def query_path(q_lora, w_qu, w_uk, qbuf) -> str:
    """"sm90" when the query stage runs as one launch of our fused Hopper
    query (q_lora W_qu^T and the W_UK absorption per head), else "vendor:
    why" (two vendor products). Default where it runs; MLA_DECODE_GEMM=vendor
    turns it off."""
    if _settings.gemm == "vendor":
        return "vendor: MLA_DECODE_GEMM=vendor"
    why = _hopper_unusable(q_lora.device, (q_lora, w_qu, w_uk, qbuf), "fused query")
    if why is not None:
        return why
    H, nope, r = w_uk.shape
    why = _query_sizes_unusable(q_lora.device, q_lora.shape[0], q_lora.shape[1], H, nope, w_qu.shape[0] // H - nope, r)
    if why is not None:
        return why
    if not all(_aligned(t) for t in (q_lora, w_qu, w_uk, qbuf)):
        return "vendor: operands not 16-byte aligned (bases and strides of q_lora, the weights and qbuf)"
    return "sm90"


def blas_lt_path(x) -> bool:
    """True when the output stage asks for cuBLASLt (the decode step: W_UV and
    wo; the stage functions: wo): a CUDA build of
    PyTorch, x on the GPU, MLA_DECODE_BLASLT not 0, and the extension built
    (it holds the cuBLASLt call; the PyTorch fallback runs without it)."""
    return x.is_cuda and torch.version.cuda is not None and _settings.blaslt and _ext.kernels_built()


def step_want(device, dims) -> int:
    """The decode step's wished paths (``step_bit`` bits) for these sizes on device;
    the step takes each where the operands also allow it (alignment) and
    reports what ran (MLADecoder.last_paths)."""
    key = (_settings, device, dims)
    want = _want.get(key)
    if want is None:
        want = 0
        if _settings.gemm != "vendor" and hopper(device):
            if _ext.module().gemm_sm90_sizes(dims.bs, dims.dim, dims.q_lora, dims.kv_lora + dims.rope) is None:
                want |= step_bit("down_own")
            if _query_sizes_unusable(device, dims.bs, dims.q_lora, dims.heads, dims.nope, dims.rope,
                                     dims.kv_lora) is None:
                want |= step_bit("query_fused")
        if torch.version.cuda is not None and _settings.blaslt:
            want |= step_bit("wo_lt")
        _want[key] = want
    return want


def describe_step_paths(bits: int) -> dict:
    """The decode step's paths as names (MLADecoder.last_paths); ``captured``:
    the call's eager step was then captured for the next call to replay;
    ``plan``: what made the attention's lengths and plan (the fused query
    itself where the batch is not split and the step runs eagerly or in the
    caller's capture, else the planner kernel)."""
    b = _step_bits()
    return dict(down="sm90 GEMM" if bits & b["down_own"] else "vendor BLAS",
                query="fused sm90 query" if bits & b["query_fused"] else "vendor BLAS + rope_append",
                plan="fused query" if bits & b["plan_in_query"] else "planner kernel",
                wo="cuBLASLt" if bits & b["wo_lt"] else "vendor BLAS (PyTorch default)",
                launch="graph replay" if bits & b["graph"] else "eager",
                captured=bool(bits & b["captured"]))
