"""Per-kernel GPU time of one custom_kernel call (torch.profiler), task shape.

    python3 tools/profile_decode.py [prefill]
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import mla_decode
from mla_decode.reference import generate_input

prefill = int(sys.argv[1]) if len(sys.argv) > 1 else 512
config, x, kv = generate_input(batch_size=128, prefill=prefill, device="cuda")
dec = mla_decode.MLADecoder()
for _ in range(3):
    dec(config, x, kv)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        dec(config, x, kv)
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
