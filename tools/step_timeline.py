"""One decode step's kernels on the device timeline: each call as the task
harness makes it (synchronize, call, synchronize), and the same call
captured in a CUDA graph and replayed; per kernel the median device time,
per call the span from the first kernel's start to the last one's end.

    MLA_DECODE_STEP_GRAPH=0 python3 tools/step_timeline.py [prefill ...]

(MLA_DECODE_STEP_GRAPH=0: every call launches its kernels anew; without it
the step's own replays serve the repeated calls.)
"""
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
import mla_decode
from mla_decode.reference import generate_input

def kernels(prof):
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ev.sort(key=lambda e: e.time_range.start)
    return ev

for prefill in [int(a) for a in sys.argv[1:]] or [512, 4096, 6144]:
    config, x, kv = generate_input(batch_size=128, prefill=prefill, device="cuda")
    f = lambda: mla_decode.custom_kernel((config, x, kv))
    for _ in range(5):
        f(); kv.seq_len = prefill
    torch.cuda.synchronize()
    # wall, harness style
    ws = []
    for _ in range(30):
        torch.cuda.synchronize(); t0 = time.perf_counter(); f(); torch.cuda.synchronize()
        ws.append((time.perf_counter() - t0) * 1e6); kv.seq_len = prefill
    # graph of one call
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        f(); kv.seq_len = prefill
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            f()
    kv.seq_len = prefill
    torch.cuda.synchronize()
    gs = []
    for _ in range(30):
        torch.cuda.synchronize(); t0 = time.perf_counter(); g.replay(); torch.cuda.synchronize()
        gs.append((time.perf_counter() - t0) * 1e6)
    print(f"== prefill {prefill}: wall eager median {statistics.median(ws):.1f} mean {statistics.mean(ws):.1f} | graph replay wall {statistics.median(gs):.1f}")
    for mode in ("eager", "graph"):
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(6):
                torch.cuda.synchronize()
                with torch.profiler.record_function("CALL"):
                    if mode == "eager":
                        f(); kv.seq_len = prefill
                    else:
                        g.replay()
                torch.cuda.synchronize()
        ks = kernels(prof)
        calls = sorted([e for e in prof.events() if e.name == "CALL"], key=lambda e: e.time_range.start)
        per = {}
        lines = []
        for i, c in enumerate(calls):
            nxt = calls[i + 1].time_range.start if i + 1 < len(calls) else 1e30
            kk = [k for k in ks if c.time_range.start <= k.time_range.start < nxt]
            if not kk: continue
            t0 = c.time_range.start
            busy = sum(k.time_range.end - k.time_range.start for k in kk)
            span = kk[-1].time_range.end - kk[0].time_range.start
            lines.append((kk[0].time_range.start - t0, busy, span, kk[-1].time_range.end - t0, c.time_range.end - t0))
            for k in kk:
                per.setdefault(k.name[:60], []).append(k.time_range.end - k.time_range.start)
            if i == 3:
                print(f"  [{mode}] call 3 timeline (start offset from host call start, dur):")
                for k in kk:
                    print(f"     {k.time_range.start - t0:8.1f} {k.time_range.end - k.time_range.start:7.1f}  {k.name[:70]}")
        for l in lines[1:]:
            print(f"  [{mode}] first kernel at {l[0]:.1f}, busy {l[1]:.1f}, span {l[2]:.1f}, last end {l[3]:.1f}, host call {l[4]:.1f}")
        for n, v in per.items():
            print(f"  [{mode}] {statistics.median(v):8.1f} x{len(v)} {n}")
    del g
