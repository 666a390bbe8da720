"""The token-tree setups the tree studies compare (``benchmarks.easyspec.trees``): shapes by node budget, and
vLLM's and the plugin's chains beside them, all drafted by a draft model."""

from __future__ import annotations

import json
from typing import Any

from benchmarks.easyspec.chains import draft_model_spec
from benchmarks.harness.setups import Setup
from vllm_easyspec.tree.config import TreeConfig


def chain_choices(nodes: int) -> list[list[int]]:
    """A chain as a static tree: node d is the top child of node d - 1."""
    return [[0] * depth for depth in range(1, nodes + 1)]


def wide_choices(nodes: int) -> list[list[int]]:
    """A depth-1 tree: the ``nodes`` most likely root children."""
    return [[rank] for rank in range(nodes)]


# EAGLE-2 dynamic trees per node budget: expand the top_k of every depth, keep the budget best nodes.
# Two levels (one draft forward after the first pass) keep drafting cheap; budget 32 goes one level deeper.
DYNAMIC: dict[int, dict[str, int]] = {
    2: {"top_k": 2, "depth": 2, "budget": 2},
    4: {"top_k": 2, "depth": 2, "budget": 4},
    8: {"top_k": 4, "depth": 2, "budget": 8},
    16: {"top_k": 8, "depth": 2, "budget": 16},
    32: {"top_k": 8, "depth": 3, "budget": 32},
}


def vllm_chain(draft: str, hetero: bool, k: int) -> Setup:
    return Setup(f"vllm-chain-{k}", f"vLLM draft_model chain, k={k}", speculative_config=draft_model_spec(draft, hetero, k))


def easyspec_chain(draft: str, hetero: bool, k: int, **options: Any) -> Setup:
    suffix = _option_suffix(options)
    return Setup(f"easyspec-chain-{k}{suffix}", f"EasySpec chain, k={k} {options or ''}".strip(),
                 speculative_config=draft_model_spec(draft, hetero, k), additional_config={"easyspec": options})


def easyspec_tree(name: str, draft: str, hetero: bool, tree: dict[str, Any], **options: Any) -> Setup:
    """A tree setup; across vocabularies it maps ids through vLLM's shared vocabulary unless ``tree`` says
    ``retokenize`` (the plugin's default would bridge by text; those setups are named ``-retok``)."""
    if hetero:
        tree = {"retokenize": False} | tree
    nodes = TreeConfig(**tree).num_nodes
    return Setup(f"{name}{_option_suffix(options)}", f"EasySpec tree {json.dumps(tree)} {options or ''}".strip(),
                 speculative_config=draft_model_spec(draft, hetero, nodes),
                 additional_config={"easyspec": {"tree": tree} | options})


def _option_suffix(options: dict[str, Any]) -> str:
    parts = []
    if options.get("layer_parallel_size", 1) > 1:
        parts.append(f"n{options['layer_parallel_size']}")
    if options.get("calibration", "every_round") != "every_round":
        parts.append(options["calibration"].replace("_", ""))
    return "".join(f"-{p}" for p in parts)


# Deeper EAGLE-2 trees (four levels: three draft forwards after the first pass), the ablation's shapes:
# more acceptance per step for more drafting time.
DEEP: dict[int, dict[str, int]] = {8: {"top_k": 2, "depth": 4, "budget": 8}, 16: {"top_k": 4, "depth": 4, "budget": 16}}


# Six levels at 16 nodes: the deepest drafted shape compared (five draft forwards after the first pass).
DEEPER: dict[int, dict[str, int]] = {16: {"top_k": 3, "depth": 6, "budget": 16}}


def lookup_sources(nodes: int) -> dict[str, Any]:
    """A tree's ``sources`` entry: up to ``nodes`` prompt-lookup nodes, matching 2 to 4 context tokens."""
    return {"sources": {"prompt_lookup": {"nodes": nodes, "min_match": 2, "max_match": 4}}}


# Merged trees (the draft's tree plus prompt-lookup nodes) within the same node budget: the budget's
# drafted part shrinks by the lookup nodes.
LOOKUP_NODES = 4
MERGED: dict[int, dict[str, Any]] = {
    8: {"wide-4": {"choices": wide_choices(4)}, "deep-4": {"top_k": 2, "depth": 3, "budget": 4}},
    16: {"deep-12": {"top_k": 3, "depth": 4, "budget": 12}},
}


def tree_setups(draft: str, hetero: bool, budget: int, merged: bool = False, retokenize: bool = False,
                **options: Any) -> list[Setup]:
    """The tree shapes compared at one node budget: all root children (depth 1), EAGLE-2 dynamic with two
    levels, (budgets 8 and 16) EAGLE-2 dynamic with four levels and (16) with six; with ``merged``, the
    draft's tree plus ``LOOKUP_NODES`` prompt-lookup nodes in the same budget; with ``retokenize`` (a pair
    across vocabularies), each of them bridged by text (``tree.retokenize``, suffix ``-retok``), and a drafted
    chain re-encoded (``tree-chain-N-retok``: a tree of target tokens, where the draft's text allows two
    tokenizations)."""
    if retokenize:
        plain = tree_setups(draft, hetero, budget, merged, **options)
        chain = easyspec_tree(f"tree-chain-{budget}", draft, hetero, {"choices": chain_choices(budget)}, **options)
        return [retokenized(setup) for setup in [*plain, chain]]
    setups = [
        easyspec_tree(f"tree-wide-{budget}", draft, hetero, {"choices": wide_choices(budget)}, **options),
        easyspec_tree(f"tree-dynamic-{budget}", draft, hetero, DYNAMIC[budget], **options),
    ]
    if budget in DEEP:
        setups.append(easyspec_tree(f"tree-deep-{budget}", draft, hetero, DEEP[budget], **options))
    if budget in DEEPER:
        setups.append(easyspec_tree(f"tree-deeper-{budget}", draft, hetero, DEEPER[budget], **options))
    for shape, tree in MERGED.get(budget, {}).items() if merged else ():
        setups.append(easyspec_tree(f"tree-{shape}+lookup-{LOOKUP_NODES}", draft, hetero,
                                    tree | lookup_sources(LOOKUP_NODES), **options))
    return setups


def retokenized(setup: Setup) -> Setup:
    easyspec = setup.additional_config["easyspec"]
    tree = easyspec["tree"] | {"retokenize": True}
    return Setup(f"{setup.name}-retok", f"{setup.description}, retokenized", speculative_config=setup.speculative_config,
                 additional_config={"easyspec": easyspec | {"tree": tree}})

