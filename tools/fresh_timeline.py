"""Where a call on fresh inputs spends its time: custom_kernel called as the
task harness's leaderboard mode calls it (new weights and a new cache every
call, each made and copied just before, the previous output checked against
the reference in between), under torch.profiler. Per call, microseconds
from the call's start (host clock, the profiler's): the host reaching its
first launch, the attention's launch and its return; the device starting
the first kernel and the attention, and ending the last kernel; the
kernels' busy time and the device's idle time inside the step.

    python3 tools/fresh_timeline.py [--prefill 6144] [--calls 8] [--same] [--names]

--same: the same inputs every call (the benchmark mode's timed calls) for
comparison. The profiler adds a few us to every launch; compare rows of one
run, not with the harness's means.
"""
import argparse
import dataclasses
import os
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import mla_decode
from mla_decode.reference import generate_input, ref_kernel

LAUNCH_APIS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
               "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync", "cuMemcpyAsync")


def is_attention(name):
    n = name.replace("(anonymous namespace)", "").split("(")[0].lower()  # (the name, not the parameters' types)
    return "attention" in n and "combine" not in n and "plan" not in n and "maps" not in n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=6144)
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--same", action="store_true")
    ap.add_argument("--names", action="store_true", help="print the kernels' names of the first call")
    a = ap.parse_args()

    def make():
        return generate_input(batch_size=a.bs, prefill=a.prefill, device="cuda")

    # the harness's warm-up and checked first call (not profiled)
    config, x, kv = make()
    with torch.no_grad():
        for _ in range(3):
            mla_decode.custom_kernel((config, x, kv))
            kv.seq_len = a.prefill
    torch.cuda.synchronize()
    held = {"data": (config, x, kv)}
    rows, ran = [], []
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(a.calls):
            if not a.same:
                held["data"] = make()
            config, x, kv = held["data"]
            kv.seq_len = a.prefill
            kv_copy = kv.clone()
            cfg_copy = dataclasses.replace(config, Q_proj_down_weight=config.Q_proj_down_weight.clone())
            torch.cuda.synchronize()
            with torch.profiler.record_function(f"CALL{i}"):
                y, _ = mla_decode.custom_kernel((config, x, kv))
            with torch.profiler.record_function(f"SYNC{i}"):
                torch.cuda.synchronize()
            ran.append(mla_decode.kernel_choice.describe_step_paths(mla_decode.decoder._DEFAULT._ran))
            if not a.same:  # the check (its host and device work), as the harness runs it between calls
                ref_kernel((cfg_copy, x, kv_copy), batch_chunk=8)
                torch.cuda.synchronize()
            del y
    ev = list(prof.events())
    per_kernel = {}
    for i in range(a.calls):
        cpu = torch.autograd.DeviceType.CPU
        call = next(e for e in ev if e.name == f"CALL{i}" and e.device_type == cpu)
        t0, t1 = call.time_range.start, call.time_range.end
        t_sync = next(e for e in ev if e.name == f"SYNC{i}" and e.device_type == cpu).time_range.end
        apis = sorted((e for e in ev if e.device_type == torch.autograd.DeviceType.CPU and e.name in LAUNCH_APIS
                       and t0 <= e.time_range.start <= t1), key=lambda e: e.time_range.start)
        kern = sorted((e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA
                       and t0 <= e.time_range.start <= t_sync), key=lambda e: e.time_range.start)
        if i == 0 and a.names:
            print("kernels of call 0:", [k.name[:90] for k in kern])
        if not apis or not kern:
            continue
        for k in kern:
            if k.name.startswith("CALL"):
                continue
            short = k.name.replace("(anonymous namespace)", "").split("(")[0].split("::")[-1]
            short = short.replace("void ", "")[:40]
            per_kernel.setdefault(short, []).append(k.time_range.end - k.time_range.start)
        att = [k for k in kern if is_attention(k.name)]
        # the launch API call that launched the attention: the last launch before the attention kernel began
        att_api = [e for e in apis if att and e.time_range.start <= att[0].time_range.start]
        busy = 0.0
        end = kern[0].time_range.start
        for k in kern:  # union of the kernels' intervals
            s, f = max(k.time_range.start, end), k.time_range.end
            if f > s:
                busy += f - s
            end = max(end, f)
        span = kern[-1].time_range.end - kern[0].time_range.start
        rows.append(dict(first_api=apis[0].time_range.start - t0,
                         att_api=(att_api[-1].time_range.start - t0) if att_api else float("nan"),
                         ret=t1 - t0, launches=len(apis),
                         first_kernel=kern[0].time_range.start - t0,
                         att_start=(att[0].time_range.start - t0) if att else float("nan"),
                         last_end=kern[-1].time_range.end - t0, busy=busy, idle=span - busy,
                         kernels=len(kern), path=ran[i]["launch"] + (", captured" if ran[i]["captured"] else "")))
    mode = "same inputs" if a.same else "fresh inputs, checked between calls"
    print(f"== prefill {a.prefill}, bs {a.bs}, {mode}; {torch.cuda.get_device_name()}; paths {ran[-1]}")
    cols = ["first_api", "att_api", "ret", "first_kernel", "att_start", "last_end", "busy", "idle", "launches",
            "kernels", "path"]
    print("call | " + " | ".join(cols))
    for i, r in enumerate(rows):
        print(f"{i} | " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    print("kernels (device us, median over the calls; n):",
          "; ".join(f"{n} {statistics.median(v):.1f} ({len(v)})" for n, v in per_kernel.items()))
    if rows:
        print("median | " + " | ".join(f"{statistics.median(r[c] for r in rows):.1f}" for c in cols[:-1]))


if __name__ == "__main__":
    main()
