"""A few attention calls at bs=128, H=128 for a profiler (ncu) to pick from.

    ncu --clock-control none -k regex:attention --launch-skip 2 --launch-count 1 \
        python3 tools/profile_attention.py 4097
"""
import sys

import torch

import mla_decode

L = int(sys.argv[1]) if len(sys.argv) > 1 else 4097
rope = len(sys.argv) > 2 and sys.argv[2] == "rope"
bs, H = 128, 128
kv = torch.randn(bs, L, 576, device="cuda", dtype=torch.bfloat16)
q = torch.randn(bs, 1, H, 576, device="cuda", dtype=torch.bfloat16)
sl = torch.full((bs,), L, dtype=torch.int32, device="cuda")
cs = mla_decode.rope_table(L, device="cuda") if rope else None
for _ in range(4):
    mla_decode.mla_attention(q, kv, sl, 0.07, rope_cs=cs)
torch.cuda.synchronize()
