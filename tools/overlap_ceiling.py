"""What an overlapped decode step could gain (issue 31's first measurement):
how many SMs a weight stream needs, how the attention slows on fewer SMs,
and both at once on disjoint SMs.

    python3 tools/overlap_ceiling.py [--lengths 513 6145] [--ks 0 8 16 32 48 66]
    (runs itself once per k: MLA_DECODE_ATTN_CTAS is read once per process)

Rows, device events, medians of --iters (each of 5 calls back to back):
- stream k: a Triton kernel of k programs reads wo's 235 MB (the step's
  largest weight) once; GB/s.
- attention k: the decode step's attention (bs 128, h_q 128, keys rotated on
  the fly, plan made once) with its persistent blocks capped at SMs - k
  (MLA_DECODE_ATTN_CTAS), the other k SMs idle.
- both k: the attention on SMs - k and the stream's k programs launched
  together on two streams (the attention first); the span of both, against
  the attention on every SM followed by the stream on every SM.
A measurement: it asserts nothing.
"""
import argparse
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from common import time_events  # noqa: E402

WO_BYTES = 7168 * 16384 * 2


def stream_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_sum(src, out, per_prog, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        start = pid * per_prog
        for off in range(0, per_prog, BLOCK):
            idx = start + off + tl.arange(0, BLOCK)
            acc += tl.load(src + idx, mask=idx < n, other=0.0).to(tl.float32)
        tl.store(out + pid * BLOCK + tl.arange(0, BLOCK), acc)

    def run(buf, out, k, block=65536, warps=16):
        n = buf.numel()
        per = -(-n // k)
        per = -(-per // block) * block
        read_sum[(k,)](buf, out, per, n, BLOCK=block, num_warps=warps)

    return run


def timed(fn, iters, reps=5):
    """Median us per call over `iters` event pairs of `reps` calls back to back."""
    return time_events(fn, iters=iters, warmup=1, batch=reps) * 1e3


def one_k(args, k):
    import mla_decode

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dev = "cuda"
    bs, h, d, dv = 128, 128, 576, 512
    buf = torch.randn(WO_BYTES // 2, device=dev).to(torch.bfloat16)
    out = torch.empty(max(k, sms) * 65536, device=dev)
    run = stream_kernel()
    rows = []
    if k > 0:
        run(buf, out, k)
        t = timed(lambda: run(buf, out, k), args.iters)
        rows.append(f"stream k={k}: {t:.1f} us, {WO_BYTES / t / 1e3:.0f} GB/s")
    s_main, s_side = torch.cuda.Stream(), torch.cuda.Stream()
    for L in args.lengths:
        cap = 8192
        q = torch.randn(bs, 1, h, d, device=dev).to(torch.bfloat16)
        kv = torch.randn(bs, cap, d, device=dev).to(torch.bfloat16)
        lens = torch.full((bs,), L, dtype=torch.int32, device=dev)
        cs = mla_decode.rope_table(cap, device=dev)
        plan = torch.ops.mla_decode.plan(lens, 1, h, cap, False)
        o = torch.empty(bs, 1, h, dv, device=dev).to(torch.bfloat16)
        lse = torch.empty(bs, h, 1, device=dev)
        attn = lambda: mla_decode.mla_attention(q, kv, lens, d ** -0.5, rope_cs=cs, out=o, lse=lse, plan=plan,
                                                split=False)
        attn()
        ta = timed(attn, args.iters)
        line = f"attention L={L} on {sms - k} SMs: {ta:.1f} us"
        if k > 0:
            def both():
                ev = torch.cuda.Event()
                ev.record()
                s_main.wait_event(ev)
                s_side.wait_event(ev)
                with torch.cuda.stream(s_main):
                    attn()
                with torch.cuda.stream(s_side):
                    run(buf, out, k)
                torch.cuda.current_stream().wait_stream(s_main)
                torch.cuda.current_stream().wait_stream(s_side)
            both()
            tb = timed(both, args.iters)
            line += f"; with the stream on {k} SMs at once: {tb:.1f} us"
        rows.append(line)
    if k == 0:
        run(buf, out, sms)
        rows.append(f"stream k={sms} (every SM): {timed(lambda: run(buf, out, sms), args.iters):.1f} us")
    print("\n".join(rows), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[513, 2049, 6145])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 8, 16, 32, 48, 66])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--stream-only", action="store_true", help="the stream's bandwidth alone for each k (and SM count)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        one_k(args, args.one)
        return
    if args.stream_only:
        run = stream_kernel()
        buf = torch.randn(WO_BYTES // 2, device="cuda").to(torch.bfloat16)
        out = torch.empty(132 * 65536 * 4, device="cuda")
        for block, warps in ((16384, 8), (65536, 8), (65536, 16)):
            for k in args.ks:
                f = lambda: run(buf, out, k, block, warps)
                f()
                t = timed(f, args.iters)
                print(f"stream block {block} warps {warps} k={k}: {t:.1f} us, {WO_BYTES / t / 1e3:.0f} GB/s", flush=True)
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"# overlap ceiling | {torch.cuda.get_device_name(0)} | {sms} SMs | attention bs 128, h_q 128, rope on the fly,"
          f" plan made once | stream: {WO_BYTES / 1e6:.0f} MB", flush=True)
    for k in args.ks:
        env = dict(os.environ)
        if k > 0:
            env["MLA_DECODE_ATTN_CTAS"] = str(sms - k)
        cmd = [sys.executable, os.path.abspath(__file__), "--one", str(k), "--iters", str(args.iters), "--lengths",
               *map(str, args.lengths)]
        subprocess.run(cmd, env=env, check=False)


if __name__ == "__main__":
    main()
