"""custom_kernel and the decoder object: one decode step of the MLA layer.

Two backends:
- "kernels": one call into the extension (mla_decode._C.decode_step) that
  checks every operand and enqueues the step on the current stream of the
  tensors' GPU: our Hopper GEMM for the down-projection, one fused Hopper
  launch for the query, its RoPE and the cache append (vendor GEMMs and the
  RoPE/append kernel elsewhere), the split-KV attention over the cache with
  the keys rotated on the fly, W_UV (one strided-batched product) and wo
  on cuBLASLt (PyTorch's BLAS with MLA_DECODE_BLASLT=0). Which product runs
  where is mla_decode.kernel_choice's.
- "torch": the absorbed form in plain PyTorch (W_UK folded into the query,
  W_UV applied after attention), wherever the kernels are not built or not
  usable (the CPU included) or the sizes are not the kernels'.

Every call reads the weights and the whole cache where they lie (so
weights updated in place, caches written by other kernels, graph replays or
other threads are all read as they are now). A call with new operands
(addresses, layouts, sizes) captures its step as a CUDA graph while fewer
than four are captured, and later a step whose operands come back soon
(csrc/api/step_graph.cpp); calls that repeat them replay it: the same work
without the host's launches. The state kept is bounded: at most four
captured steps per process, at most four eager-step workspaces per GPU (one
per stream) and the RoPE table per device (128 bytes per position);
``release_cached()`` drops them all.

Every call takes the lean path first (mla_decode._C.fast_step,
csrc/api/step_fast.cpp): one C function reads the operands' attributes and
replays the captured step they match, or, where this decoder's checked path
has registered its choices for these sizes on that GPU, runs the checked
step (every check, then the launches) itself, with no Python frame or
argument conversion of ours before the launches (the task's harness times
each call from an idle GPU, often with the host's caches cold, so this code
is the call's time); anything else (a first call, inputs the checks
refuse) takes the checked path in Python.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import NamedTuple

import torch

from . import _ext
from . import kernel_choice
from . import projections
from .attention import rope_table
from .reference import rope_rotate
from .validate import CACHE_FIELDS, CONFIG_DIMS, WEIGHTS, Dims, MLAInputError, cache_parts, config_dims, validate

__all__ = ["MLADecoder", "MLAInputError", "custom_kernel", "Dims", "release_cached"]

_ROPE = CONFIG_DIMS.index("qk_rope_head_dim")  # the rope width's place in config_dims(config)
_lock = threading.Lock()
_rope_tables = {}  # (device, rope) -> RopeTables
_outgrown = []  # tables replaced by longer ones: kept until release_cached() (graphs may read them)


class RopeTables(NamedTuple):
    """A device's RoPE tables for one rope width, n positions."""
    cs: torch.Tensor  # [n, rope] bf16: cos | sin of the rope/2 frequencies, as the kernels take it
    cos2: torch.Tensor  # [n, rope]: cos in the [a, a] layout (the PyTorch paths')
    sin2: torch.Tensor  # [n, rope]: sin in the [a, a] layout


def rope_tables(device, rope, positions) -> RopeTables:
    """RoPE tables covering at least ``positions`` positions on ``device``
    (one per device and rope width, grown to the longest cache seen, in
    powers of two). A table outgrown stays alive until release_cached(): a
    graph captured with it (a caller's capture of a step, or a step the
    package captured) reads it where it lies."""
    key = (device, rope)
    t = _rope_tables.get(key)
    if t is None or t.cs.shape[0] < positions:
        with _lock:
            t = _rope_tables.get(key)
            if t is None or t.cs.shape[0] < positions:
                if t is not None:
                    _outgrown.append(t)
                table = rope_table(1 << max(int(positions) - 1, 0).bit_length(), rope, device)
                half = rope // 2
                cos2 = torch.cat([table[:, :half], table[:, :half]], dim=-1)
                sin2 = torch.cat([table[:, half:], table[:, half:]], dim=-1)
                t = _rope_tables[key] = RopeTables(table, cos2, sin2)
    return t


