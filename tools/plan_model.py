"""A model of the split planner (csrc/kernels/attention/plan.cu) and of how
the attention's blocks take its parts, to weigh planner changes on the CPU.

    python3 tools/plan_model.py [--slots 132] [--tile 128] [--b 128] [--means 4096 16384] [--seeds 8]

``fixed_chunks(tiles, slots, max_parts)`` replays the planner's cut for
lengths that differ (plan.cu's fixed_chunks: the candidates, the estimate in
float32 as the kernel computes it, the plan order) and ``equal_parts(tiles,
slots)`` the cut it makes otherwise (the five candidates, equal parts,
sequences longest first). ``span(sizes, slots)`` is the makespan of parts
taken in plan order by whichever slot frees first (the persistent blocks'
work counter; the portable kernel's grid in block order), each part costing
one tile more. Tiles are the planner's (with the Hopper kernel's one-key
tail already left out). The main prints, for lengths normal(mean, mean / 2)
as bench_serving draws them, both cuts' span over the work per slot.
A model: it asserts nothing about the GPU (its cut is checked against the
kernel's in tests/test_gpu_attention.py).
"""
import argparse
import heapq
import random
import struct

PART_COST = 1.0
COMBINE_COST = 1.0


def f32(x):
    """x rounded to float32 (each operation below is one IEEE float32 operation of the kernel)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def fixed_chunks(tiles, slots, max_parts):
    """(c, parts in plan order as (b, first tile, end tile, split, splits)) as plan.cu's fixed_chunks cuts."""
    bs = len(tiles)
    total = sum(t if t > 0 else 1 for t in tiles)
    longest = max(1, max(tiles))
    p0 = max(1, (total + slots - 1) // slots)
    best, best_np, chosen = f32(3.0e38), 0x7fffffff, max(1, longest)
    for c in [max(1, p0 * e // 8) for e in (4, 6, 8, 9, 10, 12, 16)] + [max(1, longest)]:
        ns = [(t + c - 1) // c if t > 0 else 1 for t in tiles]
        rs = [t - (n - 1) * c for t, n in zip(tiles, ns)]
        np_, full = sum(ns), sum(n - 1 for n in ns)
        stat = [c, c]
        if np_ > slots and full < slots + 1:
            order = sorted(range(bs), key=lambda b: (-rs[b], b))
            for k, b in enumerate(order):
                if k == slots - 1 - full:
                    stat[0] = rs[b]
                if k == slots - full:
                    stat[1] = rs[b]
        if np_ > max_parts:
            continue
        pmax = f32(float(c if full > 0 else longest) + PART_COST)
        per_slot = f32(f32(float(total) + PART_COST * float(np_)) / float(slots))
        pair = f32(float(stat[0] + stat[1]) + 2.0 * PART_COST) if np_ > slots else 0.0
        est = f32(max(max(pmax, per_slot), pair) + (COMBINE_COST if np_ > bs else 0.0))
        if est < best or (est == best and np_ < best_np):
            best, best_np, chosen = est, np_, c
    c = chosen
    ns = [(t + c - 1) // c if t > 0 else 1 for t in tiles]
    rs = [t - (n - 1) * c for t, n in zip(tiles, ns)]
    parts = [(b, s * c, (s + 1) * c, s, n) for b, n in enumerate(ns) for s in range(n - 1)]
    for b in sorted(range(bs), key=lambda b: (-rs[b], b)):
        parts.append((b, (ns[b] - 1) * c, tiles[b], ns[b] - 1, ns[b]))
    return c, parts


def equal_parts(tiles, slots):
    """(per_part, parts in plan order) as plan_kernel cuts otherwise (not p0_only, not no_split, bs <= threads)."""
    bs = len(tiles)
    total = sum(t if t > 0 else 1 for t in tiles)
    longest = max(1, max(tiles))
    p0 = max(1, (total + slots - 1) // slots)
    k = max(1, slots * longest // total)
    fit = (longest + k - 1) // k
    cands = [p0, p0 + p0 // 4, p0 + 2 * p0 // 4, 2 * p0, fit]
    best, pick, pick_np = f32(3.0e38), p0, 0x7fffffff
    for pc in cands:
        np_, pmin, pmax = 0, 0x7fffffff, 0
        for t in tiles:
            n = max(1, (t + pc - 1) // pc)
            size = (t + n - 1) // n
            np_ += n
            pmin = min(pmin, max(0, t - (n - 1) * size))
            pmax = max(pmax, size)
        per_slot = f32(f32(float(total) + PART_COST * float(np_)) / float(slots))
        waves = float((np_ + slots - 1) // slots)
        est = f32(max(max(f32(pmax + PART_COST), per_slot), f32(waves * f32(pmin + PART_COST)))
                  + (COMBINE_COST if np_ > bs else 0.0))
        if est < best or (est == best and np_ < pick_np):
            best, pick, pick_np = est, pc, np_
    parts = []
    for b in sorted(range(bs), key=lambda b: (-tiles[b], b)):
        t = tiles[b]
        n = max(1, (t + pick - 1) // pick)
        per = (t + n - 1) // n
        parts += [(b, min(s * per, t), t if s == n - 1 else min((s + 1) * per, t), s, n) for s in range(n)]
    return pick, parts


def span(sizes, slots):
    """Makespan of parts of these sizes taken in order by whichever of the slots frees first."""
    free = [0.0] * slots
    for s in sizes:
        heapq.heappush(free, heapq.heappop(free) + s + PART_COST)
    return max(free)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=132, help="the plan's target parts (SMs x blocks per SM / head blocks)")
    ap.add_argument("--tile", type=int, default=128, help="keys per planned tile (Hopper 128, portable 32)")
    ap.add_argument("--b", type=int, default=128)
    ap.add_argument("--means", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args()
    for mean in args.means:
        old_r, new_r = [], []
        for seed in range(args.seeds):
            rnd = random.Random(seed)
            lens = [max(int(rnd.normalvariate(mean, mean / 2)), 1) for _ in range(args.b)]
            tiles = [(L + args.tile - 1) // args.tile for L in lens]
            for cut, out in ((equal_parts(tiles, args.slots), old_r),
                             (fixed_chunks(tiles, args.slots, args.slots + args.b), new_r)):
                sizes = [p[2] - p[1] for p in cut[1]]
                out.append(span(sizes, args.slots) / ((sum(sizes) + len(sizes) * PART_COST) / args.slots))
        mode = "fixed chunks apply" if len(set(tiles)) > 1 and args.b < args.slots else "the planner keeps equal parts"
        print(f"mean {mean}, b {args.b}, {args.slots} slots, tile {args.tile} ({mode}): span / work per slot "
              f"equal parts {sum(old_r) / len(old_r):.3f} (max {max(old_r):.3f}), "
              f"fixed chunks {sum(new_r) / len(new_r):.3f} (max {max(new_r):.3f})")


if __name__ == "__main__":
    main()
