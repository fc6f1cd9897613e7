"""The attention calls' kernels on the device timeline, as engines run them:
10 calls captured in one CUDA graph (rotating over cache sets), replayed 5
times under torch.profiler; per kernel its mean duration, per call the span
from the first kernel's start to the last one's end, and the gaps between
consecutive kernels (negative: a programmatic dependent launched early and
waited). The plan (FlashMLA: its metadata) is made once; the cache is read as
64-row pages in order. FlashMLA's kernels beside ours when `import
flash_mla` works (never part of this repository), unless NO_FM=1.

    python3 tools/attention_timeline.py h_q:L[:bs] ...     (bs 128 unless given)
"""
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_attention as ba  # noqa: E402
import common  # noqa: E402

fm = None if os.environ.get("NO_FM") else common.flashmla()


for a in sys.argv[1:]:
    h_q, L, *rest = map(int, a.split(":"))
    bs = rest[0] if rest else 128
    runs, parts = ba.paged_call_runs(h_q, L, bs, fm)
    for name, fn in runs:
        g = common._capture(fn)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
        ev = sorted([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA],
                    key=lambda e: e.time_range.start)
        dur = collections.defaultdict(list)
        for e in ev:
            dur[e.name[:60]].append(e.time_range.end - e.time_range.start)
        span = (ev[-1].time_range.end - ev[0].time_range.start) / 50
        busy = sum(e.time_range.end - e.time_range.start for e in ev) / 50
        gaps = collections.defaultdict(list)
        for x, y in zip(ev, ev[1:]):
            gaps[(x.name[:25], y.name[:25])].append(y.time_range.start - x.time_range.end)
        print(f"{name} h_q {h_q} L {L} bs {bs} parts {parts}: span/call {span:.1f} us, "
              f"kernel busy/call {busy:.1f} us")
        for k, v in dur.items():
            print(f"   {len(v):4d} x {sum(v) / len(v):8.2f} us  {k}")
        for k, v in gaps.items():
            print(f"   gap {len(v):4d} x {sum(v) / len(v):6.2f} us  {k[0]} -> {k[1]}")
        del g
    del runs
    torch.cuda.empty_cache()
