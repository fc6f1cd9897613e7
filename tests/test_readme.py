"""The README's Python blocks run as pasted, each in a fresh namespace (a
block that leaned on an earlier block's names would fail here)."""
import contextlib
import io
import os
import re

import pytest
import torch

import mla_decode
from conftest import needs_gpu

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")


def blocks():
    with open(README) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def run_block(i):
    ns = {"__name__": "__readme__"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(blocks()[i], f"README.md python block {i}", "exec"), ns)  # noqa: S102 - our own README
    return ns


def test_readme_has_the_three_blocks():
    bs = blocks()
    assert len(bs) == 3, f"README.md has {len(bs)} python blocks; this test runs three"
    assert "custom_kernel" in bs[0] and "MLADecoder" in bs[1] and "flash_mla_with_kvcache" in bs[2]


def test_readme_task_block():
    ns = run_block(0)
    assert tuple(ns["y"].shape) == (128, 1, 7168) and ns["kv_cache"].seq_len == 513
    assert ns["y"].dtype == torch.bfloat16 and bool(torch.isfinite(ns["y"]).all())


def test_readme_own_weights_block():
    ns = run_block(1)
    assert ns["kv"].seq_len == 103
    assert ns["dec"].last_backend == ("kernels" if mla_decode.kernels_usable(ns["device"]) else "torch")


@needs_gpu
def test_readme_attention_block():
    ns = run_block(2)
    assert tuple(ns["out"].shape) == (4, 1, 128, 512) and tuple(ns["lse"].shape) == (4, 128, 1)
    assert bool(torch.isfinite(ns["out"]).all())
