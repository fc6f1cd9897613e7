"""Flexible MLA shapes: does the time follow the actual dims?

    python benchmarks/bench_flexible.py [--bs 128] [--L 4096] [--json FILE]

Pairs of rows, each a shape against what a caller would run without
flexible shapes (zero-padded heads or widths): h_q 32 against 64, dv 256
against 512, and MHA2MLA's Llama2-7B d_kv_16 (32 heads, dv 512, per-head
rope keys of width 16). s_q=1, one KV head, equal lengths L, device events
around --batch calls back to back (device time per call), median; us /
TFLOP/s / GB/s / % of the floor max(bytes/BW, FLOPs/peak); bytes = cache rows (+ per-head rope keys) read once, q read, out written.
The kernel column says which kernel ran (on a Hopper build on a Hopper GPU
the Hopper kernel takes every shape here). One row reads rope-32 keys from a
cache whose rows are 576 elements apart (the storage of a rope-64 cache,
viewed [..., :544]): the same bytes as the plain rope-32 row, in rows that
start on 128-byte boundaries (at h_q 32 and at h_q 128)."""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mla_decode  # noqa: E402
from common import add_timing_args, dump_json, gpu_setup, rates, time_events  # noqa: E402

# (label, h_q, dv, rope, per-head rope keys[, row stride of the cache in elements])
SHAPES = [
    ("h_q 32 (DeepSeek dims)", 32, 512, 64, False),
    ("h_q 32 padded to 64", 64, 512, 64, False),
    ("h_q 32, rope 32", 32, 512, 32, False),
    ("h_q 32 padded to 64, rope 32", 64, 512, 32, False),
    ("h_q 32, rope 32, 128 B aligned rows", 32, 512, 32, False, 576),
    ("dv 256, rope 64", 128, 256, 64, False),
    ("dv 512, rope 64 (DeepSeek)", 128, 512, 64, False),
    ("dv 256, rope 32", 128, 256, 32, False),
    ("dv 512, rope 32", 128, 512, 32, False),
    ("dv 512, rope 32, 128 B aligned rows", 128, 512, 32, False, 576),
    ("dv 128, rope 64", 128, 128, 64, False),
    ("dv 128, rope 16", 128, 128, 16, False),
    ("dv 64, rope 8, h_q 40", 40, 64, 8, False),
    ("MHA2MLA 32 heads, 512 + 16 per head", 32, 512, 16, True),
    ("padded: 64 heads, 512 + 32 shared", 64, 512, 32, False),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--L", type=int, default=4096)
    add_timing_args(ap, iters=30)
    args = ap.parse_args()
    setup = gpu_setup("bench_flexible")
    if setup is None:
        return 1
    name, peaks = setup
    from mla_decode._ext import attention_info

    dev = torch.cuda.current_device()
    bs, L = args.bs, args.L
    print(f"# flexible shapes | {mla_decode.backend()} | bs={bs} L={L} s_q=1 bf16")
    seqlens = torch.full((bs,), L, dtype=torch.int32, device="cuda")
    rows = []
    for label, h_q, dv, rope, per_head, *stride in SHAPES:
        d = dv + rope
        width = dv if per_head else d
        kv = torch.randn(bs, L, stride[0] if stride else width, device="cuda", dtype=torch.bfloat16)[..., :width]
        kh = torch.randn(bs, L, h_q, rope, device="cuda", dtype=torch.bfloat16) if per_head else None
        q = torch.randn(bs, 1, h_q, d, device="cuda", dtype=torch.bfloat16)

        def call():
            mla_decode.mla_attention(q, kv, seqlens, d ** -0.5, head_dim_v=dv, kpe_heads=kh)

        us = time_events(call, iters=args.iters, batch=args.batch) * 1e3
        kind = attention_info(dev, dv, 0 if per_head else rope).kernel
        fl = 2 * bs * h_q * L * (d + dv)
        by = 2 * kv.numel() + (2 * kh.numel() if per_head else 0) + 2 * bs * h_q * (d + dv) + 4 * bs * h_q
        row = dict(label=label, h_q=h_q, dv=dv, rope=rope, per_head=per_head, kernel=kind,
                   row_stride=kv.stride(1), **rates(us, fl, by, peaks))
        rows.append(row)
        print(f"  {label:<38} h_q={h_q:>3} dv={dv:>3} rope={rope:>2}{' per-head' if per_head else '         '} "
              f"{kind:<8}: {us:8.1f} us {row['tflops']:6.1f} TFLOP/s {row['gbs']:6.0f} GB/s "
              f"{row.get('pct_floor', float('nan')):5.1f} % of floor", flush=True)
        del kv, kh, q
    dump_json(args.json, name, bs=bs, L=L, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
