#!/usr/bin/env python3
"""Compile every kernel source for AMD gfx942 (device only) and report its
resources; fail on a compile error, scratch use, a spill or an external call.

    python3 tools/hip_report.py [--clang clang++-19] [--arch gfx942] [--markdown]

Uses Debian's clang-19 with the HIP headers of libamdhip64-dev; no device
libraries are linked (-nogpulib), so the kernels must not call any (the
vendor layer uses builtins). Reads csrc/sources.txt ("kernel" lines).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kernel_sources():
    out = []
    with open(os.path.join(ROOT, "csrc", "sources.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line and line.split()[0] in ("kernel", "nvkernel"):
                out.append((line.split()[1], line.split()[0] == "nvkernel"))
    return out


def demangle(names):
    try:
        res = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        return res.stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return names


def parse(asm):
    """Per kernel: resources from the metadata and the function's comments,
    and the count of MFMA instructions and external calls in its body."""
    kernels = {}
    # function bodies: from "name:" to ".Lfunc_endN:"
    for m in re.finditer(r"^(\S+):[^\n]*\n(.*?)^\.Lfunc_end\d+:", asm, re.S | re.M):
        name, body = m.group(1), m.group(2)
        if name.startswith("."):
            continue
        k = kernels.setdefault(name, {})
        k["mfma"] = len(re.findall(r"^\s*v_mfma", body, re.M))
        k["calls"] = len(re.findall(r"s_swappc_b64", body))
    # metadata (YAML in .amdgpu_metadata)
    meta = asm[asm.find(".amdgpu_metadata"):]
    for block in re.split(r"\n\s+- \.", meta):
        name = re.search(r"\.name:\s+(\S+)", "." + block)
        if not name or name.group(1) not in kernels:
            continue
        k = kernels[name.group(1)]
        for field in ("vgpr_count", "agpr_count", "sgpr_count", "group_segment_fixed_size",
                      "private_segment_fixed_size", "vgpr_spill_count", "sgpr_spill_count"):
            fm = re.search(r"\." + field + r":\s+(\d+)", "." + block)
            if fm:
                k[field] = int(fm.group(1))
    # the arch-VGPR / AGPR split, from the per-function comments
    for m in re.finditer(r"^(\S+):[^\n]*\n.*?; NumVgprs: (\d+)\n; NumAgprs: (\d+)", asm, re.S | re.M):
        if m.group(1) in kernels:
            kernels[m.group(1)]["arch_vgpr"] = int(m.group(2))
            kernels[m.group(1)]["agpr"] = int(m.group(3))
    return kernels


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clang", default=os.environ.get("HIP_CLANG", "clang++-19"))
    ap.add_argument("--arch", default="gfx942")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--keep", help="folder to keep the .s files in")
    args = ap.parse_args()

    failures = []
    rows = []
    outdir = args.keep or tempfile.mkdtemp()
    os.makedirs(outdir, exist_ok=True)
    for src, nvidia_only in kernel_sources():
        out = os.path.join(outdir, os.path.basename(src) + f".{args.arch}.s")
        cmd = [args.clang, "-x", "hip", "-std=c++17", "-O3", f"--offload-arch={args.arch}", "--cuda-device-only",
               "-nogpulib", "-S", "-I", os.path.join(ROOT, "csrc"), os.path.join(ROOT, src), "-o", out]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            print(res.stdout + res.stderr, file=sys.stderr)
            failures.append(f"{src}: compile error")
            continue
        kernels = parse(open(out).read())
        if not kernels and not nvidia_only:
            failures.append(f"{src}: no kernels found in the assembly")
        if nvidia_only:
            print(f"{src}: NVIDIA-only source, compiles for {args.arch} to host stubs ({len(kernels)} kernels)")
        names = demangle(list(kernels))
        for (mangled, k), pretty in zip(kernels.items(), names):
            short = re.sub(r"\(.*\)$", "", pretty.replace("mla::(anonymous namespace)::", "").replace("void ", ""))
            rows.append((src, short, k))
            if k.get("private_segment_fixed_size", 0) > 0:
                failures.append(f"{short}: {k['private_segment_fixed_size']} bytes of scratch")
            if k.get("vgpr_spill_count", 0) or k.get("sgpr_spill_count", 0):
                failures.append(f"{short}: spills (vgpr {k.get('vgpr_spill_count')}, sgpr {k.get('sgpr_spill_count')})")
            if k.get("calls", 0):
                failures.append(f"{short}: {k['calls']} external calls (a device-library function slipped in)")

    if args.markdown:
        print("| kernel | arch VGPRs | AGPRs | SGPRs | LDS static (B) | scratch (B) | spills | MFMA instrs |")
        print("|---|---|---|---|---|---|---|---|")
    else:
        print(f"gfx942 resources ({args.clang}, --offload-arch={args.arch}, device only)")
    for src, name, k in rows:
        spills = k.get("vgpr_spill_count", 0) + k.get("sgpr_spill_count", 0)
        cells = (name, k.get("arch_vgpr", k.get("vgpr_count")), k.get("agpr", 0), k.get("sgpr_count"),
                 k.get("group_segment_fixed_size"), k.get("private_segment_fixed_size"), spills, k.get("mfma"))
        if args.markdown:
            print("| " + " | ".join(str(c) for c in cells) + " |")
        else:
            print("  {:<60} vgpr {:>3}  agpr {:>3}  sgpr {:>3}  lds {:>6}  scratch {:>4}  spills {}  mfma {}".format(*cells))
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"ok: {len(rows)} kernels, no scratch, no spills, no external calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
