"""Training data for EAGLE heads, all of it local.

Two sources:

* ``self-distill``: the target answers the project's prompt set (``prompts.py``)
  with vLLM, greedily; the loss covers the response positions only.
* ``text``: local text files (by default the Python standard library's own
  sources), tokenized and cut into fixed-length windows; the loss covers every
  position.  Labels always come from the target itself (its next-token
  distribution), so plain text is distillation too.

A sequence is ``{"tokens": [...], "loss_start": int, "source": str}``: the loss is
taken at positions ``q >= loss_start`` (position ``q`` predicts token ``q+1``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import sysconfig
from pathlib import Path

from .errors import NotEnoughDataError


def sha256_text(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def default_text_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def self_distill(target: str, prompts: list[str], work_dir: Path, max_new_tokens: int,
                 seed: int, dtype: str = "bfloat16", log=print) -> tuple[Path, dict]:
    """Generate (or reuse) the target's responses; returns (jsonl path, info)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    key = sha256_text(json.dumps([os.path.realpath(target), prompts, max_new_tokens, seed, dtype]))[:16]
    out = work_dir / f"selfdistill-{key}.jsonl"
    info_path = out.with_suffix(".info.json")
    if out.exists() and info_path.exists():
        log(f"[eagle] reusing self-distillation data {out}")
        return out, json.loads(info_path.read_text())
    pj = work_dir / f"prompts-{key}.json"
    pj.write_text(json.dumps(prompts))
    cmd = [sys.executable, "-m", "vllm_easyspec.eagle.generate", "--target", target, "--out", str(out),
           "--prompts-json", str(pj), "--max-tokens", str(max_new_tokens), "--seed", str(seed),
           "--dtype", dtype]
    log(f"[eagle] generating self-distillation data: {len(prompts)} prompts x <= {max_new_tokens} tokens (vLLM)")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"self-distillation generation failed:\n{proc.stderr[-4000:]}")
    info = {}
    for line in proc.stdout.splitlines():
        if line.startswith("EASYSPEC_GEN_INFO "):
            info = json.loads(line.split(" ", 1)[1])
    info_path.write_text(json.dumps(info))
    return out, info


def load_self_distill(jsonl: Path, max_len: int) -> list[dict]:
    seqs = []
    with open(jsonl) as f:
        for line in f:
            r = json.loads(line)
            toks = (r["prompt_ids"] + r["response_ids"])[:max_len]
            ls = len(r["prompt_ids"]) - 1
            if len(toks) - 1 > ls and len(r["response_ids"]) > 0:
                seqs.append({"tokens": toks, "loss_start": ls, "source": "self-distill"})
    return seqs


def text_windows(tokenizer, text_dir: str, n_tokens: int, seq_len: int, seed: int,
                 suffixes=(".py",)) -> tuple[list[dict], dict]:
    """Windows of ``seq_len`` tokens from local files, ``n_tokens`` in total."""
    root = Path(text_dir)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes
                   and "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts)
    rng = random.Random(seed)
    rng.shuffle(files)
    seqs, used, total = [], [], 0
    for p in files:
        if total >= n_tokens:
            break
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 200:
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for i in range(0, max(0, len(ids) - seq_len // 4), seq_len):
            w = ids[i:i + seq_len]
            if len(w) < 32 or total >= n_tokens:
                break
            seqs.append({"tokens": w, "loss_start": 0, "source": f"text:{p.relative_to(root)}"})
            total += len(w)
        used.append(str(p.relative_to(root)))
    info = {"dir": str(root), "files_used": len(used), "tokens": total,
            "files_sha256": sha256_text("\n".join(used)), "seq_len": seq_len}
    return seqs, info


def split_heldout(seqs: list[dict], val_fraction: float, seed: int, min_train_tokens: int
                  ) -> tuple[list[dict], list[dict]]:
    n_tok = sum(len(s["tokens"]) - s["loss_start"] - 1 for s in seqs)
    if len(seqs) < 2 or n_tok < min_train_tokens:
        raise NotEnoughDataError(
            f"too little training data: {len(seqs)} sequences, {n_tok} supervised tokens; need at "
            f"least 2 sequences and {min_train_tokens} tokens (add prompts, raise --max-new-tokens or "
            f"--text-tokens, or lower --min-train-tokens)")
    idx = list(range(len(seqs)))
    random.Random(seed).shuffle(idx)
    n_val = max(1, int(round(len(seqs) * val_fraction)))
    val = [seqs[i] for i in sorted(idx[:n_val])]
    train = [seqs[i] for i in sorted(idx[n_val:])]
    return train, val
