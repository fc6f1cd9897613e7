"""A few attention calls at bs=128, H=128 (or --bs, --heads) for a profiler (ncu) to pick from.

    ncu --clock-control none -k regex:attention --launch-skip 2 --launch-count 1 \
        python3 tools/profile_attention.py 4097 [rope] [--plan-once] [--paged] [--heads=H] [--bs=N]
    ncu --clock-control none -k regex:flash_fwd_splitkv --launch-skip 2 --launch-count 1 \
        python3 tools/profile_attention.py 4097 --flashmla

One cache [128, L rounded up to 64, 576] bf16 and one q, the same seed for
both kernels. --plan-once passes a plan made beforehand (as FlashMLA's
metadata is); --paged reads the same memory as 64-row pages in order
through a block table (the serving layout; against the dense read it
isolates the paged path's cost); --flashmla runs FlashMLA's kernel instead (keys as stored, the
cache read as 64-row pages in order; needs `import flash_mla` to work, which
this repository never provides).
"""
import sys

import torch

import mla_decode

args = [a for a in sys.argv[1:] if not a.startswith("--")]
L = int(args[0]) if args else 4097
rope = len(args) > 1 and args[1] == "rope"
bs = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--bs=")), 128)
H = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--heads=")), 128)
Lp = (L + 63) // 64 * 64
torch.manual_seed(0)
kv = torch.randn(bs, Lp, 576, device="cuda", dtype=torch.bfloat16)
q = torch.randn(bs, 1, H, 576, device="cuda", dtype=torch.bfloat16)
sl = torch.full((bs,), L, dtype=torch.int32, device="cuda")
if "--flashmla" in sys.argv:
    import flash_mla

    pages = kv.view(bs * Lp // 64, 64, 1, 576)
    table = torch.arange(bs * Lp // 64, dtype=torch.int32, device="cuda").view(bs, Lp // 64)
    meta = flash_mla.get_mla_metadata(sl, H, 1)

    def call():
        flash_mla.flash_mla_with_kvcache(q, pages, table, sl, 512, meta[0], meta[1], softmax_scale=0.07, causal=False)
else:
    cs = mla_decode.rope_table(Lp, device="cuda") if rope else None
    plan = torch.ops.mla_decode.plan(sl, 1, H, Lp) if "--plan-once" in sys.argv else None

    if "--paged" in sys.argv:
        pages = kv.view(bs * Lp // 64, 64, 576)
        table = torch.arange(bs * Lp // 64, dtype=torch.int32, device="cuda").view(bs, Lp // 64)

        def call():
            mla_decode.mla_attention(q, pages, sl, 0.07, block_table=table, rope_cs=cs, plan=plan)
    else:
        def call():
            mla_decode.mla_attention(q, kv, sl, 0.07, rope_cs=cs, plan=plan)
for _ in range(5):
    call()
torch.cuda.synchronize()
