"""Tensor-parallel decode step (mla_decode.tp) against one GPU, at bs=128.

    torchrun --nproc_per_node=2 benchmarks/bench_tp.py [--prefills 512 2048 4096 6144] [--json FILE]

Per prefill: the single-GPU step (TP=1, rank 0, MLADecoder on the full
weights) and the sharded step on all ranks, both timed as the task harness
times (synchronize, wall clock, call, synchronize; repeated calls on one
cache; ranks aligned by a barrier before each call, outside the timing), and
the reduction of y alone (TPDecoder.reduce: one bf16 all-reduce for two NCCL
ranks, else fp32; device events). "rank share" is the step without the
all-reduce; the "graph" columns are device time alone (a CUDA graph of one
call replayed, no host work), so graph / graph is the ratio the kernels
allow and the harness ratio adds host time and the wait for the slower
rank. Median of --iters.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 unless set)."""

import argparse
import json
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mla_decode  # noqa: E402
from mla_decode.reference import generate_input  # noqa: E402
from mla_decode.tp import TPDecoder  # noqa: E402
from common import time_events, time_graph, wall_ranks  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefills", type=int, nargs="+", default=[512, 2048, 4096, 6144])
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"# bench_tp | TP={world} | {mla_decode.backend(dev)} | bs={args.bs} | NCCL_NVLS_ENABLE="
              f"{os.environ.get('NCCL_NVLS_ENABLE')}", flush=True)
    rows = []
    for prefill in args.prefills:
        config, x, kv = generate_input(batch_size=args.bs, prefill=prefill, seed=prefill, device=dev)
        t1 = t1g = float("nan")
        if rank == 0:
            kv1 = kv.clone()
            single = mla_decode.MLADecoder(backend="kernels")
            t1 = wall_ranks(lambda: single(config, x, kv1), args.iters, aligned=False)
            t1g = time_graph(lambda: single(config, x, kv1), iters=args.iters) * 1e3
            del kv1
        dist.barrier()
        tp = TPDecoder(config, rank, world, backend="kernels")
        tn = wall_ranks(lambda: tp(x, kv), args.iters)
        tpart = wall_ranks(lambda: tp.partial(x, kv), args.iters)  # this rank's share, no all-reduce
        tpg = time_graph(lambda: tp.partial(x, kv), iters=args.iters) * 1e3  # its device time alone
        tdev = time_events(lambda: tp(x, kv), iters=args.iters) * 1e3     # one whole step by device events
        y = torch.zeros(args.bs, config.dim, dtype=torch.bfloat16, device=dev)
        ar = time_events(lambda: tp.reduce(y), iters=args.iters) * 1e3  # the step's own reduction of y
        got = [None] * world
        dist.all_gather_object(got, (tn, tpart, tpg, tdev))
        if rank == 0:
            tn = max(g[0] for g in got)
            row = dict(prefill=prefill, tp=world, tp1_us=t1, tp1_graph_us=t1g, tpn_us=tn, ratio=tn / t1,
                       allreduce_us=ar, partial_us=max(g[1] for g in got), partial_graph_us=max(g[2] for g in got),
                       step_events_us=max(g[3] for g in got))
            rows.append(row)
            print(f"  prefill {prefill:>5}: TP=1 {t1:7.1f} us (graph {t1g:6.1f}) | TP={world} {tn:7.1f} us "
                  f"(slowest rank) = {row['ratio']:.2f}x | rank share {row['partial_us']:6.1f} us "
                  f"(graph {row['partial_graph_us']:6.1f} = {row['partial_graph_us'] / t1g:.2f}x) | "
                  f"step by events {row['step_events_us']:6.1f} us | "
                  f"all-reduce of y alone {ar:5.1f} us", flush=True)
        del config, x, kv, tp
        torch.cuda.empty_cache()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), tp=world, rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
