"""Build of mla_decode: one source list (csrc/sources.txt) for CUDA and HIP.

- CUDA PyTorch + nvcc: kernels for MLA_DECODE_CUDA_ARCHS (default "9.0a",
  i.e. sm_90a; a ';'-separated TORCH_CUDA_ARCH_LIST-style list).
- ROCm PyTorch + hipcc: kernels for MLA_DECODE_HIP_ARCHS (default "gfx942").
- Neither (a CPU PyTorch, no toolkit, or MLA_DECODE_NO_EXTENSION=1): the
  package installs without compiled kernels and runs its PyTorch fallback;
  mla_decode.backend() says so.

Install with `pip install --no-build-isolation .` so the build sees the
installed PyTorch.
"""

import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def sources(kinds):
    out = []
    with open(os.path.join(ROOT, "csrc", "sources.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                kind, path = line.split()
                if kind in kinds:
                    out.append(path)
    return out


def cuda_library_headers(cuda_home):
    """PyTorch's CUDA headers include cusparse.h/cublas.h; a toolkit without
    them (nvcc alone) is completed by the headers of the nvidia-* wheels that
    the CUDA PyTorch wheel installed."""
    if os.path.isfile(os.path.join(cuda_home, "include", "cusparse.h")):
        return []
    try:
        import nvidia
    except ImportError:
        return []
    found = []
    for base in getattr(nvidia, "__path__", []):
        for root, _dirs, files in os.walk(base):
            if "cusparse.h" in files or "cublas_v2.h" in files:
                found.append(root)
    return sorted(set(found))


def cublaslt_link_args(cuda_home):
    """Link arguments for cuBLASLt (the decode step calls it directly: W_UV
    and the output projection): the toolkit's library, or the one the CUDA
    PyTorch wheel installed (nvidia-* wheels carry only the versioned file)."""
    dirs = [os.path.join(cuda_home, d) for d in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"))]
    try:
        import nvidia
        for base in getattr(nvidia, "__path__", []):
            for root, _dirs, files in os.walk(base):
                if any(f.startswith("libcublasLt.so") for f in files):
                    dirs.append(root)
    except ImportError:
        pass
    for d in dirs:
        if not os.path.isdir(d):
            continue
        names = sorted(f for f in os.listdir(d) if f.startswith("libcublasLt.so"))
        if "libcublasLt.so" in names:
            return [f"-L{d}", "-lcublasLt", f"-Wl,-rpath,{d}"]
        if names:
            return [f"-L{d}", f"-l:{names[0]}", f"-Wl,-rpath,{d}"]
    raise RuntimeError(f"cuBLASLt not found (looked in {dirs}); the CUDA build links it")


def extension():
    if os.environ.get("MLA_DECODE_NO_EXTENSION") == "1":
        return None, "MLA_DECODE_NO_EXTENSION=1"
    if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
        # torch guesses CUDA_HOME from `which nvcc`; where nvcc sits in
        # /usr/local/bin that guess lacks the headers, so prefer a real toolkit
        for cand in ("/usr/local/cuda", "/opt/cuda"):
            if os.path.isfile(os.path.join(cand, "include", "cuda_runtime_api.h")):
                os.environ["CUDA_HOME"] = cand
                break
    try:
        import torch
        from torch.utils import cpp_extension as ce
    except ImportError as e:
        return None, f"PyTorch is not importable at build time ({e}); use pip install --no-build-isolation"
    srcs = sources({"kernel", "nvkernel", "host", "python"})
    # PyTorch 2.13+ headers need C++20; older ones are built (and tested) with C++17
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    std = "-std=c++20" if (major, minor) >= (2, 13) else "-std=c++17"
    if torch.version.hip is not None:
        archs = os.environ.get("MLA_DECODE_HIP_ARCHS", "gfx942")
        os.environ.setdefault("PYTORCH_ROCM_ARCH", archs)
        cxx = ["-O3", std, f'-DMLA_BUILD_ARCHS="{archs}"']
        hip = ["-O3", std, f'-DMLA_BUILD_ARCHS="{archs}"'] + [f"--offload-arch={a}" for a in archs.split(";")]
        return ce.CUDAExtension("mla_decode._C", srcs, extra_compile_args={"cxx": cxx, "nvcc": hip}), None
    if torch.version.cuda is not None and ce.CUDA_HOME is not None:
        archs = os.environ.get("MLA_DECODE_CUDA_ARCHS", "9.0a")
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        label = ";".join("sm_" + a.replace(".", "") for a in archs.split(";"))
        cccl = os.path.join(ce.CUDA_HOME, "include", "cccl")  # <cuda/std/...> for the host compiler (CUDA 13)
        incs = [cccl] if os.path.isdir(cccl) else []
        incs += cuda_library_headers(ce.CUDA_HOME)
        cxx = ["-O3", std, f'-DMLA_BUILD_ARCHS="{label}"'] + ["-I" + i for i in incs]
        nvcc = ["-O3", std, "-lineinfo", "--expt-relaxed-constexpr", f'-DMLA_BUILD_ARCHS="{label}"']
        return ce.CUDAExtension("mla_decode._C", srcs, extra_compile_args={"cxx": cxx, "nvcc": nvcc},
                                extra_link_args=cublaslt_link_args(ce.CUDA_HOME)), None
    return None, f"PyTorch {torch.__version__} has no CUDA/HIP support or no toolkit was found (CUDA_HOME={ce.CUDA_HOME})"


ext, why_not = extension()
kwargs = {}
if ext is not None:
    from torch.utils.cpp_extension import BuildExtension

    kwargs = dict(ext_modules=[ext], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
else:
    print(f"mla_decode: building without compiled kernels: {why_not}", file=sys.stderr)

setup(
    name="mla_decode",
    version="0.2.0",
    description="DeepSeek-V3/R1 MLA decode kernels for AMD MI300X (HIP) and NVIDIA Hopper (CUDA)",
    license="MIT",
    packages=find_packages(include=["mla_decode", "mla_decode.*"]),
    python_requires=">=3.9",
    **kwargs,
)
