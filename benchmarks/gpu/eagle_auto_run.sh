#!/usr/bin/env bash
# One device call for what the kit's built-in setups leave out (run on the GPU machine from the project root,
# after the kit's part calls; see benchmarks/gpu/README.md):
#   1. builds an EAGLE-3 head and a 2-layer draft for the kit's tiny target (benchmarks/gpu/extra_models.py);
#   2. the kit's engine check with EAGLE trees (greedy, T = 0.8), `tree.auto` with the EAGLE head and with the
#      small draft (greedy, T = 0.8), eagle trees and auto under CUDA graphs, exact float32 products
#      (TRITON_F32_DEFAULT=ieee), step traces of every tree verify step;
#   3. the step-trace invariants over all traces.
# Outputs under $OUT: run.log (the reply's tail), engine.json, engine_logs.tgz, traces.tgz (step traces and the
# controller's plan logs), traces_summary.txt.
set -u
cd "$(dirname "$0")/../.."
: "${OUT:=/tmp/kit-out}"
KIT=.gpu/proj/device
mkdir -p /tmp/tr "$OUT"
echo "======== models (t=${SECONDS}s)"
( bash $KIT/run.sh install > /dev/null 2>&1; source $KIT/env.sh
  python3 $KIT/engine_check.py --build-only && python3 -P benchmarks/gpu/extra_models.py ) 2>&1 | tail -4
TRITON_F32_DEFAULT=${TRITON_F32_DEFAULT:-ieee} \
VLLM_EASYSPEC_STEP_TRACE=/tmp/tr/t VLLM_EASYSPEC_PLAN_LOG=/tmp/tr/plan EXTRA_SETUPS=benchmarks/gpu/engine_setups.json \
  SETUPS=${SETUPS:-vanilla,eagle_tree,eagle_auto,auto_small,eagle_tree_t08,auto_small_t08,eagle_tree:graphs,auto_small:graphs} \
  ENGINE_JOBS=${ENGINE_JOBS:-2} LIMIT=${ENGINE_LIMIT:-470} bash $KIT/run.sh engine
echo "======== traces (t=${SECONDS}s)"
( source $KIT/env.sh; python3 -P -m vllm_easyspec.instruments.step_trace /tmp/tr/t*.jsonl ) > "$OUT/traces_summary.txt" 2>&1
( source $KIT/env.sh; python3 -P -m vllm_easyspec.instruments.plan_log /tmp/tr/plan*.jsonl ) >> "$OUT/traces_summary.txt" 2>&1
tail -40 "$OUT/traces_summary.txt"
tar czf "$OUT/traces.tgz" -C /tmp tr
echo "eagle_auto_run.sh done in ${SECONDS}s"
