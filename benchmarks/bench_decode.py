"""The main job: correctness and timing of custom_kernel at the task's shapes,
measured first the way the task's harness ranks it.

    python benchmarks/bench_decode.py [--prefills 512 2048 4096 6144] [--judged-only] [--json FILE] [--plot FILE.png]

1. Judged (benchmarks/harness.py, the harness's own loops): benchmark mode
   per shape (one checked call, then up to 100 timed calls on that cache,
   stopping at 1% standard error; MEAN, best, worst and the first timed
   call) and leaderboard mode on the last shape (fresh weights and cache and
   a check on every call). The geometric mean of the benchmark means is what
   ranks.
2. Steady state (second, for the kernels): the median of warmed calls on one
   cache by wall clock and by device events, a CUDA-graph replay of one call
   (device time without host overhead), the PyTorch absorbed baseline, and,
   when ``flash_mla`` imports, FlashMLA's attention with PyTorch for the rest
   (keys roped per call, as the task requires) in the same process.
Floors are mla_decode.roofline's for the device (picked by name).
Without a GPU it runs a reduced size on the PyTorch fallback and says so.
"""

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mla_decode  # noqa: E402
from mla_decode import roofline  # noqa: E402
from mla_decode.reference import generate_input, ref_kernel  # noqa: E402
from common import cell, device_name, flashmla, geomean, time_events, time_graph, time_wall  # noqa: E402
import harness  # noqa: E402

ATOL, RTOL = 8e-3, 2e-2


def task_rule(out, ref):
    """(ok, worst |out - ref| / (atol + rtol |ref|)) under the task's rule."""
    o, r = out.double(), ref.double()
    same_nonfinite = torch.equal(torch.isnan(o), torch.isnan(r)) and torch.equal(torch.isinf(o), torch.isinf(r))
    fin = torch.isfinite(r)
    ratio = ((o[fin] - r[fin]).abs() / (ATOL + RTOL * r[fin].abs())).max().item() if fin.any() else 0.0
    return same_nonfinite and ratio <= 1.0, ratio


def make_check(ref_chunk):
    def check(data, out):
        """data: the inputs as they were before the call (the cache a copy)."""
        config, x, kv = data
        y_ref, c_ref = ref_kernel((config, x, kv), batch_chunk=ref_chunk)
        ok_y, ry = task_rule(out[0], y_ref)
        ok_c, rc = task_rule(out[1], c_ref)
        return None if ok_y and ok_c else f"mismatch: y {ry:.3g}, cache {rc:.3g} (x the tolerance)"
    return check


class CallProbe:
    """What each judged call did besides the step (noted outside the timed
    span): the launch path of custom_kernel's decoder, whether the call
    captured its step, the device memory the caching allocator had to take
    from or give back to the driver, and the time in Python's garbage
    collector."""

    def __init__(self):
        self.gc_ns, self._gc_t0 = 0, None
        gc.callbacks.append(self._gc)

    def _gc(self, phase, info):
        if phase == "start":
            self._gc_t0 = time.perf_counter_ns()
        elif self._gc_t0 is not None:
            self.gc_ns += time.perf_counter_ns() - self._gc_t0
            self._gc_t0 = None

    @staticmethod
    def _driver_calls():
        if not torch.cuda.is_available():
            return 0, 0
        s = torch.cuda.memory_stats()
        return s.get("num_device_alloc", 0), s.get("num_device_free", 0)

    def before(self):
        calls = self._driver_calls()
        return calls, self.gc_ns  # (the collector's time read after this probe's own allocations)

    def after(self, token):
        (a0, f0), g0 = token
        g1 = self.gc_ns  # (before this probe's own allocations, which may start a collection)
        a1, f1 = self._driver_calls()
        dec = mla_decode.decoder._DEFAULT
        paths = dec.last_paths
        launch = (paths["launch"] + (", then captured" if paths.get("captured") else "")) if paths else dec.last_backend
        return dict(launch=launch, mallocs=a1 - a0, frees=f1 - f0, gc_us=(g1 - g0) / 1e3)


def slowest(st, n=3):
    """The n slowest timed calls of a harness loop: [(index, us, note)]."""
    order = sorted(range(len(st.us)), key=lambda i: -st.us[i])[:n]
    return [(i, st.us[i], st.notes[i]) for i in order]


