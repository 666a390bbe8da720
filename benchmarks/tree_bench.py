"""Token trees in the engine, measured through the shared harness (every setup in several interleaved
engine processes, medians with their min-max).

    python -m benchmarks.tree_bench verify     # target forward: tree of N nodes vs chain of N vs one token
    python -m benchmarks.tree_bench compare    # tree vs chain at equal node budgets, pairs a, b, c
    python -m benchmarks.tree_bench ablation   # EasySpec Figure-4 analog: tree width x N x calibration, pair b
    python -m benchmarks.tree_bench e2e        # pair c at batch 1 and 8: vanilla, vLLM, EasySpec chain and tree
    python -m benchmarks.tree_bench lookup     # pair c, default and code-edit prompts: trees + prompt lookup
    python -m benchmarks.tree_bench plot       # acceptance per depth, chain vs tree, from the compare results

Pairs: (a) SmolLM2-135M drafting for itself, (b) Qwen2.5-Coder-0.5B drafting for itself, (c) SmolLM2-135M
drafting for Qwen2.5-Coder-0.5B across vocabularies (the default pair). Greedy (T=0), bf16 unless --dtype.
Acceptance figures are vLLM's own counters: mean acceptance length = 1 + accepted / drafts, acceptance at
depth d = steps that accepted at least d nodes / drafts (vLLM's per-position rate, read per depth).
Results: benchmarks/results/tree_<part>*.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from benchmarks.easyspec_bench import PAIRS, draft_model_spec  # pairs (a), (b), (c) as documented above
from benchmarks.harness import (
    DEFAULT_PROMPT_KINDS,
    DEFAULT_REPEATS,
    RESULTS_DIR,
    Setup,
    Workload,
    load_prompts,
    markdown_table,
    run_setups,
    select_setups,
    write_results,
)
from vllm_easyspec.models import fetch_model
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
        return [_retokenized(setup) for setup in [*plain, chain]]
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


def _retokenized(setup: Setup) -> Setup:
    easyspec = setup.additional_config["easyspec"]
    tree = easyspec["tree"] | {"retokenize": True}
    return Setup(f"{setup.name}-retok", f"{setup.description}, retokenized", speculative_config=setup.speculative_config,
                 additional_config={"easyspec": easyspec | {"tree": tree}})


def _workload(args: argparse.Namespace, target: str, batch: int) -> Workload:
    return Workload(target=str(fetch_model(target)), prompts=load_prompts(limit=args.prompts),
                    max_tokens=args.max_tokens, batch_size=batch, dtype=args.dtype)


def verify(args: argparse.Namespace) -> None:
    """The cost of the target forward that verifies N nodes: tree vs chain (vLLM's C++ kernel) vs one token."""
    target, draft, hetero = PAIRS["c"]
    for batch in args.batches:
        setups = [Setup("vanilla", "no speculation: one token per step")]
        for nodes in args.nodes:
            setups.append(vllm_chain(draft, hetero, nodes))
            setups.append(easyspec_tree(f"tree-dynamic-{nodes}", draft, hetero, DYNAMIC[nodes]))
        rows = run_setups(setups, _workload(args, target, batch), repeats=args.repeats)
        _write(rows, f"tree_verify_b{batch}", f"Target forward per decode step: tree vs chain vs one token, pair (c), "
                                              f"batch {batch}, {args.dtype}", verify_table(rows))


def verify_table(rows: list[dict[str, Any]]) -> str:
    """Forward ms per decode step and the tree / chain ratio at each node count."""
    by_name = {r["setup"]: r for r in rows}
    single = by_name["vanilla"]["forward_seconds_per_decode_step"]
    lines = ["| nodes | one token (ms) | chain (ms) | tree (ms) | tree / chain | tree / one token |",
             "|---|---|---|---|---|---|"]
    for name, row in by_name.items():
        if not name.startswith("tree-dynamic-"):
            continue
        nodes = int(name.rsplit("-", 1)[1])
        chain = by_name[f"vllm-chain-{nodes}"]["forward_seconds_per_decode_step"]
        tree = row["forward_seconds_per_decode_step"]
        lines.append(f"| {nodes} | {1e3 * single:.1f} | {1e3 * chain:.1f} | {1e3 * tree:.1f} | {tree / chain:.2f} "
                     f"| {tree / single:.2f} |")
    return "\n".join(lines)


def compare(args: argparse.Namespace) -> None:
    """Tree vs chain at equal node budgets; the speed figures matter on the default pair (c)."""
    for pair in args.pairs:
        target, draft, hetero = PAIRS[pair]
        setups = [Setup("vanilla", "no speculation")]
        for budget in args.budgets:
            setups.append(vllm_chain(draft, hetero, budget))
            setups += tree_setups(draft, hetero, budget, merged=args.merged)
            if args.retokenize and hetero:
                setups += tree_setups(draft, hetero, budget, merged=args.merged, retokenize=True)
        for k in args.extra_chains:
            if k not in args.budgets:
                setups.append(vllm_chain(draft, hetero, k))
        setups = select_setups(setups, args.only)
        rows = run_setups(setups, _workload(args, target, args.batch), repeats=args.repeats)
        _write(rows, f"tree_compare_{pair}", f"Tree vs chain at equal node budgets, pair ({pair}): {draft} -> {target}, "
                                             f"batch {args.batch}, {args.dtype}", best_summary(rows))


def best_summary(rows: list[dict[str, Any]]) -> str:
    """Best chain and best tree per budget by mean acceptance length, and the fastest of each kind."""
    def kind(row: dict[str, Any]) -> str | None:
        name = row["setup"]
        return "chain" if "chain" in name else "tree" if name.startswith("tree") else None

    lines = []
    budgets = sorted({int(r["num_speculative_tokens"]) for r in rows if kind(r)})
    for budget in budgets:
        at_budget = [r for r in rows if kind(r) and int(r["num_speculative_tokens"]) == budget]
        chains = [r for r in at_budget if kind(r) == "chain"]
        trees = [r for r in at_budget if kind(r) == "tree"]
        if chains and trees:
            chain = max(chains, key=lambda r: r["mean_acceptance_length"] or 0)
            tree = max(trees, key=lambda r: r["mean_acceptance_length"] or 0)
            lines.append(f"budget {budget}: best chain {chain['setup']} {chain['mean_acceptance_length']:.2f}, best tree "
                         f"{tree['setup']} {tree['mean_acceptance_length']:.2f} "
                         f"({tree['mean_acceptance_length'] / chain['mean_acceptance_length']:.2f}x)")
    for label in ("chain", "tree"):
        candidates = [r for r in rows if kind(r) == label and r.get("speedup_vs_vanilla")]
        if candidates:
            fastest = max(candidates, key=lambda r: r["speedup_vs_vanilla"])
            lines.append(f"fastest {label}: {fastest['setup']} {fastest['speedup_vs_vanilla']:.2f}x vanilla "
                         f"[{fastest['speedup_min']:.2f}-{fastest['speedup_max']:.2f}]")
    return "\n".join(lines)


ABLATION_WIDTHS = {1: {"choices": chain_choices(4)}, 2: DEEP[8], 4: DEEP[16]}


def ablation(args: argparse.Namespace) -> None:
    """EasySpec's Figure 4 analog on the Qwen identity pair: does a wider tree tolerate a larger N?"""
    target, draft, hetero = PAIRS[args.ablation_pair]
    setups = []
    for width, tree in ABLATION_WIDTHS.items():
        for n in (1, 2, 3, 4):
            for calibration in ("every_round", "never") if n > 1 else ("every_round",):
                options = {"layer_parallel_size": n, "calibration": calibration, "mode": "fused"}
                setups.append(easyspec_tree(f"width{width}", draft, hetero, tree, **options))
    rows = run_setups(setups, _workload(args, target, args.batch), repeats=args.repeats)
    _write(rows, f"tree_ablation_{args.ablation_pair}", f"Tree width x layer_parallel_size x calibration, pair "
                                                        f"({args.ablation_pair}), batch {args.batch}, {args.dtype}",
           ablation_table(rows))


def ablation_table(rows: list[dict[str, Any]]) -> str:
    """Mean acceptance length per width and N, with calibration / without, and the drop vs N = 1."""
    by_name = {r["setup"]: r for r in rows}
    lines = ["| tree | N=1 | N=2 | N=3 | N=4 | drop at N=4 (with / without calibration) |", "|---|---|---|---|---|---|"]
    for width in ABLATION_WIDTHS:
        exact = by_name[f"width{width}"]["mean_acceptance_length"]
        cells = [f"{exact:.2f}"]
        for n in (2, 3, 4):
            calibrated = by_name[f"width{width}-n{n}"]["mean_acceptance_length"]
            uncalibrated = by_name[f"width{width}-n{n}-never"]["mean_acceptance_length"]
            cells.append(f"{calibrated:.2f} / {uncalibrated:.2f}")
        drop_with = 1 - by_name[f"width{width}-n4"]["mean_acceptance_length"] / exact
        drop_without = 1 - by_name[f"width{width}-n4-never"]["mean_acceptance_length"] / exact
        label = "chain of 4" if width == 1 else f"top_k {width}, depth 4, {ABLATION_WIDTHS[width]['budget']} nodes"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {100 * drop_with:.0f}% / {100 * drop_without:.0f}% |")
    return "\n".join(lines)


def e2e(args: argparse.Namespace) -> None:
    """The default pair end to end: vanilla, vLLM's draft_model at its best k, EasySpec chain, EasySpec trees
    (the fastest tree of the compare run, and a two-level tree whose second level runs fuzzy); with
    ``--retokenize`` also those trees bridged by text, and the merged 4-wide tree plus lookup so bridged."""
    target, draft, hetero = PAIRS["c"]
    fuzzy = {"layer_parallel_size": args.n, "mode": "fused"}
    for batch in args.batches:
        trees = [
            easyspec_tree(f"tree-wide-{args.wide}", draft, hetero, {"choices": wide_choices(args.wide)}),
            easyspec_tree("tree-dynamic-8", draft, hetero, DYNAMIC[8], **fuzzy),
        ]
        if args.retokenize:
            merged = easyspec_tree(f"tree-wide-{args.wide}+lookup-{LOOKUP_NODES}", draft, hetero,
                                   {"choices": wide_choices(args.wide)} | lookup_sources(LOOKUP_NODES))
            trees += [_retokenized(setup) for setup in [*trees, merged]]
        setups = [
            Setup("vanilla", "no speculation"),
            vllm_chain(draft, hetero, args.chain_k),
            easyspec_chain(draft, hetero, args.chain_k, **fuzzy),
            *trees,
        ]
        setups = select_setups(setups, args.only)
        rows = run_setups(setups, _workload(args, target, batch), repeats=args.repeats)
        _write(rows, f"tree_e2e_b{batch}", f"Default pair end to end, batch {batch}, {args.dtype}")


def lookup(args: argparse.Namespace) -> None:
    """Trees with prompt-lookup candidates merged in, on the default prompt mix and on code edits (prompts that
    ask for their own code back, changed): vanilla, vLLM ``ngram``, vLLM's fastest draft_model chain, the
    4-wide tree, and the same tree plus up to ``--lookup-nodes`` prompt-lookup nodes."""
    target, draft, hetero = PAIRS["c"]
    with_lookup = {"choices": wide_choices(args.wide)} | lookup_sources(args.lookup_nodes)
    for name, kinds in (("default", DEFAULT_PROMPT_KINDS), ("edit", ("edit",))):
        if name not in args.sets:
            continue
        setups = [
            Setup("vanilla", "no speculation"),
            Setup(f"vllm-ngram-{args.lookup_nodes}", "vLLM ngram, lookup 2..4",
                  speculative_config={"method": "ngram", "num_speculative_tokens": args.lookup_nodes,
                                      "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
            vllm_chain(draft, hetero, args.chain_k),
            easyspec_tree(f"tree-wide-{args.wide}", draft, hetero, {"choices": wide_choices(args.wide)}),
            easyspec_tree(f"tree-wide-{args.wide}-lookup-{args.lookup_nodes}", draft, hetero, with_lookup),
        ]
        workload = Workload(target=str(fetch_model(target)), prompts=load_prompts(limit=args.prompts, kinds=kinds),
                            max_tokens=args.max_tokens, batch_size=args.batch, dtype=args.dtype)
        rows = run_setups(setups, workload, repeats=args.repeats)
        _write(rows, f"tree_lookup_{name}", f"Trees plus prompt lookup, pair (c), {name} prompts, batch {args.batch}, "
                                            f"{args.dtype}")


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [p for p in args.pairs if (RESULTS_DIR / f"tree_compare_{p}.json").exists()]
    fig, axes = plt.subplots(1, max(len(pairs), 1), figsize=(max(5.5 * len(pairs), 7.5), 4.6), squeeze=False)
    for axis, pair in zip(axes[0], pairs, strict=False):
        rows = json.loads((RESULTS_DIR / f"tree_compare_{pair}.json").read_text())["rows"]
        for row in rows:
            per_depth = row["per_position_acceptance"] or []
            depth = max((i + 1 for i, value in enumerate(per_depth) if value > 0), default=0)
            if depth:
                style = "--" if "chain" in row["setup"] else "-"
                axis.plot(range(1, depth + 1), per_depth[:depth], style, marker="o", label=row["setup"])
        axis.set_title(f"pair ({pair})")
        axis.set_xlabel("depth (chain: position)")
        axis.set_ylabel("acceptance at depth (accepted / drafts)")
        axis.set_ylim(0, 1)
        axis.xaxis.get_major_locator().set_params(integer=True)
        axis.legend(fontsize=6)
    fig.suptitle("Acceptance per depth: chains (dashed) vs trees (solid) at equal node budgets", fontsize=10)
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "tree_acceptance_per_depth.png", dpi=110)


def _write(rows: list[dict[str, Any]], stem: str, title: str, summary: str = "") -> None:
    command = "python -m benchmarks.tree_bench " + " ".join(sys.argv[1:])
    paths = write_results(rows, stem, title, command, summary)
    print(markdown_table(rows))
    print(summary)
    print(f"results: {paths['md']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("verify", "compare", "ablation", "e2e", "lookup", "plot"))
    parser.add_argument("--pairs", nargs="*", default=["c", "a", "b"], choices=sorted(PAIRS))
    parser.add_argument("--budgets", type=int, nargs="*", default=[2, 4, 8, 16])
    parser.add_argument("--extra-chains", type=int, nargs="*", default=[1], help="compare: shorter chains too")
    parser.add_argument("--nodes", type=int, nargs="*", default=[4, 8, 16, 32], help="verify: node counts")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    parser.add_argument("--ablation-pair", default="b", choices=sorted(PAIRS))
    parser.add_argument("--chain-k", type=int, default=1, help="e2e: k of the chains (the fastest chain: 1)")
    parser.add_argument("--n", type=int, default=2, help="e2e: EasySpec layer_parallel_size")
    parser.add_argument("--wide", type=int, default=4, help="e2e, lookup: root children of the depth-1 tree")
    parser.add_argument("--lookup-nodes", type=int, default=4, help="lookup: prompt-lookup nodes (and ngram's k)")
    parser.add_argument("--merged", action="store_true",
                        help=f"compare: also the draft's tree plus {LOOKUP_NODES} prompt-lookup nodes in the same budget")
    parser.add_argument("--retokenize", action="store_true",
                        help="compare, e2e: also the trees bridged by text (tree.retokenize), on pairs across vocabularies")
    parser.add_argument("--only", help="compare, e2e: run only the setups whose name matches this regex (and vanilla)")
    parser.add_argument("--sets", nargs="*", default=["default", "edit"], choices=("default", "edit"),
                        help="lookup: prompt sets (edit: code edits, which repeat their input after some prose)")
    args = parser.parse_args()
    {"verify": verify, "compare": compare, "ablation": ablation, "e2e": e2e, "lookup": lookup, "plot": plot}[args.part](args)


if __name__ == "__main__":
    main()
