"""Builds of the extension timed against each other on the attention, by
device time in CUDA graphs, alternated in separate processes (like clocks).

    python3 tools/ab_attention.py --build old=/path/to/old/csrc --build new=csrc \\
        --shapes 32,128,4096 128,1,32769 [--kernel portable] [--rounds 2] [--env MLA_DECODE_PDL=0]
    python3 tools/ab_attention.py --prebuilt old=/tmp/ab/old --prebuilt new=/tmp/ab/new --shapes ...
    python3 tools/ab_attention.py --prebuilt on=. --prebuilt off=. --env-of off:MLA_DECODE_PDL=0 --shapes ...
    python3 tools/ab_attention.py --prebuilt hopper=. --prebuilt portable=. \
        --env-of portable:MLA_DECODE_ATTN_KERNEL=portable --shapes ...

--build NAME=CSRC copies this checkout's mla_decode, setup.py,
pyproject.toml and benchmarks to /tmp/ab/NAME with CSRC as its csrc and
builds it there (all builds at once, MAX_JOBS shared between them; about two
minutes on a 16-core host); --prebuilt NAME=DIR takes a tree already built
(one tree may appear under two names, told apart by --env-of NAME:VAR=VALUE).
A shape is h_q,bs,L (s_q 1, d 576, dv 512, every sequence L keys). For each
round every build in turn (the order reversed every other round) times every
shape in a fresh process: 10 calls captured in one graph on rotated cache
sets (no call finds its keys in L2), the plan made once, the cache read as
64-row pages in order and then scattered (a random permutation), median of
10 replays between two events, the SM clock (NVML) after each. Last, per
shape, each build's range and the largest difference between the builds'
outputs of set 0 (the same inputs in every build). A benchmark: it asserts
nothing.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPIED = ("mla_decode", "setup.py", "pyproject.toml", "benchmarks")


def worker(kernel, shapes, out_dir):
    """Inside a build's process: one JSON line per shape."""
    import torch

    os.environ["MLA_DECODE_ATTN_KERNEL"] = kernel
    import mla_decode
    sys.path.insert(0, os.path.join(mla_decode.__path__[0], "..", "benchmarks"))
    from common import sm_clock_mhz, time_graph_calls

    for h, bs, L in shapes:
        lp = (L + 63) // 64 * 64
        per = bs * lp * 576 * 2
        n = max(2, min(10, math.ceil(200e6 / per), int(6e9 // per)))
        g = torch.Generator(device="cuda").manual_seed(1)
        sets = [(torch.randn(bs * lp // 64, 64, 576, device="cuda", generator=g).to(torch.bfloat16),
                 torch.randn(bs, 1, h, 576, device="cuda", generator=g).to(torch.bfloat16)) for _ in range(n)]
        sl = torch.full((bs,), L, dtype=torch.int32, device="cuda")
        order = torch.arange(bs * lp // 64, dtype=torch.int32, device="cuda").view(bs, lp // 64)
        perm = torch.randperm(bs * lp // 64, device="cuda", generator=g).to(torch.int32).view(bs, lp // 64)
        plan = torch.ops.mla_decode.plan(sl, 1, h, lp)
        splits = plan.cpu()[2::2][:bs]
        row = dict(h=h, bs=bs, L=L, parts=int(splits.sum()))
        for name, table in (("order", order), ("scattered", perm)):
            calls = [lambda kv=kv, q=q, t=table: mla_decode.mla_attention(q, kv, sl, 0.07, block_table=t, plan=plan)
                     for kv, q in (sets[i % n] for i in range(10))]
            row[name] = time_graph_calls(calls, reps=10) * 1e3
            row[name + "_mhz"] = sm_clock_mhz()
        out, _ = mla_decode.mla_attention(sets[0][1], sets[0][0], sl, 0.07, block_table=order, plan=plan)
        if out_dir:
            torch.save(out.cpu(), os.path.join(out_dir, f"{h}_{bs}_{L}.pt"))
        print(json.dumps(row), flush=True)
        del sets
        torch.cuda.empty_cache()


def build_all(builds, jobs):
    procs = []
    for name, csrc in builds:
        d = os.path.join("/tmp/ab", name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        for item in COPIED:
            src = os.path.join(ROOT, item)
            (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(d, item))
        shutil.copytree(os.path.abspath(csrc), os.path.join(d, "csrc"))
        env = dict(os.environ, MAX_JOBS=str(max(1, jobs // len(builds))))
        log = open(os.path.join(d, "build.log"), "w")
        procs.append((name, d, subprocess.Popen([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=d,
                                                env=env, stdout=log, stderr=subprocess.STDOUT)))
    trees = []
    for name, d, p in procs:
        if p.wait() != 0:
            sys.exit(f"build {name} failed: see {d}/build.log")
        trees.append((name, d))
    return trees


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", action="append", default=[], metavar="NAME=CSRC")
    ap.add_argument("--prebuilt", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--shapes", nargs="+", default=[], metavar="H,BS,L")
    ap.add_argument("--kernel", choices=("hopper", "portable"), default="hopper")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--env", action="append", default=[], metavar="VAR=VALUE", help="set in every timing process")
    ap.add_argument("--env-of", action="append", default=[], metavar="NAME:VAR=VALUE",
                    help="set in the timing processes of build NAME only")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4, help="compile jobs over all builds")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    if any(len(s) != 3 for s in shapes):
        ap.error("a shape is h_q,bs,L")
    if args.worker is not None:
        return worker(args.kernel, shapes, args.worker)
    pairs = lambda xs: [tuple(x.split("=", 1)) for x in xs]  # noqa: E731
    if any(len(p) != 2 for p in pairs(args.build + args.prebuilt + args.env)):
        ap.error("--build, --prebuilt and --env take NAME=VALUE")
    env_of = {}
    for item in args.env_of:
        name, _, var = item.partition(":")
        if len(var.split("=", 1)) != 2:
            ap.error("--env-of takes NAME:VAR=VALUE")
        env_of.setdefault(name, []).append(var)
    trees = build_all(pairs(args.build), args.jobs) if args.build else []
    trees += [(n, os.path.abspath(d)) for n, d in pairs(args.prebuilt)]
    if len(trees) < 1 or not shapes:
        ap.error("give at least one build and one shape")
    if len({n for n, _ in trees}) != len(trees) or not set(env_of) <= {n for n, _ in trees}:
        ap.error("build names must be distinct, and --env-of must name one of them")
    results = {}
    for rnd in range(args.rounds):
        for name, d in (trees if rnd % 2 == 0 else trees[::-1]):
            out_dir = os.path.join(d, "ab_out", name) if rnd == 0 else ""
            if out_dir:
                os.makedirs(out_dir, exist_ok=True)
            env = dict(os.environ, PYTHONPATH=d)
            env.update(pairs(args.env))
            own = dict(pairs(env_of.get(name, [])))
            env.update(own)  # (over --env where both name a variable)
            # (--env-of NAME:MLA_DECODE_ATTN_KERNEL=... sets that build's kernel: two kernels of one tree)
            kernel = own.get("MLA_DECODE_ATTN_KERNEL", args.kernel)
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", out_dir, "--kernel", kernel,
                   "--shapes", *args.shapes]
            res = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True)
            if res.returncode != 0:
                sys.exit(f"{name}: timing failed\n{res.stderr[-3000:]}")
            for line in res.stdout.splitlines():
                if not line.startswith("{"):
                    continue
                r = json.loads(line)
                key = (r["h"], r["bs"], r["L"])
                results.setdefault(key, {}).setdefault(name, []).append(r)
                print(f"round {rnd} {name:>10} h_q {r['h']:3d} bs {r['bs']:4d} L {r['L']:6d} parts {r['parts']:5d}: "
                      f"in order {r['order']:8.1f} us ({r['order_mhz']} MHz), "
                      f"scattered {r['scattered']:8.1f} us ({r['scattered_mhz']} MHz)", flush=True)
    import torch

    print("\nper shape, in order | scattered, us (min-max over rounds); max |out - first build's out|:")
    for key, by_build in results.items():
        first = None
        for name, d in trees:
            rs = by_build.get(name, [])
            o = [r["order"] for r in rs]
            s = [r["scattered"] for r in rs]
            out = torch.load(os.path.join(d, "ab_out", name, "{}_{}_{}.pt".format(*key))).float()
            first = out if first is None else first
            diff = (out - first).abs().max().item()
            print(f"h_q {key[0]:3d} bs {key[1]:4d} L {key[2]:6d} {name:>10}: {min(o):8.1f}-{max(o):8.1f} | "
                  f"{min(s):8.1f}-{max(s):8.1f}   max|d| {diff:.2e}")


if __name__ == "__main__":
    main()