def release_cached() -> None:
    """Drop every piece of state the package keeps (the captured steps, the
    eager-step workspaces, the lean path's registrations and the RoPE
    tables); the next calls build what they need again."""
    with _lock:
        _rope_tables.clear()
        _outgrown.clear()
    if _ext.kernels_built():
        _ext.module().release_cached()
        _ext.module().clear_step_plans()


class MLADecoder:
    """One MLA decode layer. Call it as ``decoder(config, x, kv_cache)`` or
    ``decoder.step(data)``; it appends the new latent row to
    ``kv_cache.data`` in place, advances ``kv_cache.seq_len`` and returns
    ``(y [bs, 1, dim] bf16, kv_cache.data)``.

    backend: "auto" (kernels where usable, else the PyTorch fallback, with a
    warning when a GPU call falls back), "kernels" (raise if not usable) or
    "torch". No autograd is recorded (weights may be nn.Parameters; y does
    not require grad). A decoder holds no per-call state beyond
    ``last_backend`` and ``last_paths`` (the last call's, from any thread),
    so one decoder may serve several threads, caches and GPUs."""

    def __init__(self, backend: str = "auto"):
        if backend not in ("auto", "kernels", "torch"):
            raise ValueError(f"backend must be 'auto', 'kernels' or 'torch', got {backend!r}")
        self.backend = backend
        self.last_backend = None
        self._ran = None  # the last kernel step's paths (bits), None after a PyTorch one
        self._plans = {}  # (device, config sizes, bs, kernel settings) -> (backend, the step's wished paths)
        self._warned = set()

    @property
    def last_paths(self):
        """The last call's paths by stage (down, query, plan, wo, launch) and
        whether it captured its step (captured), or None after a call on the
        PyTorch fallback (kernel_choice.describe_step_paths)."""
        return None if self._ran is None else kernel_choice.describe_step_paths(self._ran)

    def __call__(self, config, x, kv_cache):
        return self.step((config, x, kv_cache))

    def _call(self, config, x, kv_cache):
        data, pos = cache_parts(kv_cache)
        if type(pos) is not int:  # (a bool or a float would pass as a position below: validate says what is wrong)
            validate(config, x, kv_cache)
        try:
            sizes = config_dims(config)
            plan = self._plans.get((x.device, sizes, x.shape[0], kernel_choice.settings()))
        except (AttributeError, TypeError):  # not a config or not a tensor: validate says which
            validate(config, x, kv_cache)
            raise
        if plan is None:
            plan = self._plan(config, x, kv_cache)
        which, want = plan
        if which == "kernels":
            try:
                table = rope_tables(x.device, sizes[_ROPE], data.shape[1]).cs
            except (AttributeError, IndexError, TypeError):  # data is no [bs, max_seq_len, d] tensor: validate says so
                validate(config, x, kv_cache)
                raise
            try:
                y, ran = _ext.module().decode_step(x, *(getattr(config, n) for n in WEIGHTS), data, pos, sizes,
                                                   table, want)
            except (ValueError, TypeError) as e:  # refused before anything was written
                validate(config, x, kv_cache)  # raises in the documented words where the inputs are at fault
                raise MLAInputError(str(e).split("\n")[0]) from None
            self._ran = ran
            if _fast_step is not None:  # the lean path runs the checked step itself from now on (these sizes, this GPU)
                _ext.module().register_step_plan(x.device.index, sizes, x.shape[0], table, want)
        else:
            dims = validate(config, x, kv_cache)
            with torch.no_grad():
                y = _step_torch(config, dims, x, data, pos)
            self._ran = None
        kv_cache.seq_len = pos + 1
        self.last_backend = which
        return y, data

    def step(self, data):
        if _fast_step is not None and self.backend != "torch":
            r = _fast_step(data)
            if r is not None:  # a replay of this step's captured graph, or the checked step run from C
                y, cache_data, self._ran = r
                self.last_backend = "kernels"
                return y, cache_data
        config, x, kv_cache = data
        return self._call(config, x, kv_cache)

    def _plan(self, config, x, kv_cache):
        """The backend and wished paths for these sizes on x's device (cached)."""
        dims = validate(config, x, kv_cache)
        device = x.device
        which = self._choose(dims, device)
        want = kernel_choice.step_want(device, dims) if which == "kernels" else 0
        self._plans[(device, config_dims(config), dims.bs, kernel_choice.settings())] = plan = (which, want)
        return plan

    def _choose(self, dims, device):
        which, why = kernel_choice.step_backend(self.backend, dims, device=device)
        if why is None:
            return which
        if device.type == "cuda" and why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"mla_decode: using the PyTorch fallback on {device}: {why}", RuntimeWarning, stacklevel=4)
        return "torch"


