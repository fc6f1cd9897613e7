"""The FlashMLA-compatible serving API in FlashMLA's published setting:
b=128, one KV head, h_q in 16..128, s_q 1 and 2, variable lengths
(normal(mean, mean/2), at least s_q) with mean 4096, 8192, 16384, paged cache
(block 64; 16 and 1 for the block-size comparison at h_q=128, s_q=1).

    python benchmarks/bench_serving.py [--means 4096 8192 16384] [--heads ...] [--dtype bf16|fp16|fp8] [--json FILE]

--dtype fp8: the cache in mla_decode.fp8.FP8_KV_DTYPE with one scale
(kv_scale), q bf16; its bytes counted at one per cache element.

Device events around --batch calls back to back (device time per call, host
launch overhead not counted; --batch 1 counts it), median of many runs (the
metadata computed once, outside).
us, TFLOP/s, GB/s and % of the attention floor max(bytes/BW, FLOPs/peak).
Where ``import flash_mla`` works (FlashMLA, never part of this repository;
on the device ``source .peers/use_flashmla.sh``), the bf16 rows also time
ours and FlashMLA's by device time in CUDA graphs (10 calls per graph on the
same inputs: a cache of mean 4096 is 600 MB, past the L2; median of
--graph-reps replays) and print FlashMLA us / ours (xFM, > 1: ours faster),
with the largest difference between the two outputs (pages of 64 rows, the
only size FlashMLA takes); fp8 rows against FlashMLA's bf16 on the same
values. --no-flashmla skips it."""

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mla_decode  # noqa: E402
import mla_decode.fp8  # noqa: E402,F401
from common import add_timing_args, dump_json, flashmla, gpu_setup, rates, time_events, time_graph_calls  # noqa: E402


def paged_cache(lens, block_size, gen, dtype, order="random"):
    b = len(lens)
    used = [(L + block_size - 1) // block_size for L in lens]
    total = sum(used)
    ids = (torch.randperm(total, generator=gen) if order == "random" else torch.arange(total)).to(torch.int32)
    table = torch.zeros(b, max(used), dtype=torch.int32)
    off = 0
    for i, n in enumerate(used):
        table[i, :n] = ids[off:off + n]
        off += n
    k_cache = torch.randn(total, block_size, 1, 576, device="cuda", dtype=dtype)
    return k_cache, table.cuda()


def vs_flashmla(fm, call, q, k_cache, table, seqlens, s_q, h_q, kv_scale, reps, row):
    """Ours and FlashMLA's by device time in CUDA graphs of 10 calls (FlashMLA
    on the bf16 values of an fp8 cache); fills row, returns the printed part."""
    kc = k_cache if kv_scale is None else (k_cache.to(torch.bfloat16) * kv_scale).to(torch.bfloat16)
    meta = fm.get_mla_metadata(seqlens, s_q * h_q, 1)

    def theirs():
        return fm.flash_mla_with_kvcache(q, kc, table, seqlens, 512, meta[0], meta[1], causal=s_q > 1)

    mine = call()[0]  # (the timed call itself: its metadata made once, outside)
    diff = (mine.float() - theirs()[0].float()).abs().max().item()
    g_ours = time_graph_calls([call] * 10, reps=reps) * 1e3
    g_fm = time_graph_calls([theirs] * 10, reps=reps) * 1e3
    row.update(graph_us=g_ours, flashmla_graph_us=g_fm, x_flashmla=g_fm / g_ours, max_diff=diff)
    return f" | graphs {g_ours:8.1f} / FlashMLA {g_fm:8.1f} us (xFM {g_fm / g_ours:4.2f}) max|d| {diff:.1e}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--means", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--b", type=int, default=128)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp8"], default="bf16")
    ap.add_argument("--table", choices=["random", "sorted"], default="random",
                    help="page order: a random permutation (FlashMLA's test) or pages in order")
    ap.add_argument("--graph-reps", type=int, default=10)
    ap.add_argument("--no-flashmla", action="store_true")
    add_timing_args(ap, iters=30)
    args = ap.parse_args()
    setup = gpu_setup("bench_serving")
    if setup is None:
        return 1
    name, peaks = setup
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    fp8 = args.dtype == "fp8"
    kv_scale = 0.02 if fp8 else None  # (randn values up to ~5: within e4m3's range at this scale)
    print(f"# serving API (flash_mla_with_kvcache) | {mla_decode.backend()} | b={args.b} h_kv=1 d=576 dv=512 "
          f"| {args.dtype} | pages {args.table}")
    fm = None if args.no_flashmla or args.dtype == "fp16" else flashmla()
    if fm is None and not args.no_flashmla and args.dtype != "fp16":
        import common
        print(f"# no FlashMLA column: flash_mla does not import ({common.FLASHMLA_ERROR})")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for mean in args.means:
        for s_q in (1, 2):
            rnd = random.Random(mean + s_q)
            lens = [max(int(rnd.normalvariate(mean, mean / 2)), s_q) for _ in range(args.b)]
            seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
            for block_size in (64, 16, 1):
                if block_size != 64 and s_q != 1:
                    continue
                k_cache, table = paged_cache(lens, block_size, gen, dtype, args.table)
                if fp8:
                    k_cache = mla_decode.fp8.quantize_per_tensor(k_cache, kv_scale, mla_decode.fp8.FP8_KV_DTYPE)
                for h_q in args.heads:
                    if block_size != 64 and h_q != 128:
                        continue
                    q = torch.randn(args.b, s_q, h_q, 576, device="cuda", dtype=dtype)
                    meta, splits = mla_decode.get_mla_metadata(seqlens, s_q * h_q, 1)

                    def call():
                        return mla_decode.flash_mla_with_kvcache(q, k_cache, table, seqlens, 512, meta, splits,
                                                          causal=s_q > 1, kv_scale=kv_scale)

                    us = time_events(call, iters=args.iters, batch=args.batch) * 1e3
                    fl = 2 * sum(lens) * s_q * h_q * (576 + 512)
                    by = ((1 if fp8 else 2) * sum(lens) * 576 + 2 * args.b * s_q * h_q * (576 + 512)
                          + 4 * args.b * s_q * h_q)
                    row = dict(mean=mean, s_q=s_q, h_q=h_q, block=block_size, dtype=args.dtype, table=args.table,
                               **rates(us, fl, by, peaks))
                    side = ""
                    if fm is not None and block_size == 64:  # (FlashMLA takes pages of 64 rows only)
                        side = vs_flashmla(fm, call, q, k_cache, table, seqlens, s_q, h_q, kv_scale, args.graph_reps, row)
                    rows.append(row)
                    print(f"  mean={mean:>5} s_q={s_q} h_q={h_q:>3} block={block_size:>2}: {us:8.1f} us "
                          f"{row['tflops']:6.1f} TFLOP/s {row['gbs']:6.0f} GB/s "
                          f"{row.get('pct_floor', float('nan')):5.1f} % of floor{side}", flush=True)
                del k_cache, table
    dump_json(args.json, name, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
