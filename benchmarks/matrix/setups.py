"""The matrix's setups (both drafters of the default target, fixed and under the controller) and its cells."""

from __future__ import annotations

import json
import random
from itertools import cycle, islice

from benchmarks.defaults import EAGLE_TREES, HEAD3, SMOL, class_prompts
from benchmarks.harness.setups import VANILLA, Cell, Setup
from vllm_easyspec.models import fetch_model

CLASSES = ("chat", "heldout", "edit", "mixed")
BATCHES = (1, 2, 4, 8, 16)
LOOKUP = {"prompt_lookup": {"nodes": 4}}
# The README's table for the merged EAGLE tree: the whole tree alone, a k=2 chain from 2 requests, none from 5.
EAGLE_TABLE = {"2": {"chain": 2}, "5": 0}
# The README's advice for a draft model ("no speculation at batch 8"), as a table: the tree below 4 requests.
DRAFT_TABLE = {"4": 0}
# vLLM's own batch-size schedule for chains (num_speculative_tokens_per_batch_size: inclusive ranges -> k),
# set as the tables above: the head's k=3 chain alone, k=2 from 2 requests, none from 5; the draft model's
# k=1 chain below 4 requests.
EAGLE_SCHEDULE = [[1, 1, 3], [2, 4, 2], [5, 1024, 0]]
DRAFT_SCHEDULE = [[1, 3, 1], [4, 1024, 0]]
BRIDGED_TREE = {"choices": [[0], [1], [2], [3]], "sources": LOOKUP, "retokenize": True}
DRAFT_AUTO_TREE = {"top_k": 4, "depth": 3, "budget": 12, "sources": LOOKUP, "retokenize": True, "auto": True}
# vLLM's prompt-lookup chain needs no draft: a fixed setup every pair's controller is held against
MODEL_FREE = "ngram"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def setups(pairs: list[str]) -> list[Setup]:
    """Vanilla, vLLM's ngram chain, then each pair's fixed setups, its ``budget_by_batch`` table and its
    controller."""
    chosen = [Setup(VANILLA, "no speculation"),
              Setup(f"{MODEL_FREE}-k4", "vLLM ngram (prompt lookup) chain, k=4, n-grams of 2 to 4", NGRAM)]
    if "eagle" in pairs:
        head = {"method": "eagle3", "model": str(HEAD3)}
        tree4 = EAGLE_TREES[4] | {"sources": LOOKUP}
        chosen += [
            Setup("eagle3-k2", "vLLM eagle3 chain, k=2", head | {"num_speculative_tokens": 2}),
            Setup("eagle3-k3", "vLLM eagle3 chain, k=3", head | {"num_speculative_tokens": 3}),
            Setup("eagle3-schedule", f"vLLM eagle3 chain, num_speculative_tokens_per_batch_size {EAGLE_SCHEDULE}",
                  head | {"num_speculative_tokens": 3, "num_speculative_tokens_per_batch_size": EAGLE_SCHEDULE}),
            Setup("eagle-tree-4+4", "EAGLE-2 tree, 4 head + 4 lookup nodes", head, {"easyspec": {"tree": tree4}}),
            Setup("eagle-tree-8+4", "EAGLE-2 tree, 8 head + 4 lookup nodes", head,
                  {"easyspec": {"tree": EAGLE_TREES[8] | {"sources": LOOKUP}}}),
            Setup("eagle-table", f"the 4 + 4 tree with budget_by_batch {json.dumps(EAGLE_TABLE)}", head,
                  {"easyspec": {"tree": tree4 | {"budget_by_batch": EAGLE_TABLE}}}),
            Setup("eagle-auto", "controller (auto) on a 16 + 4-node EAGLE-2 candidate", head,
                  {"easyspec": {"tree": EAGLE_TREES[16] | {"sources": LOOKUP, "auto": True}}}),
            Setup("eagle-auto-8", "controller (auto) on an 8 + 4-node EAGLE-2 candidate", head,
                  {"easyspec": {"tree": EAGLE_TREES[8] | {"sources": LOOKUP, "auto": True}}}),
            Setup("eagle-auto-4", "controller (auto) on the 4 + 4-node EAGLE-2 candidate (the table's tree)", head,
                  {"easyspec": {"tree": tree4 | {"auto": True}}}),
        ]
    if "draft" in pairs:
        draft = {"method": "draft_model", "model": str(fetch_model(SMOL)), "use_heterogeneous_vocab": True}
        chosen += [
            Setup("smol-k1", "vLLM draft_model chain, SmolLM2-135M, k=1", draft | {"num_speculative_tokens": 1}),
            Setup("smol-schedule", f"vLLM draft_model chain, num_speculative_tokens_per_batch_size {DRAFT_SCHEDULE}",
                  draft | {"num_speculative_tokens": 1, "num_speculative_tokens_per_batch_size": DRAFT_SCHEDULE}),
            Setup("smol-tree-4+4", "bridged tree, 4 root children + 4 lookup nodes", draft | {"num_speculative_tokens": 8},
                  {"easyspec": {"tree": BRIDGED_TREE}}),
            Setup("smol-table", f"the bridged tree with budget_by_batch {json.dumps(DRAFT_TABLE)}",
                  draft | {"num_speculative_tokens": 8},
                  {"easyspec": {"tree": BRIDGED_TREE | {"budget_by_batch": DRAFT_TABLE}}}),
            Setup("smol-auto", "controller (auto) on a 12 + 4-node bridged candidate",
                  draft | {"num_speculative_tokens": 16}, {"easyspec": {"tree": DRAFT_AUTO_TREE}}),
        ]
    return chosen


