"""The speed-of-light model (docs/architecture.md) and the device peaks, in one table."""

from __future__ import annotations

# name fragment -> (memory bandwidth B/s, dense bf16 FLOP/s); matched against
# the device name, most specific first
PEAKS = {
    "H200": (4.8e12, 989e12),
    "H100": (3.35e12, 989e12),
    "MI300X": (5.3e12, 1307e12),
    "MI300": (5.3e12, 1307e12),
}

TASK_SHAPE = dict(dim=7168, q_lora_rank=1536, n_heads=128, nope=128, rope=64, v=128, kv_lora_rank=512)


def peaks_for(device_name: str):
    """(bandwidth, flops, key) for a device name, or None when unknown."""
    for key, (bw, fl) in PEAKS.items():
        if key.lower() in device_name.lower():
            return bw, fl, key
    return None


def decode_bytes(bs, L, dim=7168, q_lora_rank=1536, n_heads=128, nope=128, rope=64, v=128, kv_lora_rank=512):
    """Bytes a decode step must move: every weight once, the cache rows read,
    the new row, x and y (bf16)."""
    weights = (q_lora_rank * dim + (kv_lora_rank + rope) * dim + n_heads * (nope + rope) * q_lora_rank
               + n_heads * (nope + v) * kv_lora_rank + dim * n_heads * v)
    cache = bs * L * (kv_lora_rank + rope)
    new_row = bs * (kv_lora_rank + rope)
    xy = 2 * bs * dim
    return 2 * (weights + cache + new_row + xy)


def decode_flops(bs, L, dim=7168, q_lora_rank=1536, n_heads=128, nope=128, rope=64, v=128, kv_lora_rank=512):
    d = kv_lora_rank + rope
    return 2 * bs * (dim * (q_lora_rank + d) + q_lora_rank * n_heads * (nope + rope) + n_heads * nope * kv_lora_rank
                     + L * n_heads * (d + kv_lora_rank) + n_heads * kv_lora_rank * v + n_heads * v * dim)


def floor_us(bs, L, bandwidth, flops, **shape):
    """max(bytes / BW, FLOPs / peak) in microseconds."""
    return 1e6 * max(decode_bytes(bs, L, **shape) / bandwidth, decode_flops(bs, L, **shape) / flops)


def attention_flops(bs, L, heads=128, d=576, dv=512, s_q=1):
    return 2 * bs * s_q * heads * L * (d + dv)


def attention_bytes(bs, L, heads=128, d=576, dv=512, s_q=1):
    """Cache rows read once, q read, out written (bf16), lse (fp32)."""
    return 2 * bs * L * d + 2 * bs * s_q * heads * (d + dv) + 4 * bs * s_q * heads
