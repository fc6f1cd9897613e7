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
import mla_decode  # noqa: E402

fm = None
if not os.environ.get("NO_FM"):
    try:
        import flash_mla as fm
    except ImportError:
        fm = None

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
    t0, k = time.time(), 0
    a.record()
    while time.time() - t0 < secs:
        graph.replay()
        k += 1
        if k % 20 == 0:
            torch.cuda.synchronize()  # (the host stays within 20 replays of the device)
    b.record()
    torch.cuda.synchronize()
    stop.set()
    th.join()
    s = samples[len(samples) // 5:]
    return a.elapsed_time(b) * 1e3 / (k * calls), sum(x[0] for x in s) / len(s), sum(x[1] for x in s) / len(s)


for a in sys.argv[1:]:
    h_q, L, *rest = map(int, a.split(":"))
    bs = rest[0] if rest else 128
    n = ba.n_sets(bs, L, h_q, ("no",))
    sets = ba.make_sets(n, bs, L, h_q, ("no",), "cuda")
    seqlens = torch.full((bs,), L, dtype=torch.int32, device="cuda")
    plan = torch.ops.mla_decode.plan(seqlens, 1, h_q, ba.pad(L))
    out = torch.empty(bs, 1, h_q, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(bs, h_q, 1, device="cuda")
    pg = [ba.pages_of(kv) for _, kv, _ in sets]

    def ours():
        for j in range(10):
            mla_decode.mla_attention(sets[j % n][0], pg[j % n][0], seqlens, ba.SCALE, block_table=pg[j % n][1],
                                     out=out, lse=lse, plan=plan)

    runs = [("ours", ours)]
    if fm is not None:
        meta = fm.get_mla_metadata(seqlens, h_q, 1)

        def theirs():
            for j in range(10):
                fm.flash_mla_with_kvcache(sets[j % n][0], pg[j % n][0], pg[j % n][1], seqlens, 512, meta[0], meta[1],
                                          softmax_scale=ba.SCALE, causal=False)

        runs.append(("FlashMLA", theirs))
    graphs = {name: common._capture(fn) for name, fn in runs}
    for r in range(3):
        for name, _ in (runs if r % 2 == 0 else runs[::-1]):
            us, mhz, watts = window(graphs[name], 10)
            print(f"h_q {h_q} L {L} bs {bs} round {r} {name:8s}: {us:8.1f} us/call  {mhz:5.0f} MHz  {watts:4.0f} W  "
                  f"{us * mhz / 1e3:7.1f} kcycles/call", flush=True)
    del graphs, sets, pg
    torch.cuda.empty_cache()
