import statistics, sys, torch, mla_decode
from torch.profiler import profile, ProfilerActivity
mode = sys.argv[1]
bs = 128
if mode == "perhead":
    for h_q, dv, rope in [(32, 512, 16), (40, 64, 8)]:
        L = 4096
        kv = torch.randn(bs, L, dv, device="cuda", dtype=torch.bfloat16)
        kh = torch.randn(bs, L, h_q, rope, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(bs, 1, h_q, dv + rope, device="cuda", dtype=torch.bfloat16)
        seqlens = torch.full((bs,), L, dtype=torch.int32, device="cuda")
        call = lambda: mla_decode.mla_attention(q, kv, seqlens, 0.1, head_dim_v=dv, kpe_heads=kh)
        for _ in range(3): call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5): call()
            torch.cuda.synchronize()
        ks = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                ks.setdefault(e.name[:60], []).append(e.device_time)
        print(f"per-head h_q={h_q} dv={dv} rope={rope}: " + ", ".join(f"{k}: {statistics.median(v):.1f}" for k, v in ks.items()))
        del kv, kh, q
else:  # one attention call for ncu
    L, H = 4097, 128
    kv = torch.randn(bs, L, 576, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(bs, 1, H, 576, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.full((bs,), L, dtype=torch.int32, device="cuda")
    for _ in range(2):
        mla_decode.mla_attention(q, kv, seqlens, 0.07)
    torch.cuda.synchronize()
