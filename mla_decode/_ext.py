"""Loading the compiled extension and saying, never silently, which backend runs."""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch

_C = None
if importlib.util.find_spec(__package__ + "._C") is None:
    _IMPORT_ERROR = "no compiled mla_decode._C in this install (built without a GPU toolkit or torch)"
else:
    try:  # importing registers torch.ops.mla_decode.*
        from . import _C  # noqa: F811
        _IMPORT_ERROR = None
    except ImportError as e:  # pragma: no cover - depends on the install
        _IMPORT_ERROR = f"mla_decode._C failed to import: {e}"


class AttentionInfo(NamedTuple):
    """The attention kernel the extension runs on a device for a shape."""
    rows_per_block: int
    keys_per_tile: int
    threads: int
    smem_bytes: int
    warp_size: int
    blocks_per_sm: int
    sms: int
    kernel: str  # "hopper" (wgmma) or "portable" (tile-MMA)


def attention_info(device: int, dv: int = 512, rope: int = 64) -> AttentionInfo:
    """Named facts of the attention kernel on device index ``device`` for value
    width dv and rope width rope inside the key (0: per-head rope keys).
    Raises RuntimeError where the kernels cannot run there."""
    if _C is None:
        raise RuntimeError(f"mla_decode kernels are not built: {_IMPORT_ERROR}")
    return AttentionInfo(**_C.attention_info(device, dv, rope))


def module():
    """The compiled extension module (None when not built)."""
    return _C


def kernels_built() -> bool:
    """True when the C++/GPU extension was built and imports."""
    return _C is not None


_USABLE = {}  # device index -> whether this build carries code for that GPU


def _build_runs_on(idx: int) -> bool:
    """Whether this build's architectures include the GPU's: sm_XY(a) for a
    compute X.Y NVIDIA GPU, gfx... for an AMD one."""
    archs = [a.strip() for a in str(_C.archs).split(";") if a.strip()]
    if torch.version.hip is not None:
        name = torch.cuda.get_device_properties(idx).gcnArchName.split(":")[0]
        return name in archs
    major, minor = torch.cuda.get_device_capability(idx)
    return any(a.rstrip("a") == f"sm_{major}{minor}" for a in archs)


def device_index(device) -> int:
    """The CUDA index of ``device`` ("cuda" alone: the current GPU)."""
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def kernels_usable(device="cuda") -> bool:
    """True when the compiled kernels can run on ``device`` (default: the
    current GPU): the extension imports, a GPU is visible, and the build
    carries code for that GPU's architecture."""
    device = torch.device(device)
    if _C is None or device.type != "cuda" or not torch.cuda.is_available():
        return False
    idx = device_index(device)
    ok = _USABLE.get(idx)
    if ok is None:
        ok = _USABLE[idx] = _build_runs_on(idx)
    return ok


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
    idx = device_index(device)
    if not kernels_usable(device):
        cap = ".".join(map(str, torch.cuda.get_device_capability(idx))) if torch.version.hip is None else ""
        return (f"torch-fallback (the kernels are built for {_C.archs}, not for {name}"
                + (f", compute {cap}" if cap else "") + ")")
    try:
        kind = attention_info(idx).kernel
        attn = "hopper wgmma attention" if kind == "hopper" else "portable tile-MMA attention"
    except RuntimeError as e:  # the kernel cannot run here: say so rather than hide it
        attn = f"attention kernel unusable: {e}"
    return f"{_C.platform}-kernels ({_C.archs} build, {attn}) on {name}"


def require_kernels(device) -> None:
    if not kernels_usable(device):
        raise RuntimeError(f"mla_decode kernels are not usable here: {backend(device)}")
