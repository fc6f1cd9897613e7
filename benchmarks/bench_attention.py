"""Attention kernel alone against FlashMLA in the same process, on the same inputs.

    python benchmarks/bench_attention.py                        # the default rows
    python benchmarks/bench_attention.py --heads 128 64 --lengths 2049 8193
    python benchmarks/bench_attention.py --rope no --iters 30 --json out.json
    python benchmarks/bench_attention.py --dry-run              # the rows and their memory; no GPU needed

Rows (bs 128 or --bs, s_q 1, keys 576 = 512 latent + 64 rope, dv 512):
  default (neither --heads nor --lengths given): h_q 128 at L 513, 1025,
    2049, 4097, 6145, 8193; h_q 16, 32 and 64 at L 4096 and 16384.
  --heads H... and/or --lengths L...: every h_q at every L (the one left
    out: h_q 128, or the h_q-128 lengths above).
  --small-batch: small batches at long contexts, (h_q, bs, L) = (128, 1,
    32769), (128, 8, 8193), (128, 16, 65537), (128, 8, 131073), (16, 32,
    131073), (128, 512, 4097): where the split plan decides.
  --rope yes|kpe|no ...: the key modes of every row. Default: all three at
    h_q 128, "no" alone at other h_q.
Key modes: "yes" rotates the keys' rope columns on the fly (rope_cs, what
the decode step does); "kpe" reads them from a separate, already rotated
buffer; "no" uses the keys as stored, which is what FlashMLA does: the
comparison with FlashMLA is made on "no" rows only.

Inputs, per row: each cache set is one dense cache kv [bs, Lpad, 576] bf16,
Lpad = L rounded up to 64 rows, with the rows past L filled with NaN (both
kernels must ignore them; a read past the length shows as NaN), and one q
[bs, 1, h_q, 576]. FlashMLA (when ``import flash_mla`` works; FlashMLA is
never part of this repository) gets the SAME memory as 64-row pages,
kv.view(bs * Lpad / 64, 64, 1, 576), with block_table = arange in order,
the same q, the same lengths (int32) and the same softmax scale;
get_mla_metadata is called once per row (as FlashMLA's own benchmark
does). Several sets per row, rotated from call to call so that no call
finds its cache in L2 (enough sets for 200 MB, at least 2, at most what
fits in 4 GB); FlashMLA gets the same sets in the same rotation.

Check, once per row and key mode before timing: on "no" rows, max |ours -
FlashMLA| over the outputs of set 0 (ours planned in the call and with the
plan made once), flagged MISMATCH above 5e-2 or when either has a NaN; without FlashMLA, and on yes/kpe rows, only NaN in ours
is flagged. A benchmark asserts nothing: a flagged row is timed and printed.

Timing, both sides with the same inputs, row by row so clocks and heat
match:
- graphs (rope "no" rows; --no-graphs skips them): device time per call
  of GRAPH_CALLS calls captured in one CUDA graph, rotating over the sets,
  median of --graph-reps replays between two events (common.time_graph_calls:
  how engines run the attention). Ours with the plan made once, FlashMLA
  with its metadata made once, both reading the cache as 64-row pages in
  order and scattered (the same pages in a random order, as a serving
  engine's free list leaves them); MHz / FM: the SM clock (NVML) read
  right after ours and FlashMLA's graph timing of pages in order (under
  sustained load the GPU lowers it, so rows are comparable only at like
  clocks). Checked first on set 0: ours scattered
  against ours in order (the same bits, else SCATTER-DIFFERS) and each
  layout against FlashMLA.
- eager (common.time_events): device events around --batch calls back to
  back (the launch queue kept full: the device time per call, host launch
  overhead not counted; --batch 1 counts it), median of --iters such pairs:
  ours with each call planning its split (`us`: one planner launch ahead of
  the attention, mla_attention's default), ours with the plan made once and
  passed as plan= (`us plan1`), then, on "no" rows, FlashMLA (`FlashMLA`).
- one call (rope "no" rows): device events around a single call after a
  synchronize (`1 call`, ours planning in the call; `FM 1`, FlashMLA): what a
  caller that waits on each call sees, the host's launch path included.
- host (rope "no" rows): host microseconds per call, `perf_counter` around
  10 calls enqueued back to back, no synchronize between them (`host`,
  `FM host`): the Python wrapper, its checks and its launches.
An eager loop flatters whoever has the cheaper Python wrapper (FlashMLA's
costs 40-80 us of host time per call): compare kernels by the graph columns.

Columns: h_q, bs, L, rope, parts (the parts the planner cut the batch into),
comb (us of the combine alone on this plan's splits, in a graph as g us, its
partials in L2; '-' where nothing is split) |
g us, FM g, xFM g (graphs, pages in order), g us sc, FM g sc, xFM sc (scattered),
TFLOP/s, TB/s and % of floor of g us (floor = max(bytes/BW, FLOPs/peak) with
mla_decode.roofline's peaks for the device) | us, us plan1, FlashMLA, xFM, xFM
plan1 (eager) | 1 call, FM 1, host, FM host | max|d| (ours - FlashMLA) and the
flag. xFM = FlashMLA us / ours (> 1: ours faster). Last line: the geometric
means of the four ratios over the "no" rows, also per h_q. --kernel
portable|hopper forces our kernel (MLA_DECODE_ATTN_KERNEL; the portable kernel
is the one AMD builds run). --json FILE writes the same fields per row. Without
a GPU it prints why and exits 1; without flash_mla it says so in one line and
the FlashMLA columns read "-"."""

