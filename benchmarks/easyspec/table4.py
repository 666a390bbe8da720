"""EasySpec Table-4 analog: mean cosine similarity between exact and fuzzy h, attention output, q, k, v.

Runs the transformers models directly (float32), grouped by the plugin's own layer-grouping code, over
the benchmark prompts (chat template applied) followed by each model's own greedy continuation.

    python -m benchmarks easyspec table4 --prompts 8 --continuation 48

Writes benchmarks/results/easyspec_table4.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from benchmarks.easyspec.cosine import QUANTITIES, table4_for_model
from benchmarks.harness.setups import RESULTS_DIR, load_prompts
from vllm_easyspec.models import prompt_token_ids

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "gemma3-270m")


def _sequences(model, tokenizer, prompts: list[str], continuation: int) -> list[torch.Tensor]:
    sequences = []
    for text in prompts:
        ids = torch.tensor([prompt_token_ids(tokenizer, text)])
        if continuation:
            with torch.no_grad():
                ids = model.generate(ids, max_new_tokens=continuation, do_sample=False)
        sequences.append(ids)
    return sequences


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--continuation", type=int, default=48)
    parser.add_argument("--models", nargs="*", default=list(MODELS))


def table4(args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_easyspec.models import fetch_model

    prompts = load_prompts(limit=args.prompts)
    rows = []
    for name in args.models:
        path = fetch_model(name)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        started = time.perf_counter()
        sequences = _sequences(model, tokenizer, prompts, args.continuation)
        table = table4_for_model(model, sequences)
        tokens = sum(int(s.shape[1]) for s in sequences)
        for n, values in table.items():
            rows.append({"model": name, "layer_parallel_size": n, "num_layers": len(model.model.layers),
                         "num_sequences": len(sequences), "num_tokens": tokens, **values})  # fmt: skip
        print(f"{name}: {time.perf_counter() - started:.0f}s", file=sys.stderr)
        del model
    command = args.command
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "easyspec_table4.json").write_text(
        json.dumps({"command": command, "prompts": args.prompts, "continuation": args.continuation, "rows": rows},
                   indent=2) + "\n"  # fmt: skip
    )
    lines = [
        "# EasySpec Table-4 analog: mean cosine(exact, fuzzy)",
        "",
        f"Command: `{command}` ({args.prompts} benchmark prompts + {args.continuation} greedy tokens each, "
        "float32, transformers). Averaged over the non-first members of every fuzzy group; `attn_out` has "
        "every position fuzzy (conservative).",
        "",
        "| model | N | layers | compared layer-instances | " + " | ".join(QUANTITIES) + " |",
        "|---|---|---|---|" + "---|" * len(QUANTITIES),
    ]
    for r in rows:
        values = " | ".join(f"{r[q]:.3f}" for q in QUANTITIES)
        lines.append(f"| {r['model']} | {r['layer_parallel_size']} | {r['num_layers']} | "
                     f"{r['compared_layer_instances']} | {values} |")  # fmt: skip
    (RESULTS_DIR / "easyspec_table4.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

