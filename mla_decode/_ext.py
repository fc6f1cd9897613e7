"""Loading the compiled extension and saying, never silently, which backend runs."""

from __future__ import annotations

import torch

import importlib.util

_C = None
if importlib.util.find_spec(__package__ + "._C") is None:
    _IMPORT_ERROR = "no compiled mla_decode._C in this install (built without a GPU toolkit or torch)"
else:
    try:  # importing registers torch.ops.mla_decode.*
        from . import _C  # noqa: F811
        _IMPORT_ERROR = None
    except ImportError as e:  # pragma: no cover - depends on the install
        _IMPORT_ERROR = f"mla_decode._C failed to import: {e}"


def module():
    """The compiled extension module (None when not built)."""
    return _C


def kernels_built() -> bool:
    """True when the C++/GPU extension was built and imports."""
    return _C is not None


def kernels_usable(device) -> bool:
    """True when the compiled kernels can run on ``device``."""
    device = torch.device(device)
    return _C is not None and device.type == "cuda" and torch.cuda.is_available()


def backend(device=None) -> str:
    """Which implementation serves calls on ``device`` (default: the current
    GPU if there is one, else the CPU), and why."""
    if device is None:
        device = "cuda"  # the GPU if there is one; otherwise the text says why not
    device = torch.device(device)
    if _C is None:
        return f"torch-fallback (extension not built or not importable: {_IMPORT_ERROR})"
    if device.type != "cuda":
        return f"torch-fallback (device {device} is not a GPU; kernels built for {_C.platform} {_C.archs})"
    if not torch.cuda.is_available():
        return f"torch-fallback (no GPU visible; kernels built for {_C.platform} {_C.archs})"
    name = torch.cuda.get_device_name(device)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    try:
        kind = _C.attention_info(idx)[7]
        attn = "hopper wgmma attention" if kind == 1 else "portable tile-MMA attention"
    except RuntimeError as e:  # the kernel cannot run here: say so rather than hide it
        attn = f"attention kernel unusable: {e}"
    return f"{_C.platform}-kernels ({_C.archs} build, {attn}) on {name}"


def require_kernels(device) -> None:
    if not kernels_usable(device):
        raise RuntimeError(f"mla_decode kernels are not usable here: {backend(device)}")
