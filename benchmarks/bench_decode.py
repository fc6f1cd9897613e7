"""The main job: correctness check and timing of custom_kernel at the task's shapes.

    python benchmarks/bench_decode.py [--prefills 512 2048 4096 6144] [--json FILE] [--plot FILE.png]

For each shape: one call checked against the literal reference under the
task's rule, then repeated calls on one cache timed as the task harness
times them (synchronize, wall clock, call, synchronize; median) and by
device events, and as the task's ranked mode does (new weight objects on
every call); the PyTorch absorbed baseline in the same run; % of the
device's speed-of-light floor (mla_decode.roofline's peaks, device picked by name).
Without a GPU it runs a reduced size on the PyTorch fallback and says so.
"""

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mla_decode  # noqa: E402
from mla_decode import roofline  # noqa: E402
from mla_decode.reference import generate_input, ref_kernel  # noqa: E402
from common import device_name, geomean, time_events, time_graph, time_wall  # noqa: E402

ATOL, RTOL = 8e-3, 2e-2


def task_rule_ok(out, ref):
    o, r = out.double(), ref.double()
    same_nonfinite = torch.equal(torch.isnan(o), torch.isnan(r)) and torch.equal(torch.isinf(o), torch.isinf(r))
    fin = torch.isfinite(r)
    ok = bool(((o[fin] - r[fin]).abs() <= ATOL + RTOL * r[fin].abs()).all())
    return ok and same_nonfinite, ((o[fin] - r[fin]).abs() / (ATOL + RTOL * r[fin].abs())).max().item()


