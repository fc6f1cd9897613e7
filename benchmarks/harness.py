"""The task harness's timing loops (its eval.py, benchmark and leaderboard
modes), written for this project: what the judge ranks is the MEAN of these
calls, first ones included. Tensors are made and copied in eval.py's order,
since where the caching allocator puts them decides which calls find a
captured step to replay.

- benchmark mode, per shape: fresh inputs, then copies of the cache and of
  four of the five weights (not wo) for the check, one call checked
  against the reference on those copies, then up to 100 timed calls on the
  same cache (one new row each), each timed wall clock from a device
  synchronize to a device synchronize; it stops once the standard error of
  the mean is under 1% of the mean (after at least 3 calls) or the calls
  add up to 10 s. Calls run under torch.no_grad().
- leaderboard mode: the same loop on one shape with fresh weights, a fresh
  cache (and their copies) and a check on EVERY timed call (inputs made and
  checked untimed; each iteration's inputs are made while the previous
  iteration's are still held, so consecutive calls get other addresses).
- warm-up: 0.2 s of calls on the first shape's own inputs with copies of
  those four weights before either.

A ``probe`` (optional, outside the timed span) notes what happened inside
each timed call: ``probe.before()`` runs before the first synchronize,
``probe.after(token)`` after the second; its notes come back per call in
``Stats.notes`` beside ``Stats.us``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass
class Stats:
    runs: int
    mean: float  # us
    std: float
    err: float
    best: float
    worst: float
    first: float  # the first timed call, us
    us: list = field(default_factory=list)  # every timed call, us
    notes: list = field(default_factory=list)  # the probe's note per call (None without a probe)


def stats(durations_ns):
    n = len(durations_ns)
    us = [d / 1e3 for d in durations_ns]
    mean = sum(us) / n
    std = math.sqrt(sum((u - mean) ** 2 for u in us) / (n - 1)) if n > 1 else 0.0
    return Stats(n, mean, std, std / math.sqrt(n), min(us), max(us), us[0], us)


def _timed(kernel, data, probe=None):
    token = probe.before() if probe is not None else None
    _sync()
    t0 = time.perf_counter_ns()
    out = kernel(data)
    _sync()
    dt = time.perf_counter_ns() - t0
    return dt, out, (probe.after(token) if probe is not None else None)


def copy_weights(config):
    """The harness's copy of a config for its check: four of the five
    weights cloned (wo_weight is shared)."""
    return dataclasses.replace(config, Q_proj_down_weight=config.Q_proj_down_weight.clone(),
                               Q_proj_up_weight=config.Q_proj_up_weight.clone(),
                               KV_proj_down_weight=config.KV_proj_down_weight.clone(),
                               KV_proj_up_weight=config.KV_proj_up_weight.clone())


def warm_up(kernel, make_inputs, seconds=0.2):
    config, x, kv = make_inputs()
    config_copy = copy_weights(config)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        kernel((config_copy, x, kv))
        _sync()


def _loop(one_call, max_repeats, max_time_ns, rel_err):
    """The harness's stopping rule around one_call() -> (ns, error or None,
    note): at most max_repeats calls; after 3, stop once the standard error
    is under rel_err of the mean or the calls add up to max_time_ns."""
    durations, notes = [], []
    for i in range(max_repeats):
        dt, err, note = one_call()
        if err:
            return None, err
        durations.append(dt)
        notes.append(note)
        if i > 1:
            s = stats(durations)
            if s.err / s.mean < rel_err or s.mean * 1e3 * s.runs > max_time_ns:
                break
    s = stats(durations)
    s.notes = notes
    return s, None


def _checked_first_call(kernel, make_inputs, check):
    config, x, kv = make_inputs()
    kv_copy = kv.clone()
    config_copy = copy_weights(config)
    with torch.no_grad():
        err = check((config_copy, x, kv_copy), kernel((config, x, kv)))
    return (config, x, kv), err


def benchmark_mode(kernel, make_inputs, check, max_repeats=100, max_time_ns=10e9, rel_err=0.01, probe=None):
    """One checked call, then the timed loop on the same inputs. ``check(data
    before the call, output)`` returns an error text or None. Returns (Stats,
    error or None)."""
    data, err = _checked_first_call(kernel, make_inputs, check)
    if err:
        return None, err

    def one_call():
        dt, out, note = _timed(kernel, data, probe)
        del out
        return dt, None, note
    with torch.no_grad():
        return _loop(one_call, max_repeats, max_time_ns, rel_err)


def leaderboard_mode(kernel, make_inputs, check, max_repeats=100, max_time_ns=30e9, rel_err=0.01, probe=None):
    """Fresh inputs (new weights, new cache) and a check on every timed call."""
    _, err = _checked_first_call(kernel, make_inputs, check)
    if err:
        return None, err

    held = {}  # the last iteration's inputs and copies, held while the next are made (as the harness's loop does)

    def one_call():
        held["data"] = make_inputs()
        config, x, kv = held["data"]
        held["kv_copy"] = kv.clone()
        held["config_copy"] = copy_weights(config)
        dt, out, note = _timed(kernel, (config, x, kv), probe)
        err = check((held["config_copy"], x, held["kv_copy"]), out)
        del out
        return dt, err, note
    with torch.no_grad():
        return _loop(one_call, max_repeats, max_time_ns, rel_err)
