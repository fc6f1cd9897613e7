"""custom_kernel and the decoder object: validation, derived state, backends.

Backends:
- "kernels": the compiled attention kernel (split-KV absorbed MQA with
  on-the-fly key RoPE and LSE combine); projections through the vendor BLAS
  via PyTorch for now.
- "torch": the absorbed form in plain PyTorch (the absorbed form: W_UK folded into the query, W_UV applied after attention), used
  wherever the kernels are not built or not usable (the CPU included).
The backend of every call is recorded in ``MLADecoder.last_backend``;
``mla_decode.backend()`` says which one a device gets and why.
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch

from ._ext import backend as _backend_text
from ._ext import kernels_usable
from .attention import mla_attention, rope_table
from .reference import rope_rotate

__all__ = ["MLADecoder", "MLAInputError", "custom_kernel", "Dims"]

_WEIGHTS = ("Q_proj_down_weight", "KV_proj_down_weight", "Q_proj_up_weight", "KV_proj_up_weight", "wo_weight")


class MLAInputError(ValueError):
    """A call's inputs do not fit the layer; nothing was written."""


@dataclass(frozen=True)
class Dims:
    bs: int
    dim: int
    heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int
    max_seq_len: int


def _shape(t):
    return list(t.shape)


def _check_tensor(name, t, shape, device, shape_text):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise MLAInputError(f"{name} must be on {device} (where x is), got {t.device}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be torch.bfloat16, got {t.dtype}")
    if list(t.shape) != list(shape):
        raise MLAInputError(f"{name} must have shape {shape_text} = {list(shape)}, got {_shape(t)}")
    if t.numel() and t.stride(-1) != 1:
        raise MLAInputError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def validate(config, x, kv_cache) -> Dims:
    """Check a call's inputs (device, dtype, layout, shape, capacity) and
    return its dims. Raises MLAInputError/TypeError naming what was expected."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    try:
        H, q_lora, kv_lora = int(config.n_heads), int(config.q_lora_rank), int(config.kv_lora_rank)
        nope, rope, v, dim = (int(config.qk_nope_head_dim), int(config.qk_rope_head_dim),
                              int(config.v_head_dim), int(config.dim))
    except AttributeError as e:
        raise MLAInputError(f"config is missing a field: {e}") from None
    if min(H, q_lora, kv_lora, nope, v, dim) <= 0 or rope <= 0 or rope % 2:
        raise MLAInputError(f"config dims must be positive and qk_rope_head_dim even, got n_heads={H}, "
                            f"q_lora_rank={q_lora}, kv_lora_rank={kv_lora}, nope={nope}, rope={rope}, v={v}, dim={dim}")
    dev = x.device
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be torch.bfloat16, got {x.dtype}")
    if x.dim() != 3 or x.shape[1] != 1 or x.shape[2] != dim or x.shape[0] < 1:
        raise MLAInputError(f"x must have shape [bs, 1, {dim}], got {_shape(x)}")
    if not x.is_contiguous():
        raise MLAInputError(f"x must be contiguous, got strides {x.stride()}")
    bs = x.shape[0]
    want = {
        "Q_proj_down_weight": ((q_lora, dim), "[q_lora_rank, dim]"),
        "KV_proj_down_weight": ((kv_lora + rope, dim), "[kv_lora_rank + rope, dim]"),
        "Q_proj_up_weight": ((H * (nope + rope), q_lora), "[n_heads * (nope + rope), q_lora_rank]"),
        "KV_proj_up_weight": ((H * (nope + v), kv_lora), "[n_heads * (nope + v), kv_lora_rank]"),
        "wo_weight": ((dim, H * v), "[dim, n_heads * v]"),
    }
    for name, (shape, text) in want.items():
        if not hasattr(config, name):
            raise MLAInputError(f"config is missing {name}")
        t = getattr(config, name)
        _check_tensor(f"config.{name}", t, shape, dev, text)
        if not t.is_contiguous():
            raise MLAInputError(f"config.{name} must be contiguous, got strides {t.stride()}")
    data = getattr(kv_cache, "data", None)
    if not isinstance(data, torch.Tensor):
        raise TypeError("kv_cache.data must be a torch.Tensor")
    if data.dim() != 3:
        raise MLAInputError(f"kv_cache.data must have shape [bs, max_seq_len, {kv_lora + rope}], got {_shape(data)}")
    _check_tensor("kv_cache.data", data, (bs, data.shape[1], kv_lora + rope), dev,
                  f"[bs={bs}, max_seq_len, kv_lora_rank + rope = {kv_lora + rope}]")
    seq_len = kv_cache.seq_len
    if not isinstance(seq_len, int) or seq_len < 0:
        raise MLAInputError(f"kv_cache.seq_len must be a non-negative int, got {seq_len!r}")
    if seq_len >= data.shape[1]:
        raise MLAInputError(f"kv_cache is full: seq_len {seq_len} == max_seq_len {data.shape[1]}; "
                            "nothing was written")
    return Dims(bs, dim, H, q_lora, kv_lora, nope, rope, v, data.shape[1])


class _WeightSet:
    """What the decoder derives from one set of weights. It is served again
    only for the very same tensor objects at the same version counter (an
    in-place change bumps the counter), so new or modified weights are never
    served stale; weak references keep it from holding the weights alive."""

    def __init__(self, config, dims: Dims):
        self.refs = tuple(weakref.ref(getattr(config, n)) for n in _WEIGHTS)
        self.versions = tuple(getattr(config, n)._version for n in _WEIGHTS)
        self.dims = dims
        H, nope, v, r = dims.heads, dims.nope, dims.v, dims.kv_lora
        wkv = config.KV_proj_up_weight.view(H, nope + v, r)
        self.w_uk = wkv[:, :nope, :]                 # [H, nope, r]: q_nope -> latent
        self.w_uv_t = wkv[:, nope:, :].transpose(1, 2)  # [H, r, v]: latent -> value

    def matches(self, config, dims: Dims) -> bool:
        if dims != self.dims:
            return False
        for ref, ver, name in zip(self.refs, self.versions, _WEIGHTS):
            w = getattr(config, name)
            if ref() is not w or w._version != ver:
                return False
        return True


class MLADecoder:
    """One MLA decode layer. Call it as ``decoder(config, x, kv_cache)`` or
    ``decoder.step(data)``; it appends the new latent row to
    ``kv_cache.data`` in place, advances ``kv_cache.seq_len`` and returns
    ``(y [bs, 1, dim] bf16, kv_cache.data)``.

    backend: "auto" (kernels where usable, else the PyTorch fallback, with a
    warning when a GPU call falls back), "kernels" (raise if not usable) or
    "torch"."""

    def __init__(self, backend: str = "auto"):
        if backend not in ("auto", "kernels", "torch"):
            raise ValueError(f"backend must be 'auto', 'kernels' or 'torch', got {backend!r}")
        self.backend = backend
        self.last_backend = None
        self._lock = threading.Lock()
        self._weights = None
        self._rope = {}
        self._warned = set()

    # -- derived state ------------------------------------------------------
    def _weight_set(self, config, dims):
        with self._lock:
            ws = self._weights
            if ws is None or not ws.matches(config, dims):
                ws = _WeightSet(config, dims)
                self._weights = ws
            return ws

    def _rope_tables(self, device, rope, positions):
        """(table [n, rope] = cos | sin of the rope/2 frequencies, as the kernels
        take it; cos2, sin2 [n, rope] laid out [a, a], as rope_rotate takes them)."""
        key = (device, rope, positions)
        with self._lock:
            t = self._rope.get(key)
            if t is None:
                table = rope_table(positions, rope, device)
                half = rope // 2
                cos2 = torch.cat([table[:, :half], table[:, :half]], dim=-1)
                sin2 = torch.cat([table[:, half:], table[:, half:]], dim=-1)
                t = (table, cos2, sin2)
                self._rope[key] = t
            return t

    def _choose(self, dims, device):
        if self.backend == "torch":
            return "torch"
        supported = dims.kv_lora == 512 and dims.rope == 64
        usable = kernels_usable(device)
        if usable and supported:
            return "kernels"
        why = (f"kv_lora_rank={dims.kv_lora}, rope={dims.rope} (the kernels take 512 and 64)"
               if usable else _backend_text(device))
        if self.backend == "kernels":
            raise RuntimeError(f"backend='kernels' requested but not usable: {why}")
        if device.type == "cuda" and why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"mla_decode: using the PyTorch fallback on {device}: {why}", RuntimeWarning, stacklevel=3)
        return "torch"

    # -- the step -----------------------------------------------------------
    def __call__(self, config, x, kv_cache):
        dims = validate(config, x, kv_cache)
        ws = self._weight_set(config, dims)
        which = self._choose(dims, x.device)
        table, cos2, sin2 = self._rope_tables(x.device, dims.rope, dims.max_seq_len)
        bs, H = dims.bs, dims.heads
        data = kv_cache.data
        pos = kv_cache.seq_len  # the new row's position; L = pos + 1 after the append
        x2 = x.view(bs, dims.dim)

        # 1-2. down-projections, then the append (all checks are behind us)
        q_lora = x2 @ config.Q_proj_down_weight.T
        kv_new = x2 @ config.KV_proj_down_weight.T
        data[:, pos] = kv_new
        kv_cache.seq_len = pos + 1
        L = pos + 1

        # 3-4. query, its RoPE at L-1, W_UK absorption
        q = (q_lora @ config.Q_proj_up_weight.T).view(bs, H, dims.nope + dims.rope)
        q_nope, q_pe = torch.split(q, [dims.nope, dims.rope], dim=-1)
        q_pe = rope_rotate(q_pe, cos2[pos], sin2[pos])                     # [bs, H, rope]
        q_abs = torch.bmm(q_nope.transpose(0, 1), ws.w_uk)                  # [H, bs, kv_lora]
        scale = 1.0 / math.sqrt(dims.nope + dims.rope)

        # 5. attention over the latent cache
        if which == "kernels":
            q_att = torch.cat([q_abs.transpose(0, 1), q_pe], dim=-1).unsqueeze(1)  # [bs, 1, H, 576]
            seqlens = torch.full((bs,), L, dtype=torch.int32, device=x.device)
            o_lat, _ = mla_attention(q_att, data, seqlens, scale, rope_cs=table)
            o_lat = o_lat.view(bs, H, dims.kv_lora)
        else:
            o_lat = _attention_torch(q_abs.transpose(0, 1), q_pe, data[:, :L], cos2[:L], sin2[:L], dims, scale)

        # 6. W_UV per head, then wo
        o = torch.bmm(o_lat.transpose(0, 1), ws.w_uv_t)                     # [H, bs, v]
        y = o.transpose(0, 1).reshape(bs, H * dims.v) @ config.wo_weight.T
        self.last_backend = which
        return y.view(bs, 1, dims.dim), data

    def step(self, data):
        config, x, kv_cache = data
        return self(config, x, kv_cache)


def _attention_torch(q_abs, q_pe, rows, cos, sin, dims: Dims, scale):
    """Absorbed attention in PyTorch: q_abs [bs, H, r], q_pe [bs, H, rope]
    (rotated), rows [bs, L, r + rope] un-rotated, cos/sin [L, rope] ([a, a]).
    Returns [bs, H, r] bf16."""
    c = rows[..., :dims.kv_lora]
    k_pe = rope_rotate(rows[..., dims.kv_lora:], cos, sin)                  # [bs, L, rope]
    scores = torch.bmm(q_abs, c.transpose(1, 2)).float() + torch.bmm(q_pe, k_pe.transpose(1, 2)).float()
    p = torch.softmax(scores * scale, dim=-1).to(torch.bfloat16)
    return torch.bmm(p, c)


_DEFAULT = MLADecoder()


def custom_kernel(data):
    """The task's entry point: ``data = (config, x, kv_cache)``. Appends the
    new row to ``kv_cache.data`` in place, advances ``kv_cache.seq_len``,
    returns ``(y, kv_cache.data)``."""
    return _DEFAULT.step(data)
