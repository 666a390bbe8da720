"""The step cost that ``easyspec.tree.auto`` measures at start-up, on a mixture-of-experts target and a dense
one of the same shape: milliseconds of the target's forward and logits by rows, and per extra row.

    python -m benchmarks matrix moe-cost [--layers 4] [--hidden 512] [--intermediate 1408] [--experts 8] [--repeats 3]

An MoE layer runs each row through its top-k experts, so rows added to a small batch touch experts that were
idle: the cost per extra row is higher than a dense target's while rows are few. Both targets are small random
float32 models built here (tests/tiny_models.py): a Mixtral with 8 experts, top 2, and a Llama with the same
hidden size, heads and layers whose MLP is as wide as the two experts a token uses, so both compute the same
per row, while the MoE reads more weights as rows spread over experts. The sizes make weights, not Python,
dominate a forward. Each engine runs in its
own process, ``--repeats`` times, interleaved; the table gives the median of each point.
Results: ``benchmarks/results/cost_curves.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
from pathlib import Path

from benchmarks.harness.report import command_line
from benchmarks.harness.setups import RESULTS_DIR

TREE = {"top_k": 2, "depth": 3, "budget": 6, "auto": True}


def _build(root: Path, layers: int, hidden: int, intermediate: int, experts: int) -> dict[str, Path]:
    from tests.tiny_models import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(root / "tokenizer")
    moe = build_tiny_model(root / "mixtral", tokenizer, "mixtral", num_layers=layers, seed=4, hidden_size=hidden,
                           intermediate_size=intermediate, num_local_experts=experts)
    # as wide as the two experts a token of the MoE target uses
    dense = build_tiny_model(root / "llama", tokenizer, "llama", num_layers=layers, seed=5, hidden_size=hidden,
                             intermediate_size=2 * intermediate)
    draft = build_tiny_model(root / "draft", tokenizer, "llama", num_layers=2, seed=6)
    return {"moe": moe, "dense": dense, "draft": draft}


def _curve(target: str, draft: str, queue) -> None:
    """In its own process: an engine with the controller on; its measured verify curve."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    from vllm import LLM

    from vllm_easyspec.instruments.worker_extension import WORKER_EXTENSION_CLS

    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=16, seed=0,
              speculative_config={"method": "draft_model", "model": draft},
              additional_config={"easyspec": {"tree": TREE}}, worker_extension_cls=WORKER_EXTENSION_CLS)
    stats = llm.collective_rpc("easyspec_controller_stats")[0]
    queue.put(stats["verify_curve"])
    # A multiprocessing child exits without atexit handlers: shut the engine down here, or its exit waits on
    # the engine's processes forever.
    llm.llm_engine.engine_core.shutdown()


def main(argv: list[str], prog: str = "python -m benchmarks matrix moe-cost") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408, help="an expert's MLP width")
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer (2 per token)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="cost-curves-") as scratch:
        models = _build(Path(scratch), args.layers, args.hidden, args.intermediate, args.experts)
        runs: dict[str, list[dict]] = {"moe": [], "dense": []}
        for _ in range(args.repeats):
            for name in runs:
                queue = context.Queue()
                process = context.Process(target=_curve, args=(str(models[name]), str(models["draft"]), queue))
                process.start()
                runs[name].append(queue.get())
                process.join()
    rows = runs["moe"][0]["rows"]
    median = {name: [statistics.median(run["seconds"][i] for run in curves) * 1e3 for i in range(len(rows))]
              for name, curves in runs.items()}
    lines = ["| rows | MoE ms | dense ms | MoE ms per extra row | dense ms per extra row |", "|---|---|---|---|---|"]
    for i, count in enumerate(rows):
        step = [(median[n][i] - median[n][i - 1]) / (count - rows[i - 1]) if i else None for n in ("moe", "dense")]
        cells = [f"{median['moe'][i]:.2f}", f"{median['dense'][i]:.2f}"] + ["" if v is None else f"{v:.3f}" for v in step]
        lines.append(f"| {count} | " + " | ".join(cells) + " |")
    def slope(name: str, low: int, high: int) -> float:
        return (median[name][rows.index(high)] - median[name][rows.index(low)]) / (high - low)

    spans = [(low, high) for low, high in ((1, 8), (8, 64)) if low in rows and high in rows]
    lines += ["", "| ms per extra row | MoE | dense | MoE / dense |", "|---|---|---|---|"]
    for low, high in spans:
        moe, dense = slope("moe", low, high), slope("dense", low, high)
        lines.append(f"| rows {low} to {high} | {moe:.3f} | {dense:.3f} | {moe / dense if dense > 0 else float('inf'):.1f}x |")
    table = "\n".join(lines)
    RESULTS_DIR.mkdir(exist_ok=True)
    command = command_line("matrix", ["moe-cost", *argv])
    (RESULTS_DIR / "cost_curves.json").write_text(json.dumps({"command": command.strip(), "runs": runs}, indent=1))
    (RESULTS_DIR / "cost_curves.md").write_text(
        f"# Verify cost by rows: a small MoE against a dense target of the same active width\n\n"
        f"`{command.strip()}`: {args.layers} layers, hidden {args.hidden}; MoE {args.experts} experts of width "
        f"{args.intermediate}, 2 per token; dense MLP width {2 * args.intermediate}. The curve each engine measured "
        f"at start-up (``easyspec.tree.auto``), median of {args.repeats} engine processes per target, interleaved."
        f"\n\n{table}\n")
    print(table)
    return 0

