#!/usr/bin/env bash
# One device call that checks the GPU path end to end (run on the GPU machine from the project root, after the
# kit's part calls; see benchmarks/gpu/README.md):
#   1. the kit's engine check: vanilla, static and dynamic trees (greedy, T = 0.8), budget_by_batch chain steps,
#      auto, and the dynamic tree under CUDA graphs, with step traces of every tree verify step;
#   2. tree attention on Llama-3-8B shapes against the bandwidth floor, FlashAttention over a chain of the same
#      rows and vLLM's causal Triton attention (issue 61 item 4's protocol: benchmarks/kernels/gpu.py);
#   3. the GPU backend and kernel tests in-process with vLLM's GPU build.
# Outputs (at most 8 files under $OUT): run.log, engine.json, engine_logs.tgz, traces.tgz, tree_attention_gpu.jsonl,
# bench.log, pytest.log. Time limits (seconds) by stage: ENGINE_LIMIT, BENCH_LIMIT, TESTS_LIMIT.
set -u
cd "$(dirname "$0")/../.."
: "${OUT:=/tmp/kit-out}"
mkdir -p /tmp/tr "$OUT"
KIT=.gpu/proj/device

# Exact float32 products in every Triton attention (vLLM's and the tree kernel): Triton's default on NVIDIA is
# TF32, where the two kernels round differently and a near-tie can fall differently (H100: 7/8 in TF32, 8/8 here).
TRITON_F32_DEFAULT=${TRITON_F32_DEFAULT:-ieee} \
VLLM_EASYSPEC_STEP_TRACE=/tmp/tr/t EXTRA_SETUPS=benchmarks/gpu/engine_setups.json \
  SETUPS=${SETUPS:-vanilla,static_tree,dynamic_tree_pl,dynamic_tree_t08,bbb_chain,auto,dynamic_tree_pl:graphs} \
  ENGINE_JOBS=2 LIMIT=${ENGINE_LIMIT:-360} bash $KIT/run.sh engine
tar czf "$OUT/traces.tgz" -C /tmp tr

echo "======== bench (t=${SECONDS}s)"
( source $KIT/env.sh && timeout "${BENCH_LIMIT:-120}" python3 -P benchmarks/kernels/gpu.py \
    --out "$OUT/tree_attention_gpu.jsonl" --batches 1,8,32 --prefixes 2048,8192 --trees 8,16,32,64 ) > "$OUT/bench.log" 2>&1
tail -16 "$OUT/bench.log"

echo "======== tests (t=${SECONDS}s)"
TESTS_ENV=full PYTEST_ARGS='tests/tree/test_gpu_tree_backend.py tests/tree/test_tree_attention.py -m ""' \
  LIMIT=${TESTS_LIMIT:-100} bash $KIT/run.sh tests | tail -15
echo "device_run.sh done in ${SECONDS}s"