def cells(classes: list[str], batches: list[int], max_tokens: int, rounds: int = 2, ragged: bool = False,
          min_prompts: int = 4) -> list[Cell]:
    """Every class at every batch size: ``rounds x batch`` prompts (at least ``min_prompts``), the class's prompts
    repeated in order when it has fewer. With ``ragged``, each prompt's output length is drawn uniformly from
    ``max_tokens / 2`` to ``3 max_tokens / 2`` (:func:`ragged_lengths`: the same draw for every setup)."""
    out = []
    for prompt_class in classes:
        pool = class_prompts(prompt_class, 48)
        for batch in batches:
            count = max(rounds * batch, min_prompts)
            name = f"{prompt_class}-b{batch}"
            lengths = ragged_lengths(name, count, max_tokens) if ragged else None
            out.append(Cell(name, list(islice(cycle(pool), count)), batch, max_tokens, lengths, prompt_class))
    return out


def ragged_lengths(cell_name: str, count: int, mean: int) -> list[int]:
    """``count`` output lengths uniform in ``[mean / 2, 3 mean / 2]``, seeded by the cell's name. Requests that
    end on different steps, as a server's do, so that no setup's requests all finish on one step and have the
    next wave's prompts prefilled in one step (equal lengths give vanilla that alignment; speculation breaks it)."""
    draw = random.Random(cell_name)
    return [draw.randint(max(mean // 2, 1), mean + mean // 2) for _ in range(count)]


SIDE_BY_SIDE_KV_CACHE_GIB = 1  # per engine when a round's engines are resident at once (16 requests need ~0.1 GiB)
PAIR_OF = {"eagle": "EAGLE-3 head", "smol": "SmolLM2-135M draft"}


def pair_of(name: str) -> str | None:
    return next((label for prefix, label in PAIR_OF.items() if name.startswith(prefix)), None)


def held_against(name: str, prefix: str) -> bool:
    """Whether setup ``name`` is one of the pair's (``prefix``) or a model-free one, which every pair is held
    against."""
    return name.startswith((prefix, MODEL_FREE))


def is_controller(name: str) -> bool:
    """Whether setup ``name`` runs the controller: ``{pair}-auto``, or ``{pair}-auto-{candidate}``."""
    return name.endswith("-auto") or "-auto-" in name

