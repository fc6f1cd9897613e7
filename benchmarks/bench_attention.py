"""Attention kernel alone: bs=128, H=128, s_q=1 over the task's latent cache.

    python benchmarks/bench_attention.py [--lengths 513 2049 4097 6145] [--json FILE]

Device events around --batch calls back to back (the launch queue kept full:
the device time per call, host launch overhead not counted; --batch 1 counts
it), median of many runs, caches rotated so they do not sit in L2.
Reports us, TFLOP/s, GB/s and % of the attention floor (max(bytes/BW,
FLOPs/peak) with mla_decode.roofline's peaks for the device).

Two times per row: `us`, each call planning its own split (one planner
launch ahead of the attention, as mla_attention does by default), and
`plan1`, the plan made once for the lengths and passed as plan= (as
FlashMLA's get_mla_metadata, whose output its benchmark reuses across
calls; its kernel times in xFlashMLA are of that kind)."""

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mla_decode  # noqa: E402
from mla_decode import roofline  # noqa: E402
from common import add_timing_args, dump_json, gpu_setup, rates, time_events  # noqa: E402

FLASHMLA_H200_US = {513: 63, 2049: 157, 4097: 270, 6145: 396}  # FlashMLA's kernel on an H200 (docs/attention.md)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[513, 2049, 4097, 6145])
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--heads", type=int, default=128)
    add_timing_args(ap, iters=50)
    args = ap.parse_args()
    setup = gpu_setup("bench_attention")
    if setup is None:
        return 1
    name, peaks = setup
    print(f"# attention kernel | {mla_decode.backend()} | bs={args.bs} H={args.heads} s_q=1 D=576 Dv=512")
    rows = []
    for L in args.lengths:
        n_sets = max(2, math.ceil(200e6 / (args.bs * L * 576 * 2)))  # > L2 between reuses
        sets = []
        for i in range(n_sets):
            kv = torch.randn(args.bs, L, 576, device="cuda", dtype=torch.bfloat16)
            q = torch.randn(args.bs, 1, args.heads, 576, device="cuda", dtype=torch.bfloat16)
            sets.append((q, kv))
        seqlens = torch.full((args.bs,), L, dtype=torch.int32, device="cuda")
        cs = mla_decode.rope_table(L, device="cuda")
        out = torch.empty(args.bs, 1, args.heads, 512, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(args.bs, args.heads, 1, device="cuda")
        # rope: "yes" rotates keys on the fly (what the decode step does); "kpe" reads a separate
        # rotated copy of the rope columns; "no" uses the keys as stored (FlashMLA's setting)
        kpes = [torch.randn(args.bs, L, 64, device="cuda", dtype=torch.bfloat16) for _ in range(n_sets)]
        plan = torch.ops.mla_decode.plan(seqlens, 1, args.heads, L)
        for rope in ("yes", "kpe", "no"):
            it = [0]

            def call(plan=None):
                q, kv = sets[it[0] % n_sets]
                kpe = kpes[it[0] % n_sets] if rope == "kpe" else None
                it[0] += 1
                mla_decode.mla_attention(q, kv, seqlens, 0.0722, rope_cs=cs if rope == "yes" else None, out=out,
                                         lse=lse, kpe=kpe, plan=plan)

            us = time_events(call, iters=args.iters, batch=args.batch) * 1e3
            us1 = time_events(lambda: call(plan), iters=args.iters, batch=args.batch) * 1e3
            fl = roofline.attention_flops(args.bs, L, args.heads)
            by = roofline.attention_bytes(args.bs, L, args.heads)
            row = dict(L=L, rope=rope, **rates(us, fl, by, peaks), us_plan_once=us1)
            if "H200" in name and L in FLASHMLA_H200_US:
                row["vs_flashmla"] = FLASHMLA_H200_US[L] / us
                row["vs_flashmla_plan_once"] = FLASHMLA_H200_US[L] / us1
            rows.append(row)
        del sets, kpes
    print(f"{'L':>6} {'rope':>5} {'us':>9} {'TFLOP/s':>8} {'GB/s':>7} {'floor us':>9} {'%floor':>7} {'xFlashMLA':>9}"
          f" {'us plan1':>9} {'xFM plan1':>9}")
    for r in rows:
        print(f"{r['L']:>6} {r['rope']:>5} {r['us']:>9.1f} {r['tflops']:>8.1f} {r['gbs']:>7.0f} "
              f"{r.get('floor_us', float('nan')):>9.1f} {r.get('pct_floor', float('nan')):>7.1f} "
              f"{r.get('vs_flashmla', float('nan')):>9.2f} {r['us_plan_once']:>9.1f} "
              f"{r.get('vs_flashmla_plan_once', float('nan')):>9.2f}")
    print("(xFlashMLA: FlashMLA's H200 time (docs/attention.md) over ours; rope=no is its setting;"
          " rope=yes (keys rotated on the fly) is the decode step's path. plan1: the split planned once for the lengths and passed as plan=,"
          " as FlashMLA's benchmark reuses its get_mla_metadata output; us: each call plans its own)")
    dump_json(args.json, name, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