def _step_torch(config, dims, x, data, pos):
    """The step in PyTorch (absorbed form; same stages and rounding as the
    kernels): y [bs, 1, dim]; the new row written at ``pos``."""
    table, cos2, sin2 = rope_tables(x.device, dims.rope, dims.max_seq_len)
    bs, H, r, nope = dims.bs, dims.heads, dims.kv_lora, dims.nope
    L = pos + 1
    x2 = x.view(bs, dims.dim)
    wkv = config.KV_proj_up_weight.view(H, nope + dims.v, r)
    seqlens = torch.full((bs,), L, dtype=torch.int32, device=x.device)
    q_lora, kv_new = projections.down(x2, config.Q_proj_down_weight, config.KV_proj_down_weight)
    qbuf = torch.empty(H, bs, r + dims.rope, dtype=torch.bfloat16, device=x.device)
    q_att = projections.query_rope_append(q_lora, config.Q_proj_up_weight, wkv[:, :nope, :], kv_new, seqlens,
                                          (table, cos2, sin2), qbuf, data, kernel=False)
    scale = 1.0 / math.sqrt(dims.nope + dims.rope)
    o_lat = _attention_torch(q_att[:, 0, :, :r], q_att[:, 0, :, r:], data[:, :L], cos2[:L], sin2[:L], dims, scale)
    obuf = torch.empty(bs, H, dims.v, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(bs, dims.dim, dtype=torch.bfloat16, device=x.device)
    projections.output(o_lat, wkv[:, nope:, :].transpose(1, 2), config.wo_weight, obuf, y)
    return y.view(bs, 1, dims.dim)


def _attention_torch(q_abs, q_pe, rows, cos, sin, dims: Dims, scale):
    """Absorbed attention in PyTorch: q_abs [bs, H, r], q_pe [bs, H, rope]
    (rotated), rows [bs, L, r + rope] un-rotated, cos/sin [L, rope] ([a, a]).
    Returns [bs, H, r] bf16."""
    c = rows[..., :dims.kv_lora]
    k_pe = rope_rotate(rows[..., dims.kv_lora:], cos, sin)                  # [bs, L, rope]
    scores = torch.bmm(q_abs, c.transpose(1, 2)).float() + torch.bmm(q_pe, k_pe.transpose(1, 2)).float()
    p = torch.softmax(scores * scale, dim=-1).to(torch.bfloat16)
    return torch.bmm(p, c)


# The lean path (csrc/api/step_fast.cpp): (y, data, paths) after replaying the
# captured step the call's operands match, or after the checked step where
# these sizes are registered on that GPU; else None with nothing done.
_fast_step = getattr(_ext.module(), "fast_step", None) if _ext.kernels_built() else None
if _fast_step is not None:  # the attribute names it reads, from their one definition (validate.py)
    _ext.module().set_step_names(list(CACHE_FIELDS + WEIGHTS + CONFIG_DIMS))
_DEFAULT = MLADecoder()


def custom_kernel(data):
    """The task's entry point: ``data = (config, x, kv_cache)``. Appends the
    new row to ``kv_cache.data`` in place, advances ``kv_cache.seq_len``,
    returns ``(y, kv_cache.data)``."""
    if _fast_step is not None:  # (inlined MLADecoder.step: one Python frame less on the timed path)
        r = _fast_step(data)
        if r is not None:
            y, cache_data, _DEFAULT._ran = r
            _DEFAULT.last_backend = "kernels"
            return y, cache_data
    config, x, kv_cache = data  # (not step(): the lean replay was just tried)
    return _DEFAULT._call(config, x, kv_cache)
