"""Where the harness-style wall time of a graphed decoder call goes: device events around the step's launch
(the C++ launcher's x copy, graph launch and y copy; or the graph's replay where PyTorch lacks
CUDAGraph.raw_cuda_graph_exec) inside the call.

    python3 tools/probe_replay.py PREFILL
"""
import statistics
import sys
import time

import torch

import mla_decode
from mla_decode.reference import generate_input

prefill = int(sys.argv[1])
config, x, kv = generate_input(batch_size=128, prefill=prefill, device="cuda")
dec = mla_decode.MLADecoder()
for _ in range(3):
    dec(config, x, kv)
torch.cuda.synchronize()
entry = next(iter(dec._graphs.values()))
rec = {}


class G:  # the captured step's launch (C++ launcher: x in, graph, y out; else the graph's replay), with events around it
    def __init__(self, inner, name):
        self.inner, self.name = inner, name

    def __getattr__(self, attr):
        fn = getattr(self.inner, attr)
        if attr != self.name:
            return fn

        def timed(*args):
            rec["t1"] = time.perf_counter()
            e1 = torch.cuda.Event(enable_timing=True); e1.record()
            out = fn(*args)
            e2 = torch.cuda.Event(enable_timing=True); e2.record()
            rec["e1"], rec["e2"] = e1, e2
            return out
        return timed


if getattr(entry, "launcher", None) is not None:
    entry.launcher = G(entry.launcher, "launch")
else:
    entry.graph = G(entry.graph, "replay")


def run(fn, n=40):
    rows = []
    for _ in range(n + 3):
        torch.cuda.synchronize()
        e0 = torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter(); e0.record()
        fn()
        e3 = torch.cuda.Event(enable_timing=True); e3.record()
        torch.cuda.synchronize(); t3 = time.perf_counter()
        rows.append(((t3 - t0) * 1e6, (rec["t1"] - t0) * 1e6, e0.elapsed_time(rec["e1"]) * 1e3,
                     rec["e1"].elapsed_time(rec["e2"]) * 1e3, rec["e2"].elapsed_time(e3) * 1e3))
    rows = rows[3:]
    return [statistics.median(c) for c in zip(*rows)]


launch = (lambda: entry.launcher.launch(x, kv.seq_len + 1)) if getattr(entry, "launcher", None) is not None \
    else (lambda: entry.graph.replay())
for name, fn in (("whole decoder call", lambda: dec(config, x, kv)),
                 ("entry call", lambda: entry(x, kv.seq_len + 1)),
                 ("launch alone", launch)):
    w, hpre, dpre, drep, dpost = run(fn)
    print(f"{name:<20} wall {w:7.1f} | host to replay {hpre:6.1f} | events: start->replay {dpre:6.1f} replay {drep:7.1f} after {dpost:6.1f} us")