import argparse
import gc
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mla_decode  # noqa: E402
from mla_decode import _ext, roofline  # noqa: E402
import common  # noqa: E402
from common import add_timing_args, cell, dump_json, geomean, gpu_setup, host_ms, rates  # noqa: E402

D, DV, PAGE = 576, 512, 64
S_Q, H_KV = 1, 1  # one query row per sequence, one latent key head
SCALE = 0.0722  # softmax scale, the same for both kernels
ROPES = ("yes", "kpe", "no")
H128_LENGTHS = (513, 1025, 2049, 4097, 6145, 8193)
DEFAULT_ROWS = [(128, L) for L in H128_LENGTHS] + [(h, L) for h in (16, 32, 64) for L in (4096, 16384)]
# (h_q, bs, L): small batches at long contexts, where the split plan decides
SMALL_BATCH_ROWS = [(128, 1, 32769), (128, 8, 8193), (128, 16, 65537), (128, 8, 131073), (16, 32, 131073),
                    (128, 512, 4097)]
L2_BYTES = 200e6  # the sets of a row together exceed this (L2 is 50-60 MB) ...
SETS_BYTES = 4e9  # ... and stay under this (never fewer than 2 sets)
MISMATCH = 5e-2  # max |ours - FlashMLA| above which a row is flagged
GRAPH_CALLS = 10  # calls captured per CUDA graph (rotating over the sets)


def pad(L):
    """L rounded up to whole 64-row pages."""
    return (L + PAGE - 1) // PAGE * PAGE


def row_specs(heads=None, lengths=None, ropes=None, bs=128, small_batch=False):
    """[(h_q, L, key modes, bs)]: the small-batch rows, or the default rows
    when neither heads nor lengths is given, else every h_q at every L (at
    batch bs)."""
    if small_batch:
        return [(h, L, tuple(ropes) if ropes else ("no",), b) for h, b, L in SMALL_BATCH_ROWS]
    if heads is None and lengths is None:
        pairs = DEFAULT_ROWS
    else:
        pairs = [(h, L) for h in (heads or [128]) for L in (lengths or H128_LENGTHS)]
    return [(h, L, tuple(ropes) if ropes else (ROPES if h == 128 else ("no",)), bs) for h, L in pairs]


def set_bytes(bs, L, h_q, ropes):
    """Device bytes of one cache set: kv, q and, for kpe, the rope buffer."""
    Lp = pad(L)
    return 2 * (bs * Lp * D + bs * h_q * D + (bs * Lp * 64 if "kpe" in ropes else 0))


