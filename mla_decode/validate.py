"""Input checks of the decode layer, with messages that name what was expected.

The kernel path checks its operands in C++ (mla_decode._C.decode_step) and,
when that refuses a call, runs ``validate`` to say in these words what is
wrong; the PyTorch fallback runs ``validate`` first. Either way nothing is
written before the checks pass.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

__all__ = ["MLAInputError", "Dims", "validate", "WEIGHTS", "CONFIG_DIMS", "config_dims"]

# the task's KVCache: its rows and its length (cache_parts; the lean path reads them by these names)
CACHE_FIELDS = ("data", "seq_len")
WEIGHTS = ("Q_proj_down_weight", "KV_proj_down_weight", "Q_proj_up_weight", "KV_proj_up_weight", "wo_weight")
# the config's sizes in the order the kernel step takes them
CONFIG_DIMS = ("dim", "n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
config_dims = operator.attrgetter(*CONFIG_DIMS)


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


def _check_tensor(name, t, shape, device, shape_text, contiguous=False):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise MLAInputError(f"{name} must be on {device} (where x is), got {t.device}")
    if t.dtype != torch.bfloat16:
        raise TypeError(f"{name} must be torch.bfloat16, got {t.dtype}")
    if list(t.shape) != list(shape):
        raise MLAInputError(f"{name} must have shape {shape_text} = {list(shape)}, got {list(t.shape)}")
    if t.numel() and t.stride(-1) != 1:
        raise MLAInputError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    if contiguous and not t.is_contiguous():
        raise MLAInputError(f"{name} must be contiguous, got strides {t.stride()}")


def elements_overlap(t) -> bool:
    """Whether two indices of t may name one element (an expanded or
    stride-0 tensor, rows closer than their width): each dimension's stride,
    smallest first, must step past everything the smaller ones span. (A
    sufficient test: a layout it refuses may in rare interleavings still be
    disjoint, never the reverse.)"""
    if t.numel() == 0 or t.is_contiguous():
        return False
    span = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride < span:
            return True
        span += stride * (size - 1)
    return False


def weight_shapes(d: Dims):
    return {
        "Q_proj_down_weight": ((d.q_lora, d.dim), "[q_lora_rank, dim]"),
        "KV_proj_down_weight": ((d.kv_lora + d.rope, d.dim), "[kv_lora_rank + rope, dim]"),
        "Q_proj_up_weight": ((d.heads * (d.nope + d.rope), d.q_lora), "[n_heads * (nope + rope), q_lora_rank]"),
        "KV_proj_up_weight": ((d.heads * (d.nope + d.v), d.kv_lora), "[n_heads * (nope + v), kv_lora_rank]"),
        "wo_weight": ((d.dim, d.heads * d.v), "[dim, n_heads * v]"),
    }


def cache_parts(kv_cache):
    """(kv_cache.data, kv_cache.seq_len), or a TypeError saying what a cache is."""
    try:
        return kv_cache.data, kv_cache.seq_len
    except AttributeError:
        raise TypeError("kv_cache must be the task's KVCache: an object with .data ([bs, max_seq_len, "
                        f"kv_lora_rank + rope] bf16) and .seq_len (int), got {type(kv_cache).__name__}") from None


def validate(config, x, kv_cache) -> Dims:
    """Check a call's inputs (types, device, dtype, layout, shape, capacity)
    and return its dims. Raises MLAInputError / TypeError naming what was
    expected."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    try:
        dim, H, q_lora, kv_lora, nope, rope, v = (operator.index(n) for n in config_dims(config))
    except AttributeError as e:
        raise MLAInputError(f"config is missing a field: {e}") from None
    except TypeError:
        raise MLAInputError(f"config's sizes {CONFIG_DIMS} must be ints, got {config_dims(config)}") from None
    if min(H, q_lora, kv_lora, nope, v, dim) <= 0 or rope <= 0 or rope % 2:
        raise MLAInputError(f"config dims must be positive and qk_rope_head_dim even, got n_heads={H}, "
                            f"q_lora_rank={q_lora}, kv_lora_rank={kv_lora}, nope={nope}, rope={rope}, v={v}, dim={dim}")
    dev = x.device
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be torch.bfloat16, got {x.dtype}")
    if x.dim() != 3 or x.shape[1] != 1 or x.shape[2] != dim or x.shape[0] < 1:
        raise MLAInputError(f"x must have shape [bs, 1, {dim}] with bs >= 1, got {list(x.shape)}")
    if not x.is_contiguous():
        raise MLAInputError(f"x must be contiguous, got strides {x.stride()}")
    bs = x.shape[0]
    data, seq_len = cache_parts(kv_cache)
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"kv_cache.data must be a torch.Tensor, got {type(data).__name__}")
    if data.dim() != 3:
        raise MLAInputError(f"kv_cache.data must have shape [bs, max_seq_len, {kv_lora + rope}], got {list(data.shape)}")
    if data.shape[0] != bs:
        raise MLAInputError(f"x's batch ({bs}) differs from kv_cache.data's ({data.shape[0]}): x [bs, 1, {dim}] "
                            f"and kv_cache.data [bs, max_seq_len, {kv_lora + rope}] must have the same bs (one new "
                            f"token per cached sequence), got x {list(x.shape)} and kv_cache.data {list(data.shape)}")
    dims = Dims(bs, dim, H, q_lora, kv_lora, nope, rope, v, data.shape[1])
    for name, (shape, text) in weight_shapes(dims).items():
        if not hasattr(config, name):
            raise MLAInputError(f"config is missing {name}")
        _check_tensor(f"config.{name}", getattr(config, name), shape, dev, text, contiguous=True)
    _check_tensor("kv_cache.data", data, (bs, data.shape[1], kv_lora + rope), dev,
                  f"[bs={bs}, max_seq_len, kv_lora_rank + rope = {kv_lora + rope}]")
    if elements_overlap(data):
        raise MLAInputError(f"kv_cache.data must give every sequence and row memory of its own (the step writes "
                            f"a row per sequence), got strides {data.stride()} for shape {list(data.shape)} "
                            "(an expanded tensor?)")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 0:
        raise MLAInputError(f"kv_cache.seq_len must be a non-negative int, got {seq_len!r}")
    if seq_len >= data.shape[1]:
        raise MLAInputError(f"kv_cache is full: seq_len {seq_len} leaves no row free in max_seq_len "
                            f"{data.shape[1]}; nothing was written")
    return dims
