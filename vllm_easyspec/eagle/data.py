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


def _self_distill_key(target: str, prompts: list[str], max_new_tokens: int, seed: int, dtype: str) -> str:
    return sha256_text(json.dumps([os.path.realpath(target), prompts, max_new_tokens, seed, dtype]))[:16]


def _reusable_responses(target: str, work_dir: Path, max_new_tokens: int, seed: int, dtype: str
                        ) -> tuple[dict[str, dict], list[str]]:
    """Responses already generated in ``work_dir`` with the same target and settings.

    A cache file is reusable iff its key recomputes from (target, its own prompt
    list, max_new_tokens, seed, dtype), so a prompt set can grow without
    regenerating the answers it already has.
    """
    found: dict[str, dict] = {}
    keys: list[str] = []
    for pj in sorted(work_dir.glob("prompts-*.json")):
        key = pj.stem.split("-", 1)[1]
        jl = work_dir / f"selfdistill-{key}.jsonl"
        if not jl.exists():
            continue
        try:
            old_prompts = json.loads(pj.read_text())
        except (json.JSONDecodeError, OSError):
            continue
        if _self_distill_key(target, old_prompts, max_new_tokens, seed, dtype) != key:
            continue
        keys.append(key)
        with open(jl) as f:
            for line in f:
                r = json.loads(line)
                found.setdefault(r["prompt"], r)
    return found, keys


def self_distill(target: str, prompts: list[str], work_dir: Path, max_new_tokens: int,
                 seed: int, dtype: str = "bfloat16", log=print) -> tuple[Path, dict]:
    """Generate (or reuse) the target's responses; returns (jsonl path, info).

    Prompts answered by an earlier run with the same target and settings are
    reused; only the others are generated.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    key = _self_distill_key(target, prompts, max_new_tokens, seed, dtype)
    out = work_dir / f"selfdistill-{key}.jsonl"
    info_path = out.with_suffix(".info.json")
    if out.exists() and info_path.exists():
        log(f"[eagle] reusing self-distillation data {out}")
        return out, json.loads(info_path.read_text())
    known, reused_keys = _reusable_responses(target, work_dir, max_new_tokens, seed, dtype)
    missing = list(dict.fromkeys(p for p in prompts if p not in known))
    info: dict = {"n_prompts": len(prompts), "n_reused": len(prompts) - len(missing),
                  "reused_from": reused_keys, "generated": {}}
    if missing:
        part = work_dir / f"selfdistill-{key}.part.jsonl"
        pj = work_dir / f"prompts-{key}.part.json"
        pj.write_text(json.dumps(missing))
        cmd = [sys.executable, "-m", "vllm_easyspec.eagle.generate", "--target", target, "--out", str(part),
               "--prompts-json", str(pj), "--max-tokens", str(max_new_tokens), "--seed", str(seed),
               "--dtype", dtype]
        log(f"[eagle] generating self-distillation data: {len(missing)} prompts x <= {max_new_tokens} tokens "
            f"(vLLM; {info['n_reused']} reused)")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"self-distillation generation failed:\n{proc.stderr[-4000:]}")
        for line in proc.stdout.splitlines():
            if line.startswith("EASYSPEC_GEN_INFO "):
                info["generated"] = json.loads(line.split(" ", 1)[1])
        with open(part) as f:
            for line in f:
                r = json.loads(line)
                known[r["prompt"]] = r
        part.unlink()
        pj.unlink()
    n_tok = 0
    tmp = Path(str(out) + ".tmp")
    with open(tmp, "w") as f:
        for p in prompts:
            n_tok += len(known[p]["response_ids"])
            f.write(json.dumps(known[p]) + "\n")
    info.update({"n_response_tokens": n_tok, "max_tokens": max_new_tokens, "dtype": dtype, "temperature": 0.0})
    (work_dir / f"prompts-{key}.json").write_text(json.dumps(prompts))
    os.replace(tmp, out)
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


def _split_draw(seq: dict, seed: int) -> float:
    """A uniform draw in [0, 1) fixed by the sequence's tokens and the seed."""
    h = hashlib.sha256(json.dumps([seed, seq["tokens"]]).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0 ** 64


def split_heldout(seqs: list[dict], val_fraction: float, seed: int, min_train_tokens: int
                  ) -> tuple[list[dict], list[dict]]:
    """(train, held-out), each in input order.

    A sequence is held out iff its own hash draw is below ``val_fraction``, so
    adding data never moves an existing sequence from one side to the other.
    At least one sequence lands on each side.
    """
    n_tok = sum(len(s["tokens"]) - s["loss_start"] - 1 for s in seqs)
    if len(seqs) < 2 or n_tok < min_train_tokens:
        raise NotEnoughDataError(
            f"too little training data: {len(seqs)} sequences, {n_tok} supervised tokens; need at "
            f"least 2 sequences and {min_train_tokens} tokens (add prompts, raise --max-new-tokens or "
            f"--text-tokens, or lower --min-train-tokens)")
    draws = [_split_draw(s, seed) for s in seqs]
    is_val = [d < val_fraction for d in draws]
    if not any(is_val):
        is_val[min(range(len(seqs)), key=draws.__getitem__)] = True
    if all(is_val):
        is_val[max(range(len(seqs)), key=draws.__getitem__)] = False
    train = [s for s, v in zip(seqs, is_val) if not v]
    val = [s for s, v in zip(seqs, is_val) if v]
    return train, val
