"""Decode context parallelism for the serving API (mla_decode.dcp_attention):
attention over a paged cache split across N GPUs, against one GPU.

    python3 benchmarks/bench_dcp.py [--worlds 1 2 4] [--means 16384 32768] [--bs 128] [--h-q 128] [--iters 30]
    python3 benchmarks/bench_dcp.py --layer [--worlds 1 2 4] [--prefills 6144] [--iters 30]
    python3 benchmarks/bench_dcp.py --collectives [--worlds 2 4] [--iters 30]

Per world size N (those above the visible GPU count are skipped, said in one
line): N processes, one per GPU (torch.multiprocessing, NCCL; NVLink
multicast off unless NCCL_NVLS_ENABLE is set). Per mean length: bs lengths
drawn uniformly from [mean / 2, 3 mean / 2] (one seed, the same on every rank
and for every N), the interleaved layout (token t on rank t mod N, vLLM's),
pages of 64 rows; each rank builds its own pages directly (random bf16 rows
in place of a real cache: the content does not change the time), q [bs, 1,
h_q, 576] bf16, the same on every rank, dv 512.

Timed on every rank with device events around one call (median of --iters
after 3 warm-up calls; the ranks aligned by a barrier before each call,
outside the timing); the numbers printed are the slowest rank's medians:

- step: dcp_attention (the rank's attention, its split planned in the call,
  then the all-gather of (out, lse) and the merge: every rank gets all
  heads); for N = 1 it is the attention alone;
- attention: mla_attention on the rank's pages alone;
- gather + merge: the all-gather of the rank's (out, lse) and the merge alone;
- step, heads scattered: dcp_attention(..., scatter_heads=True) (every rank
  gets h_q / N heads: the LSEs all-gathered, the partials scaled and
  reduce-scattered in fp32), and that merge alone;
- tokens/s per GPU: bs / step / N (one new token per sequence per step), and
  its ratio to N = 1, for both;
- cache per GPU: the rank's pages in GB (the longest rank);
- longest mean context per GPU: the mean length at which bs sequences' pages
  would fill the free memory measured on the rank before its cache was made
  (computed from torch.cuda.mem_get_info, not run).

With --layer: the DCP decode step of custom_kernel's layer
(mla_decode.dcp_step.DCPDecoder) at the task's shape, bs 128, per
--prefills (default 6144), for each N: the step timed as the task harness
times it (synchronize, wall clock, call, synchronize; the ranks aligned by
a barrier outside the timing; repeated calls at one position), one step by
device events, and the exchange alone (all-gather of (out, lse) and the
merge); beside it, on rank 0, custom_kernel's own step on the whole cache
(its replayed graph) and DCPDecoder with N = 1.

With --collectives: each collective of the two merge paths alone at the
task's sizes (the all-gathers of out and lse, the reduce-scatter of the
heads in fp32 and bf16, the all-reduce of y in fp32).

A benchmark asserts nothing; tests/test_dcp.py and tests/test_dcp_step.py
check the results."""

import argparse
import os
import socket
import statistics
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import wall_ranks  # noqa: E402

