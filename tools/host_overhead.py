"""Host time of one custom_kernel call, part by part (no synchronisation in
the timed loops, so the GPU's own time is not in these numbers).

    python3 tools/host_overhead.py [prefill]
"""
import sys
import time

import torch

import mla_decode
from mla_decode._ext import module
from mla_decode.decoder import validate
from mla_decode.reference import generate_input

prefill = int(sys.argv[1]) if len(sys.argv) > 1 else 512
config, x, kv = generate_input(batch_size=128, prefill=prefill, device="cuda")
dec = mla_decode.MLADecoder()
for _ in range(3):
    dec(config, x, kv)
torch.cuda.synchronize()


def host_us(fn, n=200):
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


_C = module()
dims = validate(config, x, kv)
tables = dec._rope_tables(x.device, dims.rope, dims.max_seq_len)
st = dec._cache_state(kv.data, dims)
entry = dec._graph_step(st, config, dims, kv.data, tables)
x2 = x.view(dims.bs, dims.dim)
L = kv.seq_len
parts = [
    ("validate (full)", lambda: validate(config, x, kv)),
    ("validate (known weights)", lambda: validate(config, x, kv, dec._stamp.matches)),
    ("_choose", lambda: dec._choose(dims, x.device)),
    ("_rope_tables", lambda: dec._rope_tables(x.device, dims.rope, dims.max_seq_len)),
    ("_cache_state lookup", lambda: dec._cache_state(kv.data, dims)),
    ("_graph_step lookup", lambda: dec._graph_step(st, config, dims, kv.data, tables)),
    ("x in (copy_async)", lambda: _C.copy_async(entry.x, x2)),
    ("seqlens.fill_ (rewinds)", lambda: entry.seqlens.fill_(L)),
    ("graph.replay", lambda: entry.graph.replay()),
    ("y out (empty+copy)", lambda: _C.copy_async(torch.empty_like(entry.y), entry.y)),
    ("(y.clone, for scale)", lambda: entry.y.clone()),
]
for name, fn in parts:
    print(f"{name:<22} {host_us(fn, 100 if 'replay' in name else 200):8.1f} us")
kv.seq_len = prefill  # the whole call, on a fresh position each time
print(f"{'whole call (graphed)':<22} {host_us(lambda: dec(config, x, kv), 100):8.1f} us  graphed={dec.last_graphed}")

# wall clock as the task harness takes it (synchronize, call, synchronize), median of 50
import statistics  # noqa: E402


def wall_us(fn, n=50):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


print("harness-style wall clock (sync, call, sync):")
print(f"  {'empty (sync only)':<34} {wall_us(lambda: None):8.1f} us")
print(f"  {'graph.replay alone':<34} {wall_us(lambda: entry.graph.replay()):8.1f} us")
print(f"  {'entry call (copy, replay, copy)':<34} {wall_us(lambda: entry(x2, kv.seq_len + 1)):8.1f} us")
print(f"  {'whole decoder call':<34} {wall_us(lambda: dec(config, x, kv)):8.1f} us  graphed={dec.last_graphed}")

# device time of this decoder's captured graph vs a graph captured around the whole call
sys.path.insert(0, "benchmarks")
from common import time_events, time_graph  # noqa: E402

print(f"device events, entry.graph.replay: {1e3 * time_events(lambda: entry.graph.replay(), iters=30):.1f} us")
print(f"device events, graph captured around dec(...): {1e3 * time_graph(lambda: dec(config, x, kv), iters=30):.1f} us")
if len(sys.argv) > 2:
    from torch.profiler import ProfilerActivity, profile

    for name, fn in (("entry graph", lambda: entry.graph.replay()),):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        print(name)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))

# the eager step (no graph): host time per call and the harness-style wall clock
de = mla_decode.MLADecoder(graphs=False)
kv3 = kv.clone()
de(config, x, kv3)
print(f"eager call, host only     {host_us(lambda: de(config, x, kv3), 100):8.1f} us")
print(f"eager call, harness-style {wall_us(lambda: de(config, x, kv3)):8.1f} us")
if len(sys.argv) > 2:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            de(config, x, kv3)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=50))
del kv3

# device memory a captured step holds (its graph's intermediates and static buffers)
torch.cuda.synchronize()
d2 = mla_decode.MLADecoder()
kv2 = kv.clone()
d2(config, x, kv2)  # eager: builds the rotated-key copy
torch.cuda.synchronize()
torch.cuda.empty_cache()
m0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
d2(config, x, kv2)  # captures (the graph's private pool stays reserved after its intermediates are freed)
torch.cuda.synchronize()
print(f"one captured step (bs=128, task dims): allocated +{(torch.cuda.memory_allocated() - m0) / 2**20:.0f} MiB, "
      f"reserved +{(torch.cuda.memory_reserved() - r0) / 2**20:.0f} MiB (graphed={d2.last_graphed})")
