"""Wall time of the first calls of custom_kernel on a fresh cache, as the
task harness meets them (the reference check of the first call filling the
allocator first), and a profile of the slowest.

    python3 tools/first_calls.py [prefill ...] [--calls 6] [--profile]

Per prefill: fresh inputs, one call, the reference check (whole batch: the
harness's memory pressure), then --calls timed calls (synchronize, wall
clock, call, synchronize). --profile prints torch.profiler's table of the
slowest timed call (host and device time per op).
"""
import argparse
import time

import torch

import mla_decode
from mla_decode.reference import generate_input, ref_kernel


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("prefills", type=int, nargs="*", default=[512, 6144])
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ref-chunk", type=int, default=0,
                    help="sequences per chunk of the reference (0: the whole batch where the GPU has more than "
                         "120 GB, else 16)")
    args = ap.parse_args()
    chunk = args.ref_chunk or (None if torch.cuda.get_device_properties(0).total_memory > 120e9 else 16)
    for p in args.prefills:
        config, x, kv = generate_input(batch_size=128, prefill=p, seed=p, device="cuda")
        kv_ref = kv.clone()
        t_first, _ = timed(lambda: mla_decode.custom_kernel((config, x, kv)))
        ref_kernel((config, x, kv_ref), batch_chunk=chunk)
        del kv_ref
        times = []
        for _ in range(args.calls):
            t, _ = timed(lambda: mla_decode.custom_kernel((config, x, kv)))
            times.append(t)
        print(f"prefill {p}: first (checked) call {t_first:.0f} us; then " + ", ".join(f"{t:.0f}" for t in times)
              + f" us; allocator reserved {torch.cuda.memory_reserved() / 2**30:.1f} GiB")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            config, x, kv = generate_input(batch_size=128, prefill=p, seed=p + 1, device="cuda")
            kv_ref = kv.clone()
            mla_decode.custom_kernel((config, x, kv))
            ref_kernel((config, x, kv_ref), batch_chunk=chunk)
            del kv_ref
            slow = max(range(args.calls), key=lambda i: times[i])
            for _ in range(slow):
                mla_decode.custom_kernel((config, x, kv))
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                mla_decode.custom_kernel((config, x, kv))
                torch.cuda.synchronize()
            print(f"profile of timed call {slow + 1} at prefill {p} (the slowest above):")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18))
        del config, x, kv
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
