"""Host time of one custom_kernel call at the task shape, part by part: each
call starts on an idle GPU (synchronize first) and is timed to its return,
without waiting for the GPU, so the numbers are the host's alone.

    python3 tools/host_time.py [prefill]
"""
import statistics
import sys
import time

import torch

import mla_decode
from mla_decode import kernel_choice
from mla_decode.decoder import rope_tables
from mla_decode.reference import generate_input
from mla_decode.validate import WEIGHTS, config_dims

prefill = int(sys.argv[1]) if len(sys.argv) > 1 else 512
config, x, kv = generate_input(batch_size=128, prefill=prefill, device="cuda")
dec = mla_decode.MLADecoder(backend="kernels")
for _ in range(3):
    dec(config, x, kv)
torch.cuda.synchronize()


def host_us(fn, n=50):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
        kv.seq_len = prefill  # (stay in place: the same row is rewritten)
    torch.cuda.synchronize()
    return statistics.median(ts)


C = mla_decode._ext.module()
sizes = config_dims(config)
table = rope_tables(x.device, 64, kv.data.shape[1]).cs
want = kernel_choice.step_want(x.device, mla_decode.validate.validate(config, x, kv))
ws = [getattr(config, n) for n in WEIGHTS]
kv.seq_len = prefill
print(f"prefill {prefill}: host us per call (median of 50, GPU idle at each start)")
print(f"  custom_kernel (Python + C++):   {host_us(lambda: mla_decode.custom_kernel((config, x, kv))):8.1f}")
print(f"  _C.decode_step alone:           {host_us(lambda: C.decode_step(x, *ws, kv.data, prefill, sizes, table, want)):8.1f}")
print(f"  torch.empty + fill (reference): {host_us(lambda: torch.full((128,), 5, dtype=torch.int32, device='cuda')):8.1f}")

# the stages' host time, each through its own op (the step calls the same C++ underneath)
bs, dim = 128, 7168
x2 = x.view(bs, dim)
q_lora = torch.empty(bs, 1536, dtype=torch.bfloat16, device="cuda")
kv_new = torch.empty(bs, 576, dtype=torch.bfloat16, device="cuda")
qbuf = torch.empty(128, bs, 576, dtype=torch.bfloat16, device="cuda")
wkv = config.KV_proj_up_weight.view(128, 256, 512)
seqlens = torch.full((bs,), prefill + 1, dtype=torch.int32, device="cuda")
o_lat = torch.empty(bs, 1, 128, 512, dtype=torch.bfloat16, device="cuda")
lse = torch.empty(bs, 128, 1, dtype=torch.float32, device="cuda")
obuf = torch.empty(bs, 128, 128, dtype=torch.bfloat16, device="cuda")
y = torch.empty(bs, dim, dtype=torch.bfloat16, device="cuda")
ops = torch.ops.mla_decode
stages = [
    ("down gemm_nt", lambda: ops.gemm_nt(x2, config.Q_proj_down_weight, q_lora, config.KV_proj_down_weight, kv_new,
                                         None, True)),
    ("query_fused + append", lambda: ops.query_fused(q_lora, config.Q_proj_up_weight, wkv[:, :128], qbuf[:, :, :512],
                                                     qbuf[:, :, 512:].transpose(0, 1), True, kv_new, seqlens, table,
                                                     kv.data, None)),
    ("attention_out (rope on the fly)", lambda: ops.attention_out(qbuf.transpose(0, 1).unsqueeze(1), kv.data, seqlens,
                                                                  None, table, 0.07, False, o_lat, lse, None, 512,
                                                                  None, None, False)),
    ("bmm W_UV", lambda: torch.bmm(o_lat.view(bs, 128, 512).transpose(0, 1), wkv[:, 128:].transpose(1, 2),
                                   out=obuf.transpose(0, 1))),
    ("wo cuBLASLt", lambda: C.gemm_nt_lt(obuf.view(bs, -1), config.wo_weight, y)),
]
for name, fn in stages:
    print(f"  {name + ':':31s} {host_us(fn):8.1f}")
