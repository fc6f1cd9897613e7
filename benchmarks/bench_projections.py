"""The projection stages of the decode step at bs = 1, 32, 128 (task dims).

    python benchmarks/bench_projections.py [--bs 1 32 128] [--json FILE]

Each stage (mla_decode.projections: down = x W_qd^T and x W_kvd^T, query =
up-projection + W_UK absorption + RoPE and the cache append (inside the
fused query's launch where it runs, else the RoPE/cache-append kernel), output =
W_UV + wo) is captured in a
graph and replayed with the L2 cache flushed before each replay (device
events, median): the weights stream from memory as in a full step. GB/s is
over the weight bytes the stage must read; % is of the device's measured
copy bandwidth (a device-to-device copy, bytes read + written). Also shown:
the down stage as one GEMM against a concatenated copy of its weights (what
a single product over both weights could approach; the step does not copy
weights), and the wo GEMM alone. Every stage is timed three ways:
as the step runs them ("default": the down stage on our Hopper GEMM and the
query on our fused query kernel where they run, the rest on the vendor
BLAS), all on the vendor BLAS (the query as two vendor products), and,
where it runs (a Hopper build on a Hopper GPU), every product on our Hopper
kernels (MLA_DECODE_GEMM=sm90: the query fused, as by default; the RoPE
kernel is the same in all three). Beside each stage, the bare stream of its
weight bytes, timed the same way in the same run: one read of as many bytes
from one buffer at the device's streaming rate (`torch.ops.mla_decode.
stream_read`, a full wave of blocks that only loads), and the stage's time
over it (x bare: the ceiling a stage that reads its weights once can reach
is 1.0). Asserts nothing.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mla_decode import projections  # noqa: E402
from mla_decode.validate import Dims  # noqa: E402
from mla_decode.attention import rope_table  # noqa: E402
from mla_decode.reference import generate_input  # noqa: E402
from common import copy_bandwidth_gbs, device_name, time_graph_cold  # noqa: E402


def stages(bs):
    config, x, kv = generate_input(batch_size=bs, prefill=5, max_seq_len=16, seed=bs, device="cuda")
    H, nope, rope, v, r = (config.n_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim,
                           config.kv_lora_rank)
    dims = Dims(bs, config.dim, H, config.q_lora_rank, r, nope, rope, v, 16)
    wkv = config.KV_proj_up_weight.view(H, nope + v, r)
    x2 = x.view(bs, -1)
    w_down = torch.cat([config.Q_proj_down_weight, config.KV_proj_down_weight])
    down_out = torch.empty(bs, w_down.shape[0], dtype=torch.bfloat16, device="cuda")
    q_lora, kv_new = projections.down(x2, config.Q_proj_down_weight, config.KV_proj_down_weight)
    seqlens = torch.full((bs,), 6, dtype=torch.int32, device="cuda")
    tables = (rope_table(16, rope, "cuda"), None, None)
    qbuf = torch.empty(H, bs, r + rope, dtype=torch.bfloat16, device="cuda")
    o_lat = torch.randn(bs, H, r, device="cuda").to(torch.bfloat16)
    obuf = torch.empty(bs, H, v, dtype=torch.bfloat16, device="cuda")
    y = torch.empty(bs, config.dim, dtype=torch.bfloat16, device="cuda")
    nb = projections.stage_weight_bytes(dims)

    def query():  # as the step runs it: one launch where the fused query takes the RoPE and the append
        projections.query_rope_append(q_lora, config.Q_proj_up_weight, wkv[:, :nope], kv_new, seqlens, tables, qbuf,
                                      kv.data)

    return [
        ("down (two GEMMs, weights where they lie)", nb["down"],
         lambda: projections.down(x2, config.Q_proj_down_weight, config.KV_proj_down_weight)),
        ("down as one GEMM on a concatenated copy", nb["down"], lambda: projections.gemm(x2, w_down, down_out)),
        ("query (+ RoPE and cache append kernel)", nb["query"], query),
        ("output", nb["output"], lambda: projections.output(o_lat, wkv[:, nope:].transpose(1, 2),
                                                            config.wo_weight, obuf, y)),
        ("output: wo GEMM alone (as the step runs it)", 2 * config.wo_weight.numel(),
         lambda: projections.gemm(obuf.view(bs, -1), config.wo_weight, y, lt=True)),
        ("output: wo GEMM alone, PyTorch's default BLAS", 2 * config.wo_weight.numel(),
         lambda: projections.gemm(obuf.view(bs, -1), config.wo_weight, y)),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_projections needs a GPU (it times the vendor BLAS stages on the device)")
        return 1
    copy = copy_bandwidth_gbs()
    print(f"# bench_projections | device: {device_name()} | measured copy bandwidth {copy:.0f} GB/s "
          "(read + write)")
    print(f"{'bs':>4} {'stage':<48} {'GEMM':<8} {'weight MB':>9} {'us':>8} {'GB/s':>7} {'% copy BW':>9} "
          f"{'bare us':>8} {'x bare':>6}")
    rows = []
    bare_us = {}  # weight bytes -> the bare stream's us (the same for every bs and mode)

    def bare(nbytes):
        if nbytes not in bare_us:
            buf = torch.empty(nbytes // 16 * 16, dtype=torch.uint8, device="cuda")
            bare_us[nbytes] = 1e3 * time_graph_cold(lambda: torch.ops.mla_decode.stream_read(buf), iters=args.iters)
            del buf
        return bare_us[nbytes]

    saved = os.environ.get("MLA_DECODE_GEMM")
    for bs in args.bs:
        for mode in ("default", "vendor", "sm90"):
            if mode == "default":  # as the step runs: the down stage on the Hopper GEMM where it runs
                os.environ.pop("MLA_DECODE_GEMM", None)
            else:
                os.environ["MLA_DECODE_GEMM"] = mode
            x = torch.zeros(bs, 16, dtype=torch.bfloat16, device="cuda")
            path = projections.gemm_path(x, torch.zeros(64, 16, dtype=torch.bfloat16, device="cuda"), own=True)
            gemm = "default" if mode == "default" else "vendor" if path.startswith("vendor") else path
            if mode == "sm90" and gemm == "vendor":
                print(f"# the Hopper skinny GEMM does not run here ({path})")
                continue
            for name, nbytes, fn in stages(bs):
                us = 1e3 * time_graph_cold(fn, iters=args.iters)
                gbs = nbytes / us / 1e3
                b_us = bare(nbytes)
                rows.append(dict(bs=bs, stage=name, gemm=gemm, weight_bytes=nbytes, us=us, gbs=gbs,
                                 pct_copy=100 * gbs / copy, bare_us=b_us, x_bare=us / b_us))
                print(f"{bs:>4} {name:<48} {gemm:<8} {nbytes / 1e6:>9.1f} {us:>8.1f} {gbs:>7.0f} "
                      f"{100 * gbs / copy:>9.1f} {b_us:>8.1f} {us / b_us:>6.2f}", flush=True)
            torch.cuda.empty_cache()
    if saved is None:
        os.environ.pop("MLA_DECODE_GEMM", None)
    else:
        os.environ["MLA_DECODE_GEMM"] = saved
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device_name(), copy_gbs=copy, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
