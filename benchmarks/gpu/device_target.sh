#!/usr/bin/env bash
# The target on the device: check the GGUF the part calls put back together, then convert it with the project's
# own code, and print the converted folder (the last line of stdout). For the device flows (real_model.sh) after
# the part calls of `python benchmarks/gpu/target_parts.py prepare`, with ".gpu/target" carried:
#
#   model=$(bash benchmarks/gpu/device_target.sh GGUF DTYPE LOG) || exit 1
#
# GGUF   the reassembled file (/tmp/target.gguf on the device)
# DTYPE  bfloat16 | float32
# LOG    where the conversion's own output goes (transformers' progress bars)
# Env: PY (default python3), VLLM_EASYSPEC_CACHE (where the folder goes; an existing conversion of the same
#      GGUF is reused), TARGET_NAME (default qwen2.5-coder-0.5b-instruct).
# The conversion is `vllm-easyspec models fetch NAME --gguf GGUF --dtype DTYPE`, run as `python -m
# vllm_easyspec.cli` because the kit unpacks the project wheel without installing its console script.
set -u
cd "$(dirname "$0")/../.."
gguf=$1 dtype=$2 log=$3
py=${PY:-python3}
name=${TARGET_NAME:-qwen2.5-coder-0.5b-instruct}
"$py" -P benchmarks/gpu/target_parts.py check "$gguf" >&2 || exit 1
model=$("$py" -P -m vllm_easyspec.cli models fetch "$name" --gguf "$gguf" --dtype "$dtype" 2> "$log" | tail -1)
if [[ ! -f $model/config.json ]]; then
  echo "device_target.sh: the conversion failed; the end of $log:" >&2
  tail -5 "$log" >&2
  exit 1
fi
echo "$model"
