"""Token trees drafted by a draft model, through the shared harness (every setup in several interleaved engine
processes, medians with their min-max): ``tree-verify`` (target forward: a tree of N nodes against a chain of N
and one token), ``tree-compare`` (trees against chains at equal node budgets, and a plot of acceptance per depth
of the pairs it ran, ``tree_acceptance_per_depth.png``), ``tree-ablation`` (EasySpec's Figure-4 analog: tree
width x N x calibration), ``tree-e2e`` (the default pair end to end) and ``tree-lookup`` (trees merged with
prompt lookup, on the default and the code-edit prompts). Setups: ``benchmarks.easyspec.tree_setups``.

Acceptance figures are vLLM's own counters: mean acceptance length = 1 + accepted / drafts, acceptance at
depth d = steps that accepted at least d nodes / drafts (vLLM's per-position rate, read per depth).
Results: benchmarks/results/tree_<part>*.{json,md,png}.
"""


from __future__ import annotations

import argparse
from typing import Any

from benchmarks.easyspec.chains import PAIRS
from benchmarks.easyspec.tree_setups import (
    DEEP,
    DYNAMIC,
    LOOKUP_NODES,
    chain_choices,
    easyspec_chain,
    easyspec_tree,
    lookup_sources,
    retokenized,
    tree_setups,
    vllm_chain,
    wide_choices,
)
from benchmarks.harness.processes import run_setups
from benchmarks.harness.report import markdown_table, write_results
from benchmarks.harness.setups import (
    DEFAULT_PROMPT_KINDS,
    RESULTS_DIR,
    Setup,
    Workload,
    load_prompts,
    select_setups,
)
from vllm_easyspec.models import fetch_model


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
                                              f"batch {batch}, {args.dtype}", args.command, verify_table(rows))


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
    rows_by_pair = {}
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
        rows = rows_by_pair[pair] = run_setups(setups, _workload(args, target, args.batch), repeats=args.repeats)
        _write(rows, f"tree_compare_{pair}", f"Tree vs chain at equal node budgets, pair ({pair}): {draft} -> {target}, "
                                             f"batch {args.batch}, {args.dtype}", args.command, best_summary(rows))
    plot_per_depth(rows_by_pair)


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
           args.command, ablation_table(rows))


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
            trees += [retokenized(setup) for setup in [*trees, merged]]
        setups = [
            Setup("vanilla", "no speculation"),
            vllm_chain(draft, hetero, args.chain_k),
            easyspec_chain(draft, hetero, args.chain_k, **fuzzy),
            *trees,
        ]
        setups = select_setups(setups, args.only)
        rows = run_setups(setups, _workload(args, target, batch), repeats=args.repeats)
        _write(rows, f"tree_e2e_b{batch}", f"Default pair end to end, batch {batch}, {args.dtype}", args.command)


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
                                            f"{args.dtype}", args.command)


def plot_per_depth(rows_by_pair: dict[str, list[dict[str, Any]]]) -> None:
    """Acceptance at each depth of every setup of ``compare``, one panel per pair, chains dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = list(rows_by_pair)
    fig, axes = plt.subplots(1, max(len(pairs), 1), figsize=(max(5.5 * len(pairs), 7.5), 4.6), squeeze=False)
    for axis, pair in zip(axes[0], pairs, strict=False):
        for row in rows_by_pair[pair]:
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


def _write(rows: list[dict[str, Any]], stem: str, title: str, command: str, summary: str = "") -> None:
    paths = write_results(rows, stem, title, command, summary)
    print(markdown_table(rows))
    print(summary)
    print(f"results: {paths['md']}")