def n_sets(bs, L, h_q, ropes):
    """Sets rotated in a row: past L2 between reuses, under SETS_BYTES, >= 2."""
    b = set_bytes(bs, L, h_q, ropes)
    return max(2, min(math.ceil(L2_BYTES / b), int(SETS_BYTES // b)))


def make_sets(n, bs, L, h_q, ropes, device):
    """n sets of (q, kv, kpe or None) with the rows past L of kv (and kpe) NaN."""
    Lp = pad(L)
    sets = []
    for _ in range(n):
        kv = torch.randn(bs, Lp, D, device=device, dtype=torch.bfloat16)
        kv[:, L:] = float("nan")
        q = torch.randn(bs, S_Q, h_q, D, device=device, dtype=torch.bfloat16)
        kpe = None
        if "kpe" in ropes:
            kpe = torch.randn(bs, Lp, 64, device=device, dtype=torch.bfloat16)
            kpe[:, L:] = float("nan")
        sets.append((q, kv, kpe))
    return sets


def pages_of(kv):
    """FlashMLA's view of a dense cache: the same memory as 64-row pages in
    order, and the block table that walks them."""
    bs, Lp, d = kv.shape
    pages = kv.view(bs * Lp // PAGE, PAGE, 1, d)
    table = torch.arange(bs * Lp // PAGE, dtype=torch.int32, device=kv.device).view(bs, Lp // PAGE)
    return pages, table


def scattered(pages, table, gen):
    """The same pages stored in a random order (as a serving engine's free
    list leaves them) and the block table that finds them: logical page i
    lives at physical page perm[i]."""
    perm = torch.randperm(pages.shape[0], generator=gen).to(pages.device)
    spread = torch.empty_like(pages)
    spread[perm] = pages
    return spread, perm.to(torch.int32)[table.long()]


def paged_call_runs(h_q, L, bs, fm=None):
    """For the tools that replay graphs of the attention: (runs, parts).
    runs: [(name, fn)], fn a zero-argument function making GRAPH_CALLS calls
    on rotated cache sets read as 64-row pages in order, ours with the plan
    made once ("ours") and, given the flash_mla module, FlashMLA with its
    metadata made once ("FlashMLA"); the functions keep their inputs alive.
    parts: the plan's part count."""
    n = n_sets(bs, L, h_q, ("no",))
    sets = make_sets(n, bs, L, h_q, ("no",), "cuda")
    seqlens = torch.full((bs,), L, dtype=torch.int32, device="cuda")
    plan = torch.ops.mla_decode.plan(seqlens, 1, h_q, pad(L))
    out = torch.empty(bs, 1, h_q, DV, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(bs, h_q, 1, device="cuda")
    pg = [pages_of(kv) for _, kv, _ in sets]

    def ours():
        for j in range(GRAPH_CALLS):
            mla_decode.mla_attention(sets[j % n][0], pg[j % n][0], seqlens, SCALE, block_table=pg[j % n][1],
                                     out=out, lse=lse, plan=plan)

    runs = [("ours", ours)]
    if fm is not None:
        meta = fm.get_mla_metadata(seqlens, h_q, 1)

        def theirs():
            for j in range(GRAPH_CALLS):
                fm.flash_mla_with_kvcache(sets[j % n][0], pg[j % n][0], pg[j % n][1], seqlens, DV, meta[0], meta[1],
                                          softmax_scale=SCALE, causal=False)

        runs.append(("FlashMLA", theirs))
    return runs, int(plan[0])


def check_row(ours, theirs):
    """(max |ours - theirs| or None, flag or ''): NaN in either, or a
    difference above MISMATCH, is flagged; theirs None checks ours for NaN."""
    if torch.isnan(ours).any():
        return None, "NaN"
    if theirs is None:
        return None, ""
    if torch.isnan(theirs).any():
        return None, "NaN(FlashMLA)"
    d = (ours.float() - theirs.float()).abs().max().item()
    return d, ("MISMATCH" if d > MISMATCH else "")


def measure_row(h_q, L, ropes, bs, args, peaks, fm, device="cuda", time_events=None):
    """The result rows of one (h_q, L, bs): one per key mode."""
    time_events = time_events or common.time_events
    Lp = pad(L)
    n = n_sets(bs, L, h_q, ropes)
    sets = make_sets(n, bs, L, h_q, ropes, device)
    seqlens = torch.full((bs,), L, dtype=torch.int32, device=device)
    cs = mla_decode.rope_table(Lp, device=device) if "yes" in ropes else None
    out = torch.empty(bs, S_Q, h_q, DV, device=device, dtype=torch.bfloat16)
    lse = torch.empty(bs, h_q, S_Q, device=device)
    # the plan made once, for the capacity the call itself plans with (kv's rows, Lpad)
    plan = torch.ops.mla_decode.plan(seqlens, S_Q, h_q, Lp)
    parts = int(plan[0])  # (the parts the planner cut the batch into: plan.h)
    paged = meta = fm_error = None
    if fm is not None and "no" in ropes:
        paged = [pages_of(kv) for _, kv, _ in sets]
        try:  # FlashMLA's metadata, made once per row as its benchmark does
            meta = fm.get_mla_metadata(seqlens, S_Q * h_q // H_KV, H_KV)
        except Exception as e:  # noqa: BLE001 - a benchmark flags, it does not stop
            paged, fm_error = None, f"get_mla_metadata: {type(e).__name__}: {e}"
            print(f"  (h_q {h_q} L {L}: FlashMLA failed: {fm_error})", flush=True)
    fl = roofline.attention_flops(bs, L, h_q)
    by = roofline.attention_bytes(bs, L, h_q)
    rows = []
    for rope in ropes:
        it = [0]

        def ours(plan=None, i=None):
            j = i if i is not None else it[0] % n  # i: the check's set; else the next in the rotation
            it[0] += i is None
            q, kv, kpe = sets[j]
            mla_decode.mla_attention(q, kv, seqlens, SCALE, rope_cs=cs if rope == "yes" else None, out=out, lse=lse,
                                     kpe=kpe if rope == "kpe" else None, plan=plan)

        def flash(i=None):
            j = i if i is not None else it[0] % n  # i: the check's set; else the next in the rotation
            it[0] += i is None
            pages, table = paged[j]
            return fm.flash_mla_with_kvcache(sets[j][0], pages, table, seqlens, DV, meta[0], meta[1],
                                             softmax_scale=SCALE, causal=False)[0]

        row = dict(h_q=h_q, L=L, Lpad=Lp, bs=bs, rope=rope, n_sets=n, parts=parts)
        if fm_error and rope == "no":
            row["flashmla_error"] = fm_error
        # checked once on set 0, both ways of planning, before any timing
        try:
            ours(None, i=0)
            mine = [out.clone()]
            ours(plan, i=0)
            mine.append(out.clone())
            theirs = None
            if paged and rope == "no":
                try:
                    theirs = flash(i=0)
                except Exception as e:  # noqa: BLE001 - a benchmark flags, it does not stop
                    row["flashmla_error"] = f"{type(e).__name__}: {e}"
                    print(f"  (h_q {h_q} L {L}: FlashMLA failed: {row['flashmla_error']})", flush=True)
            checks = [check_row(o, theirs) for o in mine]
            diffs = [d for d, _ in checks if d is not None]
            row["max_diff_flashmla"] = max(diffs) if diffs else None
            flags = {f for _, f in checks if f} | ({"FLASHMLA-ERROR"} if "flashmla_error" in row else set())
            row["flag"] = " ".join(sorted(flags))
            del mine, theirs
        except Exception as e:  # noqa: BLE001
            row.update(error=f"{type(e).__name__}: {e}", flag="ERROR")
            print(f"  (h_q {h_q} L {L} rope {rope}: ours failed: {row['error']})", flush=True)
            rows.append(row)
            continue
        us = time_events(ours, iters=args.iters, batch=args.batch) * 1e3
        us1 = time_events(lambda: ours(plan), iters=args.iters, batch=args.batch) * 1e3
        row.update(rates(us, fl, by, peaks), us_plan_once=us1)
        if rope == "no":  # one call after a synchronize (host path included), and the host's time per call
            row.update(us_one=time_events(ours, iters=args.iters, batch=1) * 1e3,
                       host_us=host_ms(ours, iters=args.iters) * 1e3)
        if paged and rope == "no" and "flashmla_error" not in row:
            fus = time_events(flash, iters=args.iters, batch=args.batch) * 1e3
            row.update(us_flashmla=fus, vs_flashmla=fus / us, vs_flashmla_plan_once=fus / us1,
                       us_one_flashmla=time_events(flash, iters=args.iters, batch=1) * 1e3,
                       host_us_flashmla=host_ms(flash, iters=args.iters) * 1e3)
        if args.graphs and rope == "no":
            row.update(measure_graphs(sets, seqlens, plan, h_q, out, lse, fm if paged else None, meta, args, fl, by,
                                      peaks))
            row["flag"] = " ".join(f for f in (row["flag"], row.pop("graph_flag", "")) if f)
        rows.append(row)
    return rows  # the sets are freed with this frame (main then empties the allocator's cache)


def measure_graphs(sets, seqlens, plan, h_q, out, lse, fm, meta, args, flops, nbytes, peaks):
    """Device time per call in CUDA graphs (GRAPH_CALLS calls per graph on
    the rotated sets, median of --graph-reps replays), ours with the plan
    made once and FlashMLA with its metadata made once, both reading the
    cache as 64-row pages in order and scattered. Checked first on set 0:
    ours scattered against ours in order (the same bits), and each layout
    against FlashMLA's."""
    gen = torch.Generator().manual_seed(1234)
    layouts = {"order": [pages_of(kv) for _, kv, _ in sets]}
    layouts["scatter"] = [scattered(p, t, gen) for p, t in layouts["order"]]
    res, flags = {}, set()

    def ours(lay, j):
        pages, table = layouts[lay][j]
        mla_decode.mla_attention(sets[j][0], pages, seqlens, SCALE, block_table=table, out=out, lse=lse, plan=plan)

    def flash(lay, j):
        pages, table = layouts[lay][j]
        return fm.flash_mla_with_kvcache(sets[j][0], pages, table, seqlens, DV, meta[0], meta[1],
                                         softmax_scale=SCALE, causal=False)[0]

    first = {}
    for lay in layouts:
        ours(lay, 0)
        first[lay] = out.clone()
        if fm is not None:
            d, f = check_row(first[lay], flash(lay, 0))
            flags.add(f)
            res[f"max_diff_flashmla_{lay}"] = d
    if not torch.equal(first["order"], first["scatter"]):
        flags.add("SCATTER-DIFFERS")
    n = len(sets)
    for lay in layouts:
        us = common.time_graph_calls([lambda j=j: ours(lay, j % n) for j in range(GRAPH_CALLS)],
                                     reps=args.graph_reps) * 1e3
        res[f"g_us_{lay}"] = us
        res[f"g_mhz_{lay}"] = common.sm_clock_mhz()
        if fm is not None:
            fus = common.time_graph_calls([lambda j=j: flash(lay, j % n) for j in range(GRAPH_CALLS)],
                                          reps=args.graph_reps) * 1e3
            res[f"g_flashmla_{lay}"] = fus
            res[f"g_fm_mhz_{lay}"] = common.sm_clock_mhz()
            res[f"g_vs_flashmla_{lay}"] = fus / us
    r = rates(res["g_us_order"], flops, nbytes, peaks)
    res.update(g_tflops=r["tflops"], g_gbs=r["gbs"], g_pct_floor=r.get("pct_floor"))
    # the combine's share: the same kernel merging this plan's splits alone (equal lengths: parts / bs
    # splits per sequence), its partials in L2 as the attention leaves them
    bs, parts = seqlens.numel(), int(plan[0])
    if parts > bs and parts % bs == 0:
        o_part = torch.randn(bs, parts // bs, S_Q, h_q, DV, device=seqlens.device)
        lse_part = torch.randn(bs, parts // bs, S_Q, h_q, device=seqlens.device)
        res["g_combine"] = common.time_graph_calls([lambda: mla_decode.mla_combine(o_part, lse_part)] * GRAPH_CALLS,
                                                   reps=args.graph_reps) * 1e3
        del o_part, lse_part
    res["graph_flag"] = " ".join(sorted(f for f in flags if f))
    return res


HEADER = (f"{'h_q':>4} {'bs':>4} {'L':>6} {'rope':>4} {'parts':>5} {'comb':>5} | {'g us':>7} {'FM g':>7} {'xFM g':>5} "
          f"{'MHz':>4} {'FM':>4} {'g us sc':>7} {'FM g sc':>7} {'xFM sc':>6} {'TFLOP/s':>7} {'TB/s':>5} {'%floor':>6} | {'us':>7} "
          f"{'us plan1':>8} {'FlashMLA':>8} {'xFM':>5} {'xFM plan1':>9} | {'1 call':>7} {'FM 1':>7} {'host':>5} "
          f"{'FM host':>7} | {'max|d|':>8}  flag")


def format_row(r):
    g = r.get
    return (f"{r['h_q']:>4} {r['bs']:>4} {r['L']:>6} {r['rope']:>4} {cell(g('parts'), 5, 'd')} "
            f"{cell(g('g_combine'), 5, '.1f')} | "
            f"{cell(g('g_us_order'), 7, '.1f')} "
            f"{cell(g('g_flashmla_order'), 7, '.1f')} {cell(g('g_vs_flashmla_order'), 5, '.2f')} "
            f"{cell(g('g_mhz_order'), 4, 'd')} {cell(g('g_fm_mhz_order'), 4, 'd')} "
            f"{cell(g('g_us_scatter'), 7, '.1f')} {cell(g('g_flashmla_scatter'), 7, '.1f')} "
            f"{cell(g('g_vs_flashmla_scatter'), 6, '.2f')} {cell(g('g_tflops'), 7, '.1f')} "
            f"{cell(g('g_gbs') / 1e3 if g('g_gbs') else None, 5, '.2f')} {cell(g('g_pct_floor'), 6, '.1f')} | "
            f"{cell(g('us'), 7, '.1f')} {cell(g('us_plan_once'), 8, '.1f')} {cell(g('us_flashmla'), 8, '.1f')} "
            f"{cell(g('vs_flashmla'), 5, '.2f')} {cell(g('vs_flashmla_plan_once'), 9, '.2f')} | "
            f"{cell(g('us_one'), 7, '.1f')} {cell(g('us_one_flashmla'), 7, '.1f')} {cell(g('host_us'), 5, '.1f')} "
            f"{cell(g('host_us_flashmla'), 7, '.1f')} | {cell(g('max_diff_flashmla'), 8, '.1e')}  {g('flag', '')}")


SUMMARY_KEYS = ("g_vs_flashmla_order", "g_vs_flashmla_scatter", "vs_flashmla", "vs_flashmla_plan_once")


def summary(rows):
    """Geometric means of the FlashMLA ratios (graphs in order, scattered;
    eager, eager plan1) over the rope 'no' rows that have them: overall and
    per h_q (None where no row has them)."""
    def gm(rs):
        rs = [r for r in rs if r["rope"] == "no" and "vs_flashmla" in r]
        if not rs:
            return None
        out = dict(n=len(rs))
        for k in SUMMARY_KEYS:
            vals = [r[k] for r in rs if r.get(k)]
            out[k] = geomean(vals) if vals else None
        return out
    heads = sorted({r["h_q"] for r in rows}, reverse=True)
    return dict(all=gm(rows), by_h_q={h: gm([r for r in rows if r["h_q"] == h]) for h in heads})


def summary_line(s):
    if s["all"] is None:
        return "geomean xFM (rope no): - (FlashMLA not measured)"

    def four(g):
        return " / ".join("-" if g.get(k) is None else f"{g[k]:.3f}" for k in SUMMARY_KEYS)
    line = f"geomean xFM over {s['all']['n']} rope-no rows (graphs in order / scattered / eager / eager plan1): " + four(
        s["all"])
    parts = [f"h_q {h}: {four(g)}" for h, g in s["by_h_q"].items() if g is not None]
    return line + ("\n  " + "; ".join(parts) if len(parts) > 1 else "")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", help="h_q values (a grid with --lengths; default: the default rows)")
    ap.add_argument("--lengths", type=int, nargs="+", help="cache lengths L (a grid with --heads)")
    ap.add_argument("--rope", nargs="+", choices=ROPES, help="key modes of every row (default: all three at h_q 128, "
                                                             "'no' elsewhere)")
    ap.add_argument("--bs", type=int, default=128, help="batch of the default and --heads/--lengths rows")
    ap.add_argument("--small-batch", action="store_true",
                    help="the small-batch rows instead: (h_q, bs, L) " + ", ".join(map(str, SMALL_BATCH_ROWS)))
    ap.add_argument("--no-flashmla", action="store_true", help="do not time FlashMLA even when it imports")
    ap.add_argument("--dry-run", action="store_true", help="print the rows, sets and memory, and exit (no GPU)")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false",
                    help="skip the CUDA-graph columns (rope 'no' rows; pages in order and scattered)")
    ap.add_argument("--graph-reps", type=int, default=20, help="graph replays per measurement (median)")
    ap.add_argument("--kernel", choices=("portable", "hopper"),
                    help="force our attention kernel (sets MLA_DECODE_ATTN_KERNEL before the first call)")
    add_timing_args(ap, iters=50)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    specs = row_specs(args.heads, args.lengths, args.rope, args.bs, args.small_batch)
    if args.dry_run:
        for h, L, ropes, bs in specs:
            n = n_sets(bs, L, h, ropes)
            print(f"h_q {h:>3} bs {bs:>3} L {L:>6} (Lpad {pad(L)}) rope {','.join(ropes):<10} {n} sets x "
                  f"{set_bytes(bs, L, h, ropes) / 1e9:.2f} GB")
        return 0
    if args.kernel:
        os.environ["MLA_DECODE_ATTN_KERNEL"] = args.kernel  # (read once, at the first attention call)
    setup = gpu_setup("bench_attention")
    if setup is None:
        return 1
    name, peaks = setup
    fm = None if args.no_flashmla else common.flashmla()
    kind = _ext.attention_info(torch.cuda.current_device()).kernel
    print(f"# attention kernel ({kind}) vs FlashMLA | {name} | {mla_decode.backend()} | s_q=1 D={D} "
          f"Dv={DV} | graphs: {GRAPH_CALLS} calls each, median of {args.graph_reps} replays | eager: batch "
          f"{args.batch}, median of {args.iters}")
    if fm is None:
        why = "--no-flashmla" if args.no_flashmla else f"flash_mla does not import ({common.FLASHMLA_ERROR})"
        print(f"# FlashMLA not measured: {why}; its columns read '-'")
    print(HEADER, flush=True)
    rows = []
    for h, L, ropes, bs in specs:
        for r in measure_row(h, L, ropes, bs, args, peaks, fm):
            print(format_row(r), flush=True)
            rows.append(r)
        gc.collect()  # the row's sets (freed with measure_row's frame) back to the device before the next row's
        torch.cuda.empty_cache()
    s = summary(rows)
    print(summary_line(s))
    print("(first block, rope 'no' rows: device time per call in CUDA graphs, the plan and FlashMLA's metadata "
          "made once, 64-row pages in order (g us, FM g) and scattered (sc); TFLOP/s, TB/s and %floor of g us. "
          "Second: eager calls, `batch` back to back: us plans in each call, plan1 passes the plan made once. "
          "Third, rope 'no' rows: one call after a synchronize (events around it: the host's launch path "
          "included), ours planning in the call and FlashMLA (FM 1), and host us per call (the wrapper, checks "
          "and launches, calls enqueued back to back). xFM = FlashMLA us / ours, > 1: ours faster; rope yes = "
          "keys rotated on the fly, the decode step's path)")
    flagged = [r for r in rows if r.get("flag")]
    if flagged:
        print(f"FLAGGED: {len(flagged)} row(s): " + ", ".join(f"h_q {r['h_q']} L {r['L']} {r['rope']} {r['flag']}"
                                                            for r in flagged))
    dump_json(args.json, name, rows=rows, geomean=s, flashmla=getattr(fm, "__file__", None),
              flashmla_missing=None if fm is not None else ("--no-flashmla" if args.no_flashmla
                                                             else common.FLASHMLA_ERROR))
    return 0


if __name__ == "__main__":
    sys.exit(main())
