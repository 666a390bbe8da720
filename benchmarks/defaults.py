"""The models, the committed EAGLE head, its trees and the prompt classes that several benchmarks run."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness.setups import load_prompts

REPO_ROOT = Path(__file__).resolve().parents[1]
QWEN = "qwen2.5-coder-0.5b-instruct"  # the default target
SMOL = "smollm2-135m-instruct"  # the default draft model
HEAD3 = REPO_ROOT / "heads" / "qwen2.5-coder-0.5b-instruct-eagle3"  # the committed EAGLE-3 head, for QWEN

# The plugin's EAGLE-2 dynamic trees at node budgets 4..32: top_k children per kept node, depth levels,
# budget nodes kept after reranking by cumulative draft log-probability.
EAGLE_TREES = {
    4: {"top_k": 2, "depth": 3, "budget": 4},
    8: {"top_k": 3, "depth": 4, "budget": 8},
    16: {"top_k": 4, "depth": 5, "budget": 16},
    32: {"top_k": 6, "depth": 6, "budget": 32},
}

PROMPT_CLASSES = ("heldout", "edit", "chat", "mixed")


def class_prompts(prompt_set: str, count: int) -> list[str]:
    """``heldout``: the EAGLE benchmark's held-out tasks (in no training prompt of the head); ``edit``: code edits
    (the answer repeats the prompt's code, where lookup should win); ``chat``: the main job's chat prompts;
    ``mixed``: the three interleaved."""
    from vllm_easyspec_train.prompts import HELDOUT_PROMPTS

    classes = {
        "heldout": lambda n: HELDOUT_PROMPTS[:n],
        "edit": lambda n: load_prompts(limit=n, kinds=("edit",)),
        "chat": lambda n: load_prompts(limit=n),
    }
    if prompt_set != "mixed":
        return classes[prompt_set](count)
    per_class = [classes[name](count) for name in ("heldout", "edit", "chat")]
    return [p for group in zip(*per_class) for p in group][:count]