def describe_slowest(calls):
    return "; ".join(f"call {i}: {us:.0f} us {n['launch']}" + (f", {n['mallocs']} cudaMalloc" if n["mallocs"] else "")
                     + (f", {n['frees']} cudaFree" if n["frees"] else "")
                     + (f", gc {n['gc_us']:.0f} us" if n["gc_us"] else "") for i, us, n in calls)


def inputs_maker(bs, prefill, device, reduced, seed):
    shape = {} if not reduced else dict(dim=256, q_lora_rank=128, n_heads=8, kv_lora_rank=512, max_seq_len=512)
    n = [seed]

    def make():
        n[0] += 13
        return generate_input(batch_size=bs, prefill=prefill, seed=n[0], device=device, **shape)
    return make


def flashmla_step():
    """FlashMLA's attention with PyTorch for the rest (absorbed; keys roped per
    call as the task requires), or None when flash_mla does not import."""
    flash_mla = flashmla()
    if flash_mla is None:
        return None
    from mla_decode.reference import rope_cos_sin, rope_rotate

    def step(data):
        config, x, kv = data
        bs, dim = x.shape[0], x.shape[2]
        H, nope, rope, v = config.n_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        r = config.kv_lora_rank
        x2 = x.view(bs, dim)
        q = (x2 @ config.Q_proj_down_weight.T) @ config.Q_proj_up_weight.T
        kv_new = x2 @ config.KV_proj_down_weight.T
        pos = kv.seq_len
        kv.data[:, pos] = kv_new
        kv.seq_len = L = pos + 1
        q = q.view(bs, H, nope + rope)
        wkv = config.KV_proj_up_weight.view(H, nope + v, r)
        q_abs = torch.bmm(q[:, :, :nope].transpose(0, 1), wkv[:, :nope]).transpose(0, 1)
        cq, sq = rope_cos_sin(torch.tensor([L - 1], device=x.device), rope)
        q_pe = rope_rotate(q[:, :, nope:], cq, sq)
        ck, sk = rope_cos_sin(torch.arange(L, device=x.device), rope)
        keys = torch.cat([kv.data[:, :L, :r], rope_rotate(kv.data[:, :L, r:], ck, sk)], dim=-1)
        page = 64
        Lp = (L + page - 1) // page * page
        pages = torch.zeros(bs, Lp, r + rope, dtype=torch.bfloat16, device=x.device)
        pages[:, :L] = keys
        pages = pages.view(bs * Lp // page, page, 1, r + rope)
        table = torch.arange(bs * Lp // page, dtype=torch.int32, device=x.device).view(bs, -1)
        lens = torch.full((bs,), L, dtype=torch.int32, device=x.device)
        meta, splits = flash_mla.get_mla_metadata(lens, H, 1)
        qf = torch.cat([q_abs, q_pe], dim=-1).unsqueeze(1)
        o, _ = flash_mla.flash_mla_with_kvcache(qf, pages, table, lens, r, meta, splits,
                                                softmax_scale=(nope + rope) ** -0.5, causal=True)
        o = torch.bmm(o[:, 0].transpose(0, 1), wkv[:, nope:].transpose(1, 2)).transpose(0, 1)
        y = o.reshape(bs, H * v) @ config.wo_weight.T
        return y.view(bs, 1, dim), kv.data
    return step


def run_shape(prefill, args, device, reduced, peaks, fm):
    make = inputs_maker(args.bs, prefill, device, reduced, seed=prefill)
    check = make_check(args.ref_chunk)
    res = dict(prefill=prefill, bs=args.bs)
    # 1. judged: the harness's benchmark mode with custom_kernel
    st, err = harness.benchmark_mode(mla_decode.custom_kernel, make, check, probe=args.probe)
    res["correct"] = err is None
    if err:
        res["error"] = err
        return res
    res.update(bench_mean=st.mean, bench_best=st.best, bench_worst=st.worst, bench_first=st.first, bench_runs=st.runs,
               bench_slowest=slowest(st))
    if args.judged_only:  # (the next shape's loops follow at once, as in the harness)
        return res
    if device == "cuda":
        torch.cuda.empty_cache()
    # 2. steady state on one cache
    config, x, kv = make()
    dec = mla_decode.MLADecoder()
    step = lambda: dec(config, x, kv)  # noqa: E731
    res["us_harness"] = 1e3 * time_wall(step, iters=args.iters)
    res["backend"] = dec.last_backend
    if device == "cuda":
        res["us_events"] = 1e3 * time_events(step, iters=args.iters)
        try:  # device time alone (one call captured and replayed): harness minus this is host overhead
            res["us_graph"] = 1e3 * time_graph(step, iters=args.iters)
        except Exception as e:  # noqa: BLE001 - a diagnostic column; say why it is missing
            res["us_graph"] = None
            print(f"  (graph replay failed: {type(e).__name__}: {e})")
        base = mla_decode.MLADecoder(backend="torch")
        res["us_torch"] = 1e3 * time_wall(lambda: base(config, x, kv), iters=max(5, args.iters // 4))
        if fm is not None:
            res["us_flashmla"] = 1e3 * time_wall(lambda: fm((config, x, kv)), iters=max(5, args.iters // 2))
    if peaks and not reduced:
        res["floor_us"] = roofline.floor_us(args.bs, prefill, peaks[0], peaks[1])
        res["gbs"] = roofline.decode_bytes(args.bs, prefill) / res["us_harness"] / 1e3
        res["tflops"] = roofline.decode_flops(args.bs, prefill) / res["us_harness"] / 1e6
    del config, x, kv
    return res


def print_steady(ok_rows):
    """The steady-state table (section 2); '-' marks a column not measured
    here (the device-time, peer and floor columns need a GPU)."""
    print("\n## steady state: warmed calls on one cache (median, us)")
    print("(harness: wall clock between synchronizes; events: device events around one call; graph: one call "
          "captured and replayed = device time; torch: PyTorch absorbed; flashmla: FlashMLA attention + PyTorch; "
          "'-': not measured here)")
    print(f"{'prefill':>7} {'harness':>8} {'events':>8} {'graph':>8} {'torch':>8} {'flashmla':>8} {'floor':>7} "
          f"{'%floor':>6} {'GB/s':>6} {'TFLOP/s':>7}")
    for r in ok_rows:
        fl = r.get("floor_us")
        pct = 100 * fl / r["us_harness"] if fl is not None else None
        print(f"{r['prefill']:>7} {cell(r['us_harness'], 8, '.1f')} {cell(r.get('us_events'), 8, '.1f')} "
              f"{cell(r.get('us_graph'), 8, '.1f')} {cell(r.get('us_torch'), 8, '.1f')} "
              f"{cell(r.get('us_flashmla'), 8, '.1f')} {cell(fl, 7, '.1f')} {cell(pct, 6, '.1f')} "
              f"{cell(r.get('gbs'), 6, '.0f')} {cell(r.get('tflops'), 7, '.1f')}")
    line = f"geomean us: harness {geomean([r['us_harness'] for r in ok_rows]):.1f}"
    for k in ("us_events", "us_graph", "us_torch", "us_flashmla", "floor_us"):
        if ok_rows and all(r.get(k) is not None for r in ok_rows):
            line += f" | {k[3:] if k.startswith('us_') else 'floor'} {geomean([r[k] for r in ok_rows]):.1f}"
    print(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefills", type=int, nargs="+")
    ap.add_argument("--bs", type=int)
    ap.add_argument("--iters", type=int, default=30, help="warmed calls per steady-state median")
    ap.add_argument("--ref-chunk", type=int, default=0,
                    help="sequences per chunk of the reference check (0: the whole batch at once, as the task's "
                         "reference: up to ~100 GB at prefill 6144; falls back to 16 where the GPU has less)")
    ap.add_argument("--no-leaderboard", action="store_true")
    ap.add_argument("--judged-only", action="store_true", help="the harness's loops alone (no steady-state section)")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--no-probe", action="store_true",
                    help="no notes on the judged calls (the probe reads the allocator's counters just before each "
                         "timed call, outside its span)")
    args = ap.parse_args()
    args.probe = None if args.no_probe else CallProbe()

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    reduced = not gpu
    prefills = args.prefills or ([512, 2048, 4096, 6144] if gpu else [64, 256])
    args.bs = args.bs or (128 if gpu else 2)
    args.iters = args.iters if gpu else min(args.iters, 5)
    if args.ref_chunk == 0:
        big = gpu and torch.cuda.get_device_properties(0).total_memory > 120e9
        args.ref_chunk = None if big or not gpu else 16
    name = device_name()
    print(f"# mla_decode bench_decode | device: {name} | backend: {mla_decode.backend(device)}")
    if reduced:
        print("# NO GPU: reduced size (bs=2, dim=256, 8 heads, prefill 64/256) on the PyTorch fallback; "
              "these numbers say nothing about the kernels")
    peaks = roofline.peaks_for(name) if gpu else None
    fm = flashmla_step() if gpu else None
    # the harness's warm-up: 0.2 s of calls on the first shape's own inputs
    harness.warm_up(mla_decode.custom_kernel, inputs_maker(args.bs, prefills[0], device, reduced, seed=1))
    rows = []
    for p in prefills:
        rows.append(run_shape(p, args, device, reduced, peaks, fm))
        r = rows[-1]
        print(f"  prefill {p}: correct={r['correct']} mean {r.get('bench_mean', float('nan')):.1f} "
              f"first {r.get('bench_first', float('nan')):.1f} steady {r.get('us_harness', float('nan')):.1f} us",
              flush=True)
    lb = None
    if not args.no_leaderboard and all(r["correct"] for r in rows):
        # (the checks here in chunks of 16 sequences: fresh inputs every call leave less room for the reference)
        st, err = harness.leaderboard_mode(mla_decode.custom_kernel,
                                           inputs_maker(args.bs, prefills[-1], device, reduced, seed=7),
                                           make_check(16), probe=args.probe)
        lb = dict(prefill=prefills[-1], error=err) if err else dict(prefill=prefills[-1], mean=st.mean, best=st.best,
                                                                    worst=st.worst, runs=st.runs, slowest=slowest(st))

    print("\n## judged: the task harness's loops (wall clock between synchronizes, us)")
    print(f"{'prefill':>7} {'check':>5} {'mean':>8} {'best':>8} {'worst':>8} {'first':>8} {'runs':>4}")
    for r in rows:
        if not r["correct"]:
            print(f"{r['prefill']:>7} {'FAIL':>5}  {r.get('error', '')}")
            continue
        print(f"{r['prefill']:>7} {'ok':>5} {r['bench_mean']:>8.1f} {r['bench_best']:>8.1f} {r['bench_worst']:>8.1f} "
              f"{r['bench_first']:>8.1f} {r['bench_runs']:>4}")
    ok_rows = [r for r in rows if r["correct"]]
    gm_bench = geomean([r["bench_mean"] for r in ok_rows])
    print(f"benchmark mode: geomean of means {gm_bench:.1f} us")
    if lb is not None:
        if lb.get("error"):
            print(f"leaderboard mode (prefill {lb['prefill']}): FAIL {lb['error']}")
        else:
            print(f"leaderboard mode (prefill {lb['prefill']}, fresh inputs every call): mean {lb['mean']:.1f} us, "
                  f"best {lb['best']:.1f}, worst {lb['worst']:.1f}, {lb['runs']} runs")
    if args.probe is not None:
        print("slowest judged calls (timed call index, us, launch path, driver allocations and garbage collection "
              "inside the call):")
        for r in ok_rows:
            print(f"  prefill {r['prefill']}: {describe_slowest(r['bench_slowest'])}")
        if lb is not None and not lb.get("error"):
            print(f"  leaderboard: {describe_slowest(lb['slowest'])}")

    if not args.judged_only:
        print_steady(ok_rows)
    correct = len(ok_rows) == len(rows) and not (lb and lb.get("error"))
    if not correct:
        print("CORRECTNESS CHECK FAILED (see 'check')")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, backend=mla_decode.backend(device), reduced=reduced, rows=rows,
                           leaderboard=lb, geomean_bench_mean=gm_bench), f, indent=1)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        xs = [r["prefill"] for r in ok_rows]
        plt.figure(figsize=(6, 4))
        plt.plot(xs, [r["bench_mean"] for r in ok_rows], "o-", label="mla_decode (harness mean)")
        if not args.judged_only:
            plt.plot(xs, [r["us_harness"] for r in ok_rows], "o--", label="mla_decode (steady median)")
        if gpu and not args.judged_only:
            plt.plot(xs, [r["us_torch"] for r in ok_rows], "s--", label="PyTorch absorbed")
        if peaks and not reduced:
            plt.plot(xs, [r["floor_us"] for r in ok_rows], "k:", label=f"speed of light ({peaks[2]})")
        plt.xlabel("prefill (cache rows)")
        plt.ylabel("us per call")
        plt.title(f"MLA decode, bs={args.bs}, {name}")
        plt.legend()
        plt.grid(alpha=0.3)
        plt.savefig(args.plot, dpi=120, bbox_inches="tight")
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