D, DV, PAGE = 576, 512, 64


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lengths(bs, mean, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(mean // 2, mean * 3 // 2 + 1, (bs,), generator=g, dtype=torch.int32)


def rank_pages(lens_local, dev, seed):
    """A rank's paged cache: its sequences' pages one after another, random rows."""
    npages = [(int(n) + PAGE - 1) // PAGE for n in lens_local]
    total = max(1, sum(npages))
    g = torch.Generator(device=dev).manual_seed(seed)
    k_cache = torch.randn(total, PAGE, 1, D, generator=g, device=dev, dtype=torch.bfloat16)
    width = max(1, max(npages))
    table = torch.zeros(len(npages), width, dtype=torch.int32)
    start = 0
    for b, n in enumerate(npages):
        table[b, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    return k_cache, table.to(dev)


def timed(fn, iters):
    times = []
    for i in range(iters + 3):
        torch.cuda.synchronize()
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def join(rank, world, port):
    """A spawned rank's GPU made current and its NCCL group joined; returns the device."""
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=dev)
    return dev


def worker(rank, world, port, args, queue):
    import mla_decode
    from mla_decode import dcp_attention, dcp_local_lengths, mla_attention
    from mla_decode.dcp import _all_gather_pair, _merge_scatter_heads, merge_attention_states

    dev = join(rank, world, port)
    try:
        scale = D ** -0.5
        for mean in args.means:
            lens = lengths(args.bs, mean, seed=mean)
            local = dcp_local_lengths(lens, rank, world)
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(dev)[0]
            k_cache, table = rank_pages(local.tolist(), dev, seed=1000 * world + rank)
            sl = local.to(dev)
            g = torch.Generator(device=dev).manual_seed(7)  # the same q on every rank
            q = torch.randn(args.bs, 1, args.h_q, D, generator=g, device=dev, dtype=torch.bfloat16)
            step = timed(lambda: dcp_attention(q, k_cache, table, sl, DV, scale), args.iters)
            attn = timed(lambda: mla_attention(q, k_cache, sl, scale, block_table=table, head_dim_v=DV),
                         args.iters)
            out, lse = mla_attention(q, k_cache, sl, scale, block_table=table, head_dim_v=DV)
            out, lse = out.contiguous(), lse.float().contiguous()
            if world > 1:
                comm = timed(lambda: merge_attention_states(*_all_gather_pair(out, lse, world, None)), args.iters)
                step_sc = timed(lambda: dcp_attention(q, k_cache, table, sl, DV, scale, scatter_heads=True),
                                args.iters)
                comm_sc = timed(lambda: _merge_scatter_heads(out, lse, world, rank, None, q.dtype, True),
                                args.iters)
            else:
                comm, step_sc, comm_sc = 0.0, step, 0.0
            cache_gb = k_cache.numel() * 2 / 1e9
            longest = world * free / (args.bs * D * 2)
            vals = torch.tensor([step, attn, comm, cache_gb, step_sc, comm_sc], dtype=torch.float64, device=dev)
            dist.all_reduce(vals, op=dist.ReduceOp.MAX)
            low = torch.tensor([longest], dtype=torch.float64, device=dev)
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            if rank == 0:
                queue.put(dict(world=world, mean=mean, step=vals[0].item(), attn=vals[1].item(),
                               comm=vals[2].item(), cache_gb=vals[3].item(), step_sc=vals[4].item(),
                               comm_sc=vals[5].item(), longest=low.item(),
                               device=torch.cuda.get_device_name(dev), backend=mla_decode.backend("cuda")))
            del k_cache, table, q, out, lse
    finally:
        dist.destroy_process_group()


def layer_worker(rank, world, port, args, queue):
    import mla_decode
    from mla_decode.dcp import _all_gather_pair, merge_attention_states
    from mla_decode.dcp_step import DCPDecoder, dcp_shard_task_cache
    from mla_decode.reference import generate_input

    dev = join(rank, world, port)
    try:
        for prefill in args.prefills:
            config, x, kv = generate_input(batch_size=args.bs, prefill=prefill, seed=prefill, device=dev)
            one = one_ev = float("nan")
            if world == 1:
                def again(f, cache):
                    def call():
                        f(config, x, cache)
                        cache.seq_len = prefill
                    return call
                one = wall_ranks(again(mla_decode.MLADecoder(), kv), args.iters)
                one_ev = timed(again(mla_decode.MLADecoder(), kv), args.iters)
            local = dcp_shard_task_cache(kv, rank, world)
            del kv
            torch.cuda.empty_cache()
            dec = DCPDecoder()

            def step():
                dec(config, x, local)
                local.seq_len = prefill
            t = wall_ranks(step, args.iters)
            ev = timed(step, args.iters)
            H = config.n_heads
            out = torch.zeros(args.bs, 1, H, config.kv_lora_rank, dtype=torch.bfloat16, device=dev)
            lse = torch.zeros(args.bs, H, 1, dtype=torch.float32, device=dev)
            ex = timed(lambda: merge_attention_states(*_all_gather_pair(out, lse, world, None)), args.iters) \
                if world > 1 else 0.0
            vals = torch.tensor([t, ev, ex], dtype=torch.float64, device=dev)
            dist.all_reduce(vals, op=dist.ReduceOp.MAX)
            if rank == 0:
                queue.put(dict(world=world, prefill=prefill, step=vals[0].item(), events=vals[1].item(),
                               exchange=vals[2].item(), single=one, single_ev=one_ev, backend=dec.last_backend,
                               device=torch.cuda.get_device_name(dev)))
            del local, config, x
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


def collectives_worker(rank, world, port, args, queue):
    """Each collective of the DCP paths alone, at the task's sizes (bs, h_q
    heads of 512 latent columns, y of 7168), device events."""
    dev = join(rank, world, port)
    try:
        b, h = args.bs, args.h_q
        out = torch.zeros(b, 1, h, DV, dtype=torch.bfloat16, device=dev)
        lse = torch.zeros(b, h, 1, dtype=torch.float32, device=dev)
        heads32 = torch.zeros(h, b, 1, DV, dtype=torch.float32, device=dev)
        heads16 = heads32.to(torch.bfloat16)
        y32 = torch.zeros(b, 7168, dtype=torch.float32, device=dev)
        outs = torch.empty(world, *out.shape, dtype=out.dtype, device=dev)
        lses = torch.empty(world, *lse.shape, dtype=lse.dtype, device=dev)
        m32 = torch.empty(h // world, b, 1, DV, dtype=torch.float32, device=dev)
        m16 = m32.to(torch.bfloat16)
        rows = {
            "all-gather out (bf16)": (out.numel() * 2, lambda: dist.all_gather_into_tensor(outs, out)),
            "all-gather lse (fp32)": (lse.numel() * 4, lambda: dist.all_gather_into_tensor(lses, lse)),
            "reduce-scatter heads (fp32)": (heads32.numel() * 4, lambda: dist.reduce_scatter_tensor(m32, heads32)),
            "reduce-scatter heads (bf16)": (heads16.numel() * 2, lambda: dist.reduce_scatter_tensor(m16, heads16)),
            "all-reduce y (fp32)": (y32.numel() * 4, lambda: dist.all_reduce(y32)),
        }
        res = {}
        for name, (nbytes, fn) in rows.items():
            t = timed(fn, args.iters)
            v = torch.tensor([t], dtype=torch.float64, device=dev)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            res[name] = (nbytes, v.item())
        if rank == 0:
            queue.put(dict(world=world, rows=res, device=torch.cuda.get_device_name(dev)))
    finally:
        dist.destroy_process_group()


def main_collectives(args, ngpu, ctx):
    args.worlds = [w for w in args.worlds if w > 1]
    rows = run_worlds(collectives_worker, args, ngpu, ctx)
    if not rows:
        return 1
    print(f"# mla_decode bench_dcp --collectives | {rows[0]['device']} | bs {args.bs}, h_q {args.h_q}, dv {DV} | "
          f"the slowest rank's medians, us (MB: the tensor each rank passes in)")
    for r in rows:
        for name, (nbytes, t) in r["rows"].items():
            print(f"N={r['world']} {name:<28} {nbytes / 1e6:>7.2f} MB {t:>8.1f} us")
    return 0


def run_worlds(fn, args, ngpu, ctx):
    """fn(rank, world, port, args, queue) in `world` processes for each
    world size of args.worlds that the visible GPUs allow; the rows rank 0
    put on the queue."""
    rows = []
    for world in args.worlds:
        if world > ngpu:
            print(f"# N = {world}: skipped, {ngpu} GPU(s) visible")
            continue
        queue = ctx.Queue()
        mp.start_processes(fn, args=(world, free_port(), args, queue), nprocs=world, join=True, start_method="spawn")
        while not queue.empty():
            rows.append(queue.get())
    return rows


def main_layer(args, ngpu, ctx):
    rows = run_worlds(layer_worker, args, ngpu, ctx)
    if not rows:
        return 1
    print(f"# mla_decode bench_dcp --layer | {rows[0]['device']} | backend {rows[0]['backend']} | bs {args.bs} | "
          f"the slowest rank's medians, us")
    print("(x 1 GPU: against custom_kernel's own step on one GPU, harness against harness, events against events)")
    print(f"{'N':>2} {'prefill':>7} {'DCP step (harness)':>18} {'x 1 GPU':>7} {'DCP step (events)':>17} "
          f"{'x 1 GPU':>7} {'exchange':>8} {'custom_kernel, one GPU (harness / events)':>41}")
    base = {r["prefill"]: r for r in rows if r["world"] == 1}
    for r in sorted(rows, key=lambda r: (r["prefill"], r["world"])):
        ref = base.get(r["prefill"])
        rel = f"{r['step'] / ref['single']:.2f}" if ref else "-"
        rel_ev = f"{r['events'] / ref['single_ev']:.2f}" if ref else "-"
        one = f"{r['single']:.1f} / {r['single_ev']:.1f}" if r["world"] == 1 else ""
        print(f"{r['world']:>2} {r['prefill']:>7} {r['step']:>18.1f} {rel:>7} {r['events']:>17.1f} {rel_ev:>7} "
              f"{r['exchange']:>8.1f} {one:>41}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--means", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--bs", type=int, default=128)
    ap.add_argument("--h-q", type=int, default=128)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--layer", action="store_true", help="the DCP decode step of the layer instead of serving")
    ap.add_argument("--prefills", type=int, nargs="+", default=[6144], help="with --layer")
    ap.add_argument("--collectives", action="store_true", help="each collective of the DCP paths alone")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_dcp: needs GPUs (none visible)")
        return 1
    ngpu = torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    if args.layer:
        return main_layer(args, ngpu, ctx)
    if args.collectives:
        return main_collectives(args, ngpu, ctx)
    rows = run_worlds(worker, args, ngpu, ctx)
    if not rows:
        return 1
    print(f"# mla_decode bench_dcp | {rows[0]['device']} | backend {rows[0]['backend']} | bs {args.bs}, "
          f"h_q {args.h_q}, s_q 1, d {D}, dv {DV}, pages of {PAGE}, interleaved layout | slowest rank's medians")
    print(f"{'N':>2} {'mean L':>7} {'step us':>8} {'attn us':>8} {'gather+merge us':>15} {'tok/s/GPU':>10} "
          f"{'x N=1':>6} {'scattered: step us':>18} {'merge us':>8} {'tok/s/GPU':>10} {'x N=1':>6} "
          f"{'cache GB/GPU':>12} {'longest mean L/GPU':>18}")
    base = {r["mean"]: r for r in rows if r["world"] == 1}
    for r in sorted(rows, key=lambda r: (r["mean"], r["world"])):
        tps = args.bs / (r["step"] * 1e-6) / r["world"]
        tps_sc = args.bs / (r["step_sc"] * 1e-6) / r["world"]
        ref = base.get(r["mean"])
        one = args.bs / (ref["step"] * 1e-6) if ref else None
        rel = f"{tps / one:.2f}" if one else "-"
        rel_sc = f"{tps_sc / one:.2f}" if one else "-"
        print(f"{r['world']:>2} {r['mean']:>7} {r['step']:>8.1f} {r['attn']:>8.1f} {r['comm']:>15.1f} {tps:>10.0f} "
              f"{rel:>6} {r['step_sc']:>18.1f} {r['comm_sc']:>8.1f} {tps_sc:>10.0f} {rel_sc:>6} "
              f"{r['cache_gb']:>12.2f} {r['longest']:>18.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
