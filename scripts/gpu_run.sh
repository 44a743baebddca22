#!/usr/bin/env bash
# One GPU session: CUDA tests + benchmarks, results under $OUT (the lent H200).
# Usage: bash scripts/gpu_run.sh [tests|decode|tests+decode|bench|all]
#   tests: pytest -m cuda; decode: bench.graph_replay without the compile baseline;
#   bench: the whole suite (python -m bench); all: tests then the suite.
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
if [ "$what" = tests ] || [ "$what" = all ] || [ "$what" = tests+decode ]; then
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest tests -m cuda -p no:cacheprovider -v -rfEs \
    --durations=15 2>&1 | tee "$OUT/cuda_tests.txt"
  rc=${PIPESTATUS[0]}
fi
if [ "$what" = decode ] || [ "$what" = tests+decode ]; then
  python3 -m bench.graph_replay --no-compile 2>&1 | tee "$OUT/graph_replay.txt"
  rc=$((rc | PIPESTATUS[0]))
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 -m bench --out "$OUT" 2>&1 | tee "$OUT/bench_log.txt"
  rc=$((rc | PIPESTATUS[0]))
fi
exit $rc
