"""Offline acceptance of the committed head (transformers, float32, greedy) on the held-out prompts and on as
many training prompts: separates how well the head generalises from how vLLM runs it.
Results: ``benchmarks/results/eagle_replay.json``."""

from __future__ import annotations

import argparse
import json

from benchmarks.defaults import HEAD3, QWEN
from benchmarks.harness.setups import RESULTS_DIR
from vllm_easyspec.models import fetch_model


def replay(num_prompts: int, k: int, max_tokens: int, command: str) -> None:
    """Per-position acceptance of ``k``-token chains over each prompt's greedy continuation of ``max_tokens``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_easyspec.models import prompt_token_ids
    from vllm_easyspec_train.checkpoint import load_head
    from vllm_easyspec_train.prompts import HELDOUT_PROMPTS, train_prompts
    from vllm_easyspec_train.simulate import replay_acceptance

    target = str(fetch_model(QWEN))
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    head = load_head(HEAD3)
    result = {"command": command, "k": k, "max_tokens": max_tokens}
    for name, prompts in (("heldout", HELDOUT_PROMPTS[:num_prompts]), ("train", train_prompts()[:num_prompts])):
        accepted, rounds = [0] * k, 0
        for text in prompts:
            ids = prompt_token_ids(tokenizer, text)
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
            r = replay_acceptance(head, target, ids, out[0, len(ids):].tolist(), k, model=model)
            rounds += r["rounds"]
            accepted = [a + b for a, b in zip(accepted, r["accepted_per_pos"], strict=True)]
        result[name] = {"num_prompts": len(prompts), "per_position_acceptance": [a / rounds for a in accepted],
                        "mean_acceptance_length": 1 + sum(accepted) / rounds}
        print(name, json.dumps(result[name]))
    (RESULTS_DIR / "eagle_replay.json").write_text(json.dumps(result, indent=2) + "\n")


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)


def run(args: argparse.Namespace) -> None:
    """Offline acceptance of the committed head: held-out against training prompts."""
    replay(args.num_prompts, args.k, args.max_tokens, args.command)
