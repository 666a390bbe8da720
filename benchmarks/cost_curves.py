"""The step cost that ``easyspec.tree.auto`` measures at start-up, on a mixture-of-experts target and a dense
one of the same shape: milliseconds of the target's forward and logits by rows, and per extra row.

    python -m benchmarks.cost_curves [--layers 2] [--repeats 3]

An MoE layer runs each row through its top-k experts, so rows added to a small batch touch experts that were
idle: the cost per extra row is higher than a dense target's while rows are few. Both targets are tiny random
float32 models built here (tests/tiny_models.py: a Mixtral with 4 experts, top 2, and a Llama with the same
hidden size, heads and layers whose MLP is as wide as the two experts a token uses). Each engine runs in its
own process, ``--repeats`` times, interleaved; the table gives the median of each point.
Results: ``benchmarks/results/cost_curves.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import RESULTS_DIR

TESTS_DIR = Path(__file__).resolve().parents[1] / "tests"
TREE = {"top_k": 2, "depth": 3, "budget": 6, "auto": True}


def _build(root: Path, layers: int) -> dict[str, Path]:
    sys.path.insert(0, str(TESTS_DIR))
    from tiny_models import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(root / "tokenizer")
    moe = build_tiny_model(root / "mixtral", tokenizer, "mixtral", num_layers=layers, seed=4)
    dense = build_tiny_model(root / "llama", tokenizer, "llama", num_layers=layers, seed=5)
    config = json.loads((dense / "config.json").read_text())
    config["intermediate_size"] *= 2  # as wide as the two experts a token of the MoE target uses
    (dense / "config.json").write_text(json.dumps(config))
    _resize_dense_mlp(dense, config["intermediate_size"])
    draft = build_tiny_model(root / "draft", tokenizer, "llama", num_layers=2, seed=6)
    return {"moe": moe, "dense": dense, "draft": draft}


def _resize_dense_mlp(folder: Path, width: int) -> None:
    """Random MLP weights of the new width in place of the built ones."""
    import torch
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    weights = load_file(path)
    generator = torch.Generator().manual_seed(7)
    for name, tensor in list(weights.items()):
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            weights[name] = torch.randn(width, tensor.shape[1], generator=generator) * tensor.std()
        elif name.endswith("down_proj.weight"):
            weights[name] = torch.randn(tensor.shape[0], width, generator=generator) * tensor.std()
    save_file(weights, path)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="cost-curves-") as scratch:
        models = _build(Path(scratch), args.layers)
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
    table = "\n".join(lines)
    RESULTS_DIR.mkdir(exist_ok=True)
    command = "python -m benchmarks.cost_curves " + " ".join(argv if argv is not None else sys.argv[1:])
    (RESULTS_DIR / "cost_curves.json").write_text(json.dumps({"command": command.strip(), "runs": runs}, indent=1))
    (RESULTS_DIR / "cost_curves.md").write_text(
        f"# Verify cost by rows: tiny MoE against tiny dense target\n\n`{command.strip()}`\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
