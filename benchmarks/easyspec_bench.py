"""EasySpec measurements on real weights, through the shared harness (one fresh engine per setup).

    python -m benchmarks.easyspec_bench acceptance   # exact vs fuzzy N=2,3,4 x every_round/never, pairs a,b,c
    python -m benchmarks.easyspec_bench tp           # drafting time on 2 CPU ranks (tensor_parallel, fused-TP)
    python -m benchmarks.easyspec_bench e2e          # decode tok/s batch 1 and 8, TP 1 and 2, pair c
    python -m benchmarks.easyspec_bench plot         # acceptance vs N with/without calibration

Pairs: (a) SmolLM2-135M drafting for itself, (b) Qwen2.5-Coder-0.5B drafting for itself, (c) SmolLM2-135M
drafting for Qwen2.5-Coder-0.5B across vocabularies (``use_heterogeneous_vocab``). Greedy (T=0).
Results: benchmarks/results/easyspec_<part>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from benchmarks.harness import (
    DEFAULT_REPEATS,
    RESULTS_DIR,
    Setup,
    Workload,
    load_prompts,
    run_setups,
    write_results,
)
from vllm_easyspec.models import fetch_model

K = 4
SMOL = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"
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
        rows = run_setups(setups, workload, repeats=args.repeats)
        _write(rows, f"easyspec_acceptance_{pair}", f"EasySpec acceptance, pair ({pair}): {draft} -> {target}")


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
        _write(rows, f"easyspec_drafting_time_{pair}", f"EasySpec drafting time per step, pair ({pair}), batch {args.batch}")


def e2e(args: argparse.Namespace) -> None:
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
        _write(rows, f"easyspec_e2e_b{batch}", f"EasySpec end to end, pair (c), batch {batch}, {args.dtype}")


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (length_axis, drop_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    summary = []
    for pair, color in (("a", "tab:blue"), ("b", "tab:green"), ("c", "tab:red")):
        path = RESULTS_DIR / f"easyspec_acceptance_{pair}.json"
        if not path.exists():
            continue
        rows = {r["setup"]: r for r in json.loads(path.read_text())["rows"]}
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


def _write(rows: list[dict[str, Any]], stem: str, title: str) -> None:
    command = "python -m benchmarks.easyspec_bench " + " ".join(sys.argv[1:])
    paths = write_results(rows, stem, title, command)
    print(paths["md"].read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("acceptance", "tp", "e2e", "plot"))
    parser.add_argument("--pairs", nargs="*", default=["a", "b", "c"], choices=sorted(PAIRS))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--n", type=int, default=2, help="EasySpec N for the e2e run")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--repeats", type=int, default=DEFAULT_REPEATS,
        help="engine processes per setup, run interleaved; speeds are medians with their min-max",
    )  # fmt: skip
    args = parser.parse_args()
    {"acceptance": acceptance, "tp": tp, "e2e": e2e, "plot": plot}[args.part](args)


if __name__ == "__main__":
    main()
