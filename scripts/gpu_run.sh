#!/usr/bin/env bash
# One GPU session: CUDA tests + benchmarks, results under $OUT (the lent H200).
# Usage: bash scripts/gpu_run.sh [tests|bench|all]
set -uo pipefail
what=${1:-all}
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || export PYTHONPATH=$PWD
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/env.txt"
rc=0
if [ "$what" != bench ]; then
  python3 -m pytest tests -m cuda -p no:cacheprovider -q -rs 2>&1 | tee "$OUT/cuda_tests.txt"
  rc=${PIPESTATUS[0]}
fi
python3 scripts/flex_probe.py 2>&1 | grep flex_probe | tee "$OUT/flex_probe.txt"
if [ "$what" != tests ]; then
  python3 -m bench --out "$OUT" 2>&1 | tee "$OUT/bench_log.txt"
  rc=$((rc | PIPESTATUS[0]))
fi
exit $rc
