"""Shared timing helpers for the benchmarks (device events, harness method)."""

import json
import statistics
import time

import torch


def device_name():
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def kernels_or_reason(tool):
    """None when the GPU kernels can run here, else the line to print (the
    benchmark then exits 1: it measures the kernels, not the fallback)."""
    import mla_decode

    if mla_decode.kernels_usable("cuda"):
        return None
    return f"{tool} needs the GPU kernels: {mla_decode.backend()}"


def gpu_setup(tool):
    """(device name, its (bandwidth, flops) peaks or None) where the GPU
    kernels can run here; else None, after printing why (the benchmark then
    exits 1)."""
    why = kernels_or_reason(tool)
    if why:
        print(why)
        return None
    from mla_decode import roofline

    name = device_name()
    return name, roofline.peaks_for(name)


FLASHMLA_ERROR = None  # why the last flashmla() found no flash_mla


def flashmla():
    """The ``flash_mla`` module (deepseek-ai/FlashMLA, the attention peer
    timed in the same process) when it imports here, else None, with the
    reason kept in FLASHMLA_ERROR. Never part of this repository: on the
    device, ``source .peers/use_flashmla.sh`` puts it on PYTHONPATH."""
    global FLASHMLA_ERROR
    try:
        import flash_mla
    except (ImportError, OSError) as e:  # not installed, or its extension does not load here
        FLASHMLA_ERROR = f"{type(e).__name__}: {e}"
        return None
    FLASHMLA_ERROR = None
    return flash_mla


def rates(us, flops, nbytes, peaks):
    """A result row: us, TFLOP/s, GB/s and, with the device's (bandwidth,
    flops) peaks, the floor max(bytes/BW, FLOPs/peak) and % of it."""
    row = dict(us=us, tflops=flops / us / 1e6, gbs=nbytes / us / 1e3)
    if peaks:
        floor = 1e6 * max(nbytes / peaks[0], flops / peaks[1])
        row["floor_us"] = floor
        row["pct_floor"] = 100 * floor / us
    return row


def cell(v, w, spec):
    """v formatted to width w, or '-' where it was not measured (None or NaN)."""
    return f"{'-':>{w}}" if v is None or v != v else f"{v:>{w}{spec}}"


def add_timing_args(ap, iters):
    """--iters, --batch and --json: the options every attention-side benchmark takes."""
    ap.add_argument("--iters", type=int, default=iters)
    ap.add_argument("--batch", type=int, default=10, help="calls per event pair (1: host overhead counted)")
    ap.add_argument("--json")


def dump_json(path, device, **fields):
    """Write {device, backend, **fields} to path (nothing without a path)."""
    if path:
        import mla_decode

        with open(path, "w") as f:
            json.dump(dict(device=device, backend=mla_decode.backend(), **fields), f, indent=1)


def time_events(fn, iters=50, warmup=5, batch=1):
    """Median milliseconds of fn() by device events.

    batch=1: one event pair around each call, the device idle before it, so
    the host's launch path (validation, allocation, launches) is inside the
    time whenever it outlasts the kernels. batch>1: `batch` calls back to back
    between one event pair (median over `iters` such pairs, divided by
    batch): the launch queue stays full and the time is the device's per
    call (kernels and the gaps between them), the way a kernel's time is
    compared (FlashMLA's own benchmark reports kernel times)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / batch)
    return statistics.median(times)


def host_ms(fn, iters=20, warmup=3, batch=10):
    """Median host milliseconds per call of fn(): perf_counter around `batch`
    calls enqueued back to back (no synchronize between them, so the GPU's
    work is not waited for: the time is the Python wrapper, its checks and
    its launches), divided by batch; the queue is drained between samples."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - t0) * 1e3 / batch)
        torch.cuda.synchronize()
    return statistics.median(times)


def time_wall(fn, iters=20, warmup=3, sync=None, prepare=None):
    """Median milliseconds of fn() timed as the task harness does:
    synchronize, wall clock, call, synchronize, wall clock. With
    ``prepare``, each call is fn(prepare()), prepare() run untimed before
    the first synchronize (fresh inputs per call)."""
    sync = sync or (torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None))
    call = fn if prepare is None else None
    for _ in range(warmup):
        fn() if prepare is None else fn(prepare())
    times = []
    for _ in range(iters):
        arg = None if prepare is None else prepare()
        sync()
        t0 = time.perf_counter()
        call() if call is not None else fn(arg)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        del arg
    return statistics.median(times)


def geomean(xs):
    xs = [x for x in xs if x > 0]
    p = 1.0
    for x in xs:
        p *= x
    return p ** (1.0 / len(xs)) if xs else float("nan")


def sm_clock_mhz():
    """The current GPU's SM clock in MHz (NVML), or None where NVML is not
    available. Under sustained load the H100/H200 lower it (power and heat):
    timings taken at different clocks are not comparable."""
    try:
        return torch.cuda.clock_rate(torch.cuda.current_device())
    except Exception:
        return None


def _capture(fn):
    """fn() run once on a side stream (warm-up, as capture requires), then
    captured into a CUDA graph, which is returned."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_graph(fn, iters=50):
    """Median milliseconds of a CUDA-graph replay of fn(): the device time of
    one call with the host's launch overhead taken out (a diagnostic: fn's
    host-side effects run once, at capture)."""
    return time_events(_capture(fn).replay, iters=iters)


def time_graph_calls(fns, reps=20):
    """Median device milliseconds per call of the calls fns (each a
    zero-argument callable, typically the same kernel on rotated inputs),
    captured together into one CUDA graph and replayed `reps` times between
    two events: how engines run attention (no host time inside, launch
    gaps as in a captured decode step)."""
    def all_calls():
        for f in fns:
            f()
    g = _capture(all_calls)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / len(fns))
    del g
    return statistics.median(times)


def time_graph_cold(fn, iters=50, flush_mib=512):
    """Median milliseconds of a CUDA-graph replay of fn() with the L2 cache
    flushed before each replay (a 512 MiB buffer read in between, outside
    the timed events): device time as when the data is streamed from memory,
    as it is in a full decode step. The flush reads rather than writes: a
    written flush leaves the L2 full of dirty lines, whose write-back (up to
    the L2's size) would be charged to fn, which a decode step's stages,
    preceded by kernels that mostly read, do not pay."""
    g = _capture(fn)
    flush = torch.ones(flush_mib << 18, dtype=torch.int32, device="cuda")
    times = []
    for i in range(iters + 3):
        flush.sum()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth_gbs(mib=1024, iters=20):
    """The device's measured copy bandwidth: bytes read + written by a
    device-to-device copy of `mib` MiB, per second (median), in GB/s."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_events(lambda: dst.copy_(src), iters=iters)
    return 2 * src.numel() / ms / 1e6


def wall_ranks(fn, iters, aligned=True):
    """Median microseconds of fn() as the task harness times a call
    (synchronize, wall clock, call, synchronize) after 3 warm-up calls; with
    `aligned` the ranks of the default process group meet at a barrier
    before each call, outside the timing."""
    import torch.distributed as dist

    times = []
    for i in range(iters + 3):
        torch.cuda.synchronize()
        if aligned:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)
