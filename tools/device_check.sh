#!/usr/bin/env bash
# One device call: build, GPU tests, attention and decode benchmarks, SASS
# summary. Results under $OUT (or ./.out). Usage: bash tools/device_check.sh [quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
export MAX_JOBS=16 PYTHONUNBUFFERED=1
t0=$(date +%s)
bash run.sh test -x ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/test.log" | tail -25
echo "build+tests: $(( $(date +%s) - t0 )) s"
echo "== attention/serving/flexible tests again on the portable kernel (the AMD build's kernel)"
PYTHONSAFEPATH=1 MLA_DECODE_ATTN_KERNEL=portable python3 -m pytest -q -x tests/test_gpu_attention.py tests/test_gpu_serving.py tests/test_gpu_flexible.py 2>&1 | tail -2
echo "== attention/serving/flexible tests again with the Hopper kernel's TMA loads off (cp.async only)"
PYTHONSAFEPATH=1 MLA_DECODE_TMA=0 python3 -m pytest -q -x tests/test_gpu_attention.py tests/test_gpu_serving.py tests/test_gpu_flexible.py 2>&1 | tail -2
so=$(PYTHONSAFEPATH=1 python3 -c "import mla_decode._C as c; print(c.__file__)")
cuobjdump --dump-sass "$so" > "$OUT/sass.txt" 2>/dev/null
echo "SASS: HMMA $(grep -c HMMA "$OUT/sass.txt") HGMMA $(grep -c HGMMA "$OUT/sass.txt") LDL/STL $(grep -cE 'LDL|STL' "$OUT/sass.txt")"
export PYTHONSAFEPATH=1
cuobjdump --dump-resource-usage "$so" 2>/dev/null | grep -A1 -E "attention_kernel|attention_sm90_kernel" | grep -oE "REG:[0-9]+|STACK:[0-9]+|SHARED:[0-9]+|LOCAL:[0-9]+" | paste -sd' ' | tee "$OUT/resources.txt"
for k in ${KERNELS:-hopper portable}; do
  echo "== attention kernel $k"
  MLA_DECODE_ATTN_KERNEL=$k python3 benchmarks/bench_attention.py --json "$OUT/attn_$k.json" ${ATTN_ARGS:-} 2>&1 | tee "$OUT/attn_$k.txt"
done
[ "${1:-}" = quick ] || python3 benchmarks/bench_decode.py --json "$OUT/decode.json" --plot "$OUT/decode.png" 2>&1 | tee "$OUT/decode.txt"
