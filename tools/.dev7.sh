set -uo pipefail
export MAX_JOBS=16 PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
rm -rf build; python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | grep -v "^$" | tail -5
echo "build $(( $(date +%s)-t0 )) s"
for e in 1 2 3; do MLA_EXP=$e python3 -m pytest -q -x tests/test_gpu_attention.py -k "not portable" 2>&1 | tail -1; done
for rep in 1 2; do for e in 0 1 2 3; do
  echo "== E$e"; MLA_EXP=$e python3 benchmarks/bench_attention.py --lengths 2049 6145 --iters 30 2>&1 | grep -E "^ +[0-9]+ +(no|kpe)"
done; done
echo "total $(( $(date +%s)-t0 )) s"
