"""EasySpec chains drafted by a draft model, through the shared harness: acceptance of fuzzy drafting against
exact, drafting time on two ranks, and decode speed end to end (``acceptance``, ``tp``, ``e2e``).

``acceptance`` also plots the acceptance against N of the pairs it ran (``easyspec_acceptance_vs_n.png``) and
tabulates each fuzzy setup's drop against exact drafting (``easyspec_acceptance_drop.md``).
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.defaults import QWEN, SMOL
from benchmarks.harness.processes import run_setups
from benchmarks.harness.report import write_results
from benchmarks.harness.setups import RESULTS_DIR, Setup, Workload, load_prompts
from vllm_easyspec.models import fetch_model

K = 4
PAIRS: dict[str, tuple[str, str, bool]] = {
    "a": (SMOL, SMOL, False),
    "b": (QWEN, QWEN, False),
    "c": (QWEN, SMOL, True),
}


def draft_model_spec(draft: str, hetero: bool, k: int = K) -> dict[str, Any]:
    """vLLM's speculative config for ``draft`` with ``k`` speculative tokens (across vocabularies if ``hetero``)."""
    spec: dict[str, Any] = {"method": "draft_model", "model": str(fetch_model(draft)), "num_speculative_tokens": k}
    if hetero:
        spec["use_heterogeneous_vocab"] = True
    return spec


def _easyspec_setup(name: str, draft: str, hetero: bool, tp: int = 1, **options: Any) -> Setup:
    described = ", ".join(f"{k}={v}" for k, v in options.items()) or "exact drafting (N=1)"
    spec = draft_model_spec(draft, hetero)
    if tp > 1 and options.get("mode") == "tensor_parallel":
        spec["draft_tensor_parallel_size"] = 1  # the draft is replicated on every rank (SmolLM2: 9 heads)
    return Setup(
        name=name,
        description=f"EasySpec {described}",
        speculative_config=spec,
        additional_config={"easyspec": options},
        tensor_parallel_size=tp,
    )


def acceptance(args: argparse.Namespace) -> None:
    """Acceptance of exact drafting against fuzzy N = 2, 3, 4, with and without bonus calibration, per pair."""
    rows_by_pair = {}
    for pair in args.pairs:
        target, draft, hetero = PAIRS[pair]
        setups = [_easyspec_setup(f"easyspec_{pair}_exact", draft, hetero)]
        for n in (2, 3, 4):
            for calibration in ("every_round", "never"):
                setups.append(
                    _easyspec_setup(
                        f"easyspec_{pair}_n{n}_{calibration}", draft, hetero,
                        layer_parallel_size=n, calibration=calibration, mode="fused",
                    )  # fmt: skip
                )
        workload = Workload(
            target=str(fetch_model(target)), prompts=load_prompts(limit=args.prompts), max_tokens=args.max_tokens,
            batch_size=args.batch, dtype="float32",
        )  # fmt: skip
        rows_by_pair[pair] = run_setups(setups, workload, repeats=args.repeats)
        _write(rows_by_pair[pair], f"easyspec_acceptance_{pair}",
               f"EasySpec acceptance, pair ({pair}): {draft} -> {target}", args.command)
    plot_acceptance(rows_by_pair)


def tp(args: argparse.Namespace) -> None:
    """Drafting-stage time on the same requests: TP1 exact/fused vs TP2 head-sharded/fused-TP/tensor_parallel."""
    for pair in args.pairs:
        target, draft, hetero = PAIRS[pair]
        setups = [
            _easyspec_setup(f"easyspec_{pair}_tp1_exact", draft, hetero),
            _easyspec_setup(f"easyspec_{pair}_tp1_fused_n2", draft, hetero, layer_parallel_size=2, mode="fused"),
            _easyspec_setup(
                f"easyspec_{pair}_tp2_tensor_parallel_n2", draft, hetero, tp=2,
                layer_parallel_size=2, mode="tensor_parallel",
            ),  # fmt: skip
        ]
        if pair != "c":  # SmolLM2's 9 heads cannot be head-sharded over 2 ranks (vLLM asserts)
            setups += [
                _easyspec_setup(f"easyspec_{pair}_tp2_exact", draft, hetero, tp=2),
                _easyspec_setup(
                    f"easyspec_{pair}_tp2_fused_n2", draft, hetero, tp=2, layer_parallel_size=2, mode="fused"
                ),
            ]
        workload = Workload(
            target=str(fetch_model(target)), prompts=load_prompts(limit=args.prompts), max_tokens=args.max_tokens,
            batch_size=args.batch, dtype="float32",
        )  # fmt: skip
        rows = run_setups(setups, workload, repeats=args.repeats)
        _write(rows, f"easyspec_drafting_time_{pair}", f"EasySpec drafting time per step, pair ({pair}), batch {args.batch}",
               args.command)