def run_shape(prefill, bs, device, iters, reduced):
    shape = {} if not reduced else dict(dim=256, q_lora_rank=128, n_heads=8, kv_lora_rank=512, max_seq_len=512)
    config, x, kv = generate_input(batch_size=bs, prefill=prefill, seed=prefill, device=device, **shape)
    # correctness: one call against the literal reference
    kv_ref = kv.clone()
    dec = mla_decode.MLADecoder()
    y, _ = dec(config, x, kv)
    y_ref, _ = ref_kernel((config, x, kv_ref), batch_chunk=8)
    ok_y, ratio_y = task_rule_ok(y, y_ref)
    ok_c, _ = task_rule_ok(kv.data, kv_ref.data)
    del kv_ref, y_ref
    res = dict(prefill=prefill, bs=bs, backend=dec.last_backend, correct=ok_y and ok_c, err_ratio=ratio_y)
    if device == "cuda":
        torch.cuda.empty_cache()

    def step(d):
        return lambda: d(config, x, kv)

    # repeated calls on one cache, one new row each (as the harness does)
    res["us_harness"] = 1e3 * time_wall(step(dec), iters=iters)
    # the task's ranked mode: new weight objects on every call (cloned untimed before it)
    names = ("Q_proj_down_weight", "KV_proj_down_weight", "Q_proj_up_weight", "KV_proj_up_weight", "wo_weight")
    res["us_ranked"] = 1e3 * time_wall(lambda cfg: dec(cfg, x, kv), iters=iters,
                                       prepare=lambda: dataclasses.replace(
                                           config, **{n: getattr(config, n).clone() for n in names}))
    if device == "cuda":
        res["us_events"] = 1e3 * time_events(step(dec), iters=iters)
        # no captured graph (what a call costs when the weights sit at new addresses every time)
        res["us_eager"] = 1e3 * time_wall(step(mla_decode.MLADecoder(graphs=False)), iters=iters)
        try:  # device time alone (graph replay): harness minus this is host overhead
            res["us_graph"] = 1e3 * time_graph(step(dec), iters=iters)
        except Exception as e:  # noqa: BLE001 - a diagnostic column; say why it is missing
            res["us_graph"] = float("nan")
            print(f"  (graph replay failed: {type(e).__name__}: {e})")
        base = mla_decode.MLADecoder(backend="torch")
        res["us_torch_baseline"] = 1e3 * time_wall(step(base), iters=max(5, iters // 4))
    res["seq_len_after"] = kv.seq_len
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefills", type=int, nargs="+")
    ap.add_argument("--bs", type=int)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    reduced = not gpu
    prefills = args.prefills or ([512, 2048, 4096, 6144] if gpu else [64, 256])
    bs = args.bs or (128 if gpu else 2)
    iters = args.iters if gpu else min(args.iters, 5)
    name = device_name()
    print(f"# mla_decode bench_decode | device: {name} | backend: {mla_decode.backend(device)}")
    if reduced:
        print("# NO GPU: reduced size (bs=2, dim=256, 8 heads, prefill 64/256) on the PyTorch fallback; "
              "these numbers say nothing about the kernels")
    peaks = roofline.peaks_for(name) if gpu else None
    rows = []
    for p in prefills:
        r = run_shape(p, bs, device, iters, reduced)
        if peaks and not reduced:
            r["floor_us"] = roofline.floor_us(bs, p, peaks[0], peaks[1])
            r["pct_floor"] = 100 * r["floor_us"] / r["us_harness"]
            r["gbs"] = roofline.decode_bytes(bs, p) / r["us_harness"] / 1e3
            r["tflops"] = roofline.decode_flops(bs, p) / r["us_harness"] / 1e6
        rows.append(r)
        print(f"  prefill {p}: done ({r['backend']}, correct={r['correct']})", flush=True)

    hdr = f"{'prefill':>7} {'backend':>8} {'check':>5} {'us(harness)':>11} {'us(ranked)':>10} {'us(eager)':>9} {'us(events)':>10} {'us(graph)':>9} {'us(torch)':>9} {'floor us':>8} {'%floor':>6} {'GB/s':>6} {'TFLOP/s':>7}"
    print(hdr)
    print("(harness: wall clock between synchronizes, the task's method; ranked: the same with new weight objects"
          " every call, as the task's ranked mode; eager: without the captured graph; events: device events around one call;"
          " graph: CUDA-graph replay of one call = device time without host overhead; torch: the PyTorch absorbed baseline)")
    for r in rows:
        print(f"{r['prefill']:>7} {r['backend']:>8} {('ok' if r['correct'] else 'FAIL'):>5} {r['us_harness']:>11.1f} "
              f"{r['us_ranked']:>10.1f} {r.get('us_eager', float('nan')):>9.1f} "
              f"{r.get('us_events', float('nan')):>10.1f} {r.get('us_graph', float('nan')):>9.1f} "
              f"{r.get('us_torch_baseline', float('nan')):>9.1f} "
              f"{r.get('floor_us', float('nan')):>8.1f} {r.get('pct_floor', float('nan')):>6.1f} "
              f"{r.get('gbs', float('nan')):>6.0f} {r.get('tflops', float('nan')):>7.1f}")
    gm = geomean([r["us_harness"] for r in rows])
    line = f"geomean us (harness method): {gm:.1f} | ranked {geomean([r['us_ranked'] for r in rows]):.1f}"
    if gpu:
        line += (f" | events {geomean([r['us_events'] for r in rows]):.1f}"
                 f" | eager {geomean([r['us_eager'] for r in rows]):.1f}"
                 f" | graph replay {geomean([r['us_graph'] for r in rows]):.1f}"
                 f" | torch baseline {geomean([r['us_torch_baseline'] for r in rows]):.1f}")
    if peaks and not reduced:
        line += f" | floor {geomean([r['floor_us'] for r in rows]):.1f} ({peaks[2]} peaks)"
    print(line)
    if not all(r["correct"] for r in rows):
        print("CORRECTNESS CHECK FAILED for some shape (see 'check')")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, backend=mla_decode.backend(device), reduced=reduced, rows=rows,
                           geomean_us=gm), f, indent=1)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        xs = [r["prefill"] for r in rows]
        plt.figure(figsize=(6, 4))
        plt.plot(xs, [r["us_harness"] for r in rows], "o-", label="mla_decode (harness method)")
        if gpu:
            plt.plot(xs, [r["us_torch_baseline"] for r in rows], "s--", label="PyTorch absorbed baseline")
        if peaks and not reduced:
            plt.plot(xs, [r["floor_us"] for r in rows], "k:", label=f"speed of light ({peaks[2]})")
        plt.xlabel("prefill (cache rows)")
        plt.ylabel("us per call")
        plt.title(f"MLA decode, bs={bs}, {name}")
        plt.legend()
        plt.grid(alpha=0.3)
        plt.savefig(args.plot, dpi=120, bbox_inches="tight")
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
