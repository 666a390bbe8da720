"""Held-out agreement of EAGLE heads against the tokens they trained on: does more data still pay?

    python -m benchmarks eagle agreement HEAD_OR_TRAIN_DIR [...] [--labels ...] [--out benchmarks/results/eagle_agreement_vs_tokens]

Each argument is a head folder (its ``eagle_manifest.json``) or a training output folder still in progress (its
``train_state.pt``). Every evaluation in the training history is a point: the teacher-forced top-1 agreement
at steps 1..k on the held-out sequences, and the chain's expected accepted length. Histories written before the
trainer counted tokens are placed at ``step x batch size x mean sequence length`` (marked "estimated").
Writes ``OUT.png`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.harness.setups import RESULTS_DIR


def load_history(folder: Path) -> tuple[list[dict], dict]:
    """(history, manifest or {}) of a head folder or a training folder."""
    manifest_file = folder / "eagle_manifest.json"
    if manifest_file.exists():
        manifest = json.loads(manifest_file.read_text())
        return manifest["history"], manifest
    import torch

    state = torch.load(folder / "train_state.pt", weights_only=False, map_location="cpu")
    return state["history"], {}


def tokens_axis(history: list[dict], manifest: dict) -> tuple[list[float], bool]:
    """Tokens trained on at each evaluation, and whether they are estimated from the step."""
    if all("tokens_seen" in h for h in history):
        return [float(h["tokens_seen"]) for h in history], False
    data, training = manifest.get("data", {}), manifest.get("training", {})
    if not data.get("train_sequences") or not training.get("batch_size"):
        raise SystemExit("a history without token counts needs its manifest's data and training sizes")
    per_step = training["batch_size"] * data["train_tokens"] / data["train_sequences"]
    return [h["step"] * per_step for h in history], True


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--labels", nargs="*", help="one per folder (default: the folder's name)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "eagle_agreement_vs_tokens")


def run(args: argparse.Namespace) -> int:
    """Held-out agreement of heads against the tokens they trained on."""
    labels = args.labels or [folder.name for folder in args.folders]
    if len(labels) != len(args.folders):
        raise SystemExit("--labels needs one label per folder")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_agree, ax_len) = plt.subplots(1, 2, figsize=(11, 4.2))
    lines = ["| head | tokens trained on | agreement at steps 1..k | chain accepted length |", "|---|---|---|---|"]
    for folder, label in zip(args.folders, labels, strict=True):
        history, manifest = load_history(folder)
        if not history:
            continue
        tokens, estimated = tokens_axis(history, manifest)
        name = label + (" (tokens estimated)" if estimated else "")
        k = len(history[-1]["heldout"]["agreement"])
        for step in range(k):
            ax_agree.plot(tokens, [h["heldout"]["agreement"][step] for h in history], marker=".",
                          label=f"{name}, step {step + 1}" if step in (0, k - 1) else None,
                          alpha=1.0 - 0.15 * step)
        ax_len.plot(tokens, [h["heldout"]["accept_length_k"] for h in history], marker=".", label=name)
        last = history[-1]["heldout"]
        lines.append(f"| {label} | {tokens[-1] / 1e6:.2f}M{' (est.)' if estimated else ''} | "
                     f"{', '.join(f'{a:.3f}' for a in last['agreement'])} | {last['accept_length_k']:.3f} |")
    for ax, title in ((ax_agree, "held-out top-1 agreement (steps 1..k)"),
                      (ax_len, "held-out chain accepted length (k steps)")):
        ax.set_xscale("log")
        ax.set_xlabel("tokens trained on")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out.with_suffix(".png"), dpi=110)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0

