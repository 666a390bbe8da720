"""Models the GPU kit does not build, made on the device from the kit's tiny float32 Qwen2 target:

- ``eagle3_head``: an EAGLE-3 head trained with the plugin's own trainer (CPU, a minute at most) on the text
  the target's tokenizer was trained on, so that EAGLE trees run on a GPU with real acceptance;
- ``small_draft``: the target's first two layers plus 10% noise, a draft a third of the target's cost, so that
  ``auto`` has a reason to verify trees rather than one node.

Run after the kit built its models (``engine_check.py --build-only``); writes next to them and is a no-op when
they exist. Usage: ``python3 -P benchmarks/gpu/extra_models.py [--models DIR] [--steps N]``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def build_small_draft(target: Path, out: Path, layers: int = 2, noise: float = 0.1) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if hasattr(model.config, "layer_types") and model.config.layer_types:
        model.config.layer_types = model.config.layer_types[:layers]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * p.std() * noise)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(target).save_pretrained(out)


def train_eagle3_head(target: Path, out: Path, work: Path, steps: int) -> None:
    """The plugin's trainer through its own command line (``vllm-easyspec train-eagle``)."""
    import torch

    from vllm_easyspec_train.trainer import main as train_eagle

    text_dir = work / "text"
    text_dir.mkdir(parents=True, exist_ok=True)
    lines = [ln for ln in open(torch.__file__.replace("__init__.py", "functional.py")).read().splitlines()
             if ln.strip()]
    chunk = max(1, len(lines) // 16)
    for i in range(16):
        (text_dir / f"part{i:02d}.py").write_text("\n".join(lines[i * chunk:(i + 1) * chunk]))
    argv = ["--target", str(target), "--out", str(out), "--format", "eagle3", "--work-dir", str(work / "w"),
            "--no-self-distill", "--text-dir", str(text_dir), "--text-tokens", "40000", "--seq-len", "128",
            "--max-steps", str(steps), "--eval-every", str(steps), "--save-every", str(steps),
            "--eval-steps", "3", "--batch-size", "8", "--amp", "none", "--lr", "3e-3",
            "--draft-vocab-size", "1024", "--feature-dtype", "float32",
            "--threads", str(min(8, os.cpu_count() or 2)), "--quiet"]
    if train_eagle(argv) != 0:
        raise SystemExit("training the EAGLE-3 head failed (its error is above)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=os.environ.get("ENGINE_MODELS", "/tmp/easyspec-engine-models"))
    ap.add_argument("--steps", type=int, default=120)
    a = ap.parse_args()
    root = Path(a.models)
    target = root / "target"
    if not (target / "config.json").exists():
        raise SystemExit(f"{target} is missing: run the kit's engine_check.py --build-only first")
    t = time.time()
    if not (root / "small_draft" / "config.json").exists():
        build_small_draft(target, root / "small_draft")
    print(f"small_draft ready ({time.time() - t:.1f}s)", flush=True)
    t = time.time()
    if not (root / "eagle3_head" / "config.json").exists():
        train_eagle3_head(target, root / "eagle3_head", root / "eagle3_work", a.steps)
    print(f"eagle3_head ready ({time.time() - t:.1f}s)", flush=True)


if __name__ == "__main__":
    main()
