"""The calls that capture a decode step, as the task's judge meets them:
per round and prefill, fresh inputs (three input sets kept alive, so that
every round's operands are new and each capture evicts the least recently
used step), one checked call (a first sight: eager) and the reference check,
then the timed call that captures, then three replays. Prints each capture
call's wall time (synchronize to synchronize) and the replays after it.

    MLA_DECODE_STEP_GRAPH_TRACE=1 python3 tools/capture_calls.py [--rounds 20] [--prefills 512 6144]

With MLA_DECODE_STEP_GRAPH_TRACE=1 the extension also prints each capture's
host time by phase on stderr. Needs a GPU with the kernels.
"""
import argparse
import time

import torch

import mla_decode
from mla_decode.reference import generate_input, ref_kernel


def timed_call(data):
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    mla_decode.custom_kernel(data)
    torch.cuda.synchronize()
    return (time.perf_counter_ns() - t0) / 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--prefills", type=int, nargs="+", default=[512, 6144])
    ap.add_argument("--bs", type=int, default=128)
    args = ap.parse_args()
    # the harness's warm-up: 0.2 s of calls on the first shape's own inputs
    w = generate_input(batch_size=args.bs, prefill=args.prefills[0], seed=1, device="cuda")
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.2:
        mla_decode.custom_kernel(w)
        torch.cuda.synchronize()
    del w
    alive, walls = [], {}
    for rnd in range(args.rounds):
        for i, p in enumerate(args.prefills):
            data = generate_input(batch_size=args.bs, prefill=p, seed=100 + len(args.prefills) * rnd + i,
                                  device="cuda")
            alive = (alive + [data])[-3:]
            before = data[2].clone()
            mla_decode.custom_kernel(data)  # the checked call
            ref_kernel((data[0], data[1], before), batch_chunk=16)
            del before
            wall = timed_call(data)
            paths = mla_decode.decoder._DEFAULT.last_paths
            after = [timed_call(data) for _ in range(3)]
            walls.setdefault(p, []).append(wall)
            print(f"round {rnd} prefill {p}: {wall:.0f} us ({paths['launch']}"
                  f"{', then captured' if paths['captured'] else ''}); then {' '.join(f'{a:.0f}' for a in after)}",
                  flush=True)
    for p, ws in walls.items():
        ws = sorted(ws)
        print(f"prefill {p}: capture calls median {ws[len(ws) // 2]:.0f} us, max {ws[-1]:.0f} us, {len(ws)} calls")


if __name__ == "__main__":
    main()
