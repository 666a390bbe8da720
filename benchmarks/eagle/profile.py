"""Where an engine step's time goes: cProfile over one timed ``generate`` per setup, engine in-process.

Answers "does the plugin add work to a step?" without timing noise: per setup it counts the engine steps and
the matrix multiplications (oneDNN GEMM calls), and sums the Python time spent in the plugin's own functions
(``vllm_easyspec``, self time) per step. Two setups doing the same steps with the same GEMM calls differ in
speed only by that plugin time and by the process (this machine's processes vary by up to 1.5x for life).

    python -m benchmarks eagle profile --prompts edit --batch 4 --max-tokens 64 --num-prompts 8 \
        --setup eagle3-k2 '{"method": "eagle3", "model": "heads/qwen2.5-coder-0.5b-instruct-eagle3", "num_speculative_tokens": 2}' '{}' \
        --setup table '{"method": "eagle3", "model": "heads/qwen2.5-coder-0.5b-instruct-eagle3"}' \
            '{"easyspec": {"tree": {"top_k": 2, "depth": 3, "budget": 4, "sources": {"prompt_lookup": {"nodes": 4}}, "budget_by_batch": {"2": {"chain": 2}, "5": 0}}}}'

Writes ``benchmarks/results/step_profile.md`` (``--stem`` to rename).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.defaults import QWEN, REPO_ROOT, class_prompts
from benchmarks.harness.setups import RESULTS_DIR, engine_env

GEMM = "onednn_mm"


def profile_in_process(request: dict) -> dict:
    """Child process: build the engine in-process, warm up, profile one ``generate``; return the counts."""
    import cProfile
    import pstats
    import time

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_easyspec.models import fetch_model, prompt_token_ids

    target = str(fetch_model(QWEN))
    spec = request["speculative_config"] or None
    if spec and "model" in spec and not Path(spec["model"]).is_absolute() and (REPO_ROOT / spec["model"]).exists():
        spec = spec | {"model": str(REPO_ROOT / spec["model"])}
    llm = LLM(model=target, dtype="bfloat16", enforce_eager=True, max_model_len=2048, max_num_seqs=request["batch"],
              speculative_config=spec, additional_config=request["additional_config"], seed=0)
    tokenizer = AutoTokenizer.from_pretrained(target)
    count = max(request["num_prompts"], request["batch"])
    texts = class_prompts(request["prompts"], count)
    prompts = [TokensPrompt(prompt_token_ids=prompt_token_ids(tokenizer, text)) for text in texts]
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    profiler.disable()
    seconds = time.perf_counter() - started
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, self, cumulative, ...)
    steps = sum(calls for (file, _, name), (calls, *_rest) in stats.items()
                if name == "execute_model" and file.endswith("gpu_model_runner.py"))
    gemm = [(calls, cumulative) for (file, _, name), (calls, _prim, _own, cumulative, *_rest) in stats.items()
            if name == GEMM and file.endswith("_custom_ops.py")]  # vLLM's wrapper: one entry per GEMM
    gemm_calls, gemm_seconds = sum(calls for calls, _ in gemm), sum(seconds for _, seconds in gemm)
    plugin = {f"{Path(file).name}:{name}": own for (file, _, name), (_calls, _prim, own, *_rest) in stats.items()
              if "vllm_easyspec" in file}
    return {"seconds": seconds, "steps": steps, "gemm_calls": gemm_calls, "gemm_seconds": gemm_seconds,
            "plugin_seconds": sum(plugin.values()),
            "top_plugin": sorted(plugin.items(), key=lambda item: -item[1])[:5]}


def run_setup(name: str, spec: dict, additional: dict, args: argparse.Namespace) -> dict:
    request = {"speculative_config": spec, "additional_config": additional, "batch": args.batch,
               "num_prompts": args.num_prompts, "prompts": args.prompts, "max_tokens": args.max_tokens}
    with tempfile.TemporaryDirectory() as folder:
        request_path, result_path = Path(folder) / "request.json", Path(folder) / "result.json"
        request_path.write_text(json.dumps(request))
        env = os.environ | engine_env(1) | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                            "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        subprocess.run([sys.executable, "-m", "benchmarks.eagle.profile", "--child", str(request_path),
                        str(result_path)], env=env, check=True, cwd=REPO_ROOT)
        return {"setup": name} | json.loads(result_path.read_text())


def table(rows: list[dict]) -> str:
    lines = ["| setup | run | generate s | engine steps | GEMM calls | GEMM s | plugin Python ms/step | top plugin functions (self ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        top = ", ".join(f"{name} {1e3 * own:.0f}" for name, own in row["top_plugin"][:3]) or "-"
        per_step = 1e3 * row["plugin_seconds"] / max(row["steps"], 1)
        lines.append(f"| {row['setup']} | {row['run']} | {row['seconds']:.2f} | {row['steps']} | {row['gemm_calls']} | "
                     f"{row['gemm_seconds']:.2f} | {per_step:.2f} | {top} |")
    return "\n".join(lines)


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--setup", nargs=3, action="append", required=True, metavar=("NAME", "SPEC", "ADDITIONAL"),
                        help="a setup: its name, speculative config JSON, additional config JSON")
    parser.add_argument("--prompts", choices=("heldout", "edit"), default="heldout")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="processes per setup, interleaved")
    parser.add_argument("--stem", default="step_profile")


def run(args: argparse.Namespace) -> None:
    """Where an engine step's time goes: steps, GEMM calls and the plugin's Python time per setup."""
    rows = []
    for repeat in range(1, args.repeats + 1):
        for name, spec, additional in args.setup:
            rows.append(run_setup(name, json.loads(spec), json.loads(additional), args) | {"run": repeat})
            print(table(rows[-1:]), flush=True)
    text = (f"# Engine step profile: {args.prompts} prompts, batch {args.batch}, {args.max_tokens} tokens, bfloat16, "
            f"greedy\n\nCommand: `{args.command}`\n\n{table(rows)}\n\nOne cProfile'd `generate` per engine process "
            "(in-process engine); plugin Python = self time of functions in `vllm_easyspec`.\n")
    path = RESULTS_DIR / f"{args.stem}.md"
    path.write_text(text)
    print(text)


if __name__ == "__main__":  # the child process of run_setup
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", nargs=2, metavar=("REQUEST", "RESULT"), required=True)
    request, result = (Path(path) for path in parser.parse_args().child)
    result.write_text(json.dumps(profile_in_process(json.loads(request.read_text()))))
