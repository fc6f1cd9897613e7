"""Per-kernel device time of one attention call (planner, attention, combine)
at bs=128, H=128, from torch.profiler: where the fixed cost of short
sequences goes.

    python3 tools/attention_breakdown.py 513 2049 6145 [--rope]
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import mla_decode

rope = "--rope" in sys.argv
lengths = [int(a) for a in sys.argv[1:] if not a.startswith("--")] or [513, 6145]
bs, H = 128, 128
for L in lengths:
    kv = torch.randn(bs, L, 576, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(bs, 1, H, 576, device="cuda", dtype=torch.bfloat16)
    sl = torch.full((bs,), L, dtype=torch.int32, device="cuda")
    cs = mla_decode.rope_table(L, device="cuda") if rope else None
    out = torch.empty(bs, 1, H, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(bs, H, 1, device="cuda")
    for _ in range(5):
        mla_decode.mla_attention(q, kv, sl, 0.07, rope_cs=cs, out=out, lse=lse)
    torch.cuda.synchronize()
    n = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            mla_decode.mla_attention(q, kv, sl, 0.07, rope_cs=cs, out=out, lse=lse)
        torch.cuda.synchronize()
    print(f"L={L} rope={rope}: mean device us per call")
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "self_device_time_total", 0) > 0:
            t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            if t > 0:
                print(f"  {e.key[:70]:70s} {t / n:9.1f} us  x{e.count // n}")
