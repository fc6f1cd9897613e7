"""The attention under sustained load, as a serving engine keeps the GPU
busy: 10 calls captured in one CUDA graph (rotating over cache sets, 64-row
pages in order, the plan or FlashMLA's metadata made once), replayed back to
back for 0.8 s windows, ours and FlashMLA's alternated three times. Per
window: us per call (events around the window), and the mean SM clock and
board power sampled through NVML every 5 ms after the window's first fifth,
with the cycles per call they imply. Under sustained load the GPU lowers its
clock to stay within its power cap, so a kernel that draws less power per
cycle keeps a higher clock: short timings at full clock do not show that.
FlashMLA's windows run when `import flash_mla` works (never part of this
repository), unless NO_FM=1. Needs NVML (the nvidia-ml-py package).

    python3 tools/attention_sustained.py h_q:L[:bs] ...     (bs 128 unless given)
"""
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_attention as ba  # noqa: E402
import common  # noqa: E402

fm = None if os.environ.get("NO_FM") else common.flashmla()

try:
    import pynvml
except ImportError:
    sys.exit("attention_sustained: needs NVML (pip install nvidia-ml-py)")
pynvml.nvmlInit()
NVML = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())


def window(graph, calls, secs=0.8):
    """(us per call, mean MHz, mean W) over `secs` of back-to-back replays."""
    samples, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            samples.append((pynvml.nvmlDeviceGetClockInfo(NVML, pynvml.NVML_CLOCK_SM),
                            pynvml.nvmlDeviceGetPowerUsage(NVML) / 1000))
            time.sleep(0.005)

    th = threading.Thread(target=poll)
    th.start()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0, k, marks = time.time(), 0, []
    a.record()
    while time.time() - t0 < secs:
        graph.replay()
        k += 1
        marks.append(torch.cuda.Event())
        marks[-1].record()
        if len(marks) > 20:  # the host stays within 20 replays of the device, whose queue never empties
            marks.pop(0).synchronize()
    b.record()
    torch.cuda.synchronize()
    stop.set()
    th.join()
    s = samples[len(samples) // 5:]
    return a.elapsed_time(b) * 1e3 / (k * calls), sum(x[0] for x in s) / len(s), sum(x[1] for x in s) / len(s)


for a in sys.argv[1:]:
    h_q, L, *rest = map(int, a.split(":"))
    bs = rest[0] if rest else 128
    runs, _ = ba.paged_call_runs(h_q, L, bs, fm)
    graphs = {name: common._capture(fn) for name, fn in runs}
    for r in range(3):
        for name, _ in (runs if r % 2 == 0 else runs[::-1]):
            us, mhz, watts = window(graphs[name], ba.GRAPH_CALLS)
            print(f"h_q {h_q} L {L} bs {bs} round {r} {name:8s}: {us:8.1f} us/call  {mhz:5.0f} MHz  {watts:4.0f} W  "
                  f"{us * mhz / 1e3:7.1f} kcycles/call", flush=True)
    del graphs, runs
    torch.cuda.empty_cache()