def e2e(args: argparse.Namespace) -> None:
    """Decode speed on pair (c): vanilla, vLLM's draft_model, the fused chain, and both at TP 2, per batch."""
    target, draft, hetero = PAIRS["c"]
    for batch in args.batches:
        setups = [
            Setup(name="vanilla", description="no speculation, TP 1"),
            Setup(name=f"easyspec_e2e_b{batch}_draft_model", description="vLLM draft_model (no plugin options)",
                  speculative_config=draft_model_spec(draft, hetero)),  # fmt: skip
            _easyspec_setup(f"easyspec_e2e_b{batch}_fused_n{args.n}", draft, hetero,
                            layer_parallel_size=args.n, mode="fused"),  # fmt: skip
            Setup(name=f"easyspec_e2e_b{batch}_vanilla_tp2", description="no speculation, TP 2",
                  tensor_parallel_size=2),  # fmt: skip
            _easyspec_setup(f"easyspec_e2e_b{batch}_tensor_parallel_n2_tp2", draft, hetero, tp=2,
                            layer_parallel_size=2, mode="tensor_parallel"),  # fmt: skip
        ]
        workload = Workload(
            target=str(fetch_model(target)), prompts=load_prompts(limit=args.prompts), max_tokens=args.max_tokens,
            batch_size=batch, dtype=args.dtype,
        )  # fmt: skip
        rows = run_setups(setups, workload, repeats=args.repeats)
        _write(rows, f"easyspec_e2e_b{batch}", f"EasySpec end to end, pair (c), batch {batch}, {args.dtype}", args.command)


def plot_acceptance(rows_by_pair: dict[str, list[dict[str, Any]]]) -> None:
    """Mean acceptance length and the acceptance-rate drop against N, per pair and calibration, from the rows of
    ``acceptance``; and the drops as a table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (length_axis, drop_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    summary = []
    for pair, color in (("a", "tab:blue"), ("b", "tab:green"), ("c", "tab:red")):
        if pair not in rows_by_pair:
            continue
        rows = {r["setup"]: r for r in rows_by_pair[pair]}
        exact = rows[f"easyspec_{pair}_exact"]
        for calibration, style in (("every_round", "-"), ("never", "--")):
            fuzzy = [rows[f"easyspec_{pair}_n{n}_{calibration}"] for n in (2, 3, 4)]
            label = f"({pair}) {calibration}"
            lengths = [exact["mean_acceptance_length"]] + [r["mean_acceptance_length"] for r in fuzzy]
            length_axis.plot([1, 2, 3, 4], lengths, style, color=color, marker="o", label=label)
            drops = [0.0] + [100 * (1 - r["acceptance_rate"] / exact["acceptance_rate"]) for r in fuzzy]
            drop_axis.plot([1, 2, 3, 4], drops, style, color=color, marker="o", label=label)
            for n, row in zip((2, 3, 4), fuzzy, strict=True):
                drop = 1 - row["acceptance_rate"] / exact["acceptance_rate"]
                summary.append((pair, n, calibration, row["acceptance_rate"], exact["acceptance_rate"], drop))
    for bar, text in ((7, "paper's bar (7%)"), (3, "our bar at N=2 (3%)")):
        drop_axis.axhline(bar, color="grey", linewidth=0.8, linestyle=":")
        drop_axis.annotate(text, (4, bar), fontsize=7, ha="right", va="bottom", color="grey")
    length_axis.set_ylabel("mean acceptance length")
    drop_axis.set_ylabel("acceptance-rate drop vs exact drafting (%)")
    for axis in (length_axis, drop_axis):
        axis.set_xlabel("layer_parallel_size N (1 = exact drafting)")
        axis.set_xticks([1, 2, 3, 4])
        axis.legend(fontsize=7)
    fig.suptitle(f"EasySpec acceptance vs N, with (every_round) and without (never) bonus calibration, k={K}")
    fig.tight_layout()
    fig.savefig(RESULTS_DIR / "easyspec_acceptance_vs_n.png", dpi=110)
    lines = ["| pair | N | calibration | acceptance | exact acceptance | relative drop |", "|---|---|---|---|---|---|"]
    for pair, n, calibration, rate, exact_rate, drop in summary:
        lines.append(f"| {pair} | {n} | {calibration} | {rate:.3f} | {exact_rate:.3f} | {100 * drop:.1f}% |")
    (RESULTS_DIR / "easyspec_acceptance_drop.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _write(rows: list[dict[str, Any]], stem: str, title: str, command: str) -> None:
    paths = write_results(rows, stem, title, command)
    print(paths["md"].read_text())
