"""Diagnostic: an op call that must raise (bad q shape) on the GPU."""
import torch
import mla_decode

q = torch.zeros(2, 1, 128, 512, dtype=torch.bfloat16, device="cuda")
kv = torch.zeros(2, 16, 576, dtype=torch.bfloat16, device="cuda")
sl = torch.full((2,), 4, dtype=torch.int32, device="cuda")
for name, fn in [("pybind", lambda: mla_decode._ext._C.attention(q, kv, sl, None, None, 0.1, False)),
                 ("torch.ops", lambda: torch.ops.mla_decode.attention(q, kv, sl, None, None, 0.1, False))]:
    try:
        fn()
        print(name, "no exception!")
    except Exception as e:
        print(name, type(e).__name__, str(e).splitlines()[0])
