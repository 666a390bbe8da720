"""Training data for EAGLE heads, all of it local.

Two sources:

* ``self-distill``: the target answers a prompt set with vLLM, greedily; the loss
  covers the response positions only.  The prompt set is the project's 712 coding
  prompts (``prompts.py``, plain texts) or the broad corpus (``corpus.py``: chat
  items, follow-ups answered in a second round after the target's own first
  answer; ``self_distill_items``).  Generation is resumable: finished answers are
  appended to a part file in the work dir as they come, and a rerun asks only for
  the missing ones.
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
from collections.abc import Callable, Sequence
from pathlib import Path

from .errors import NotEnoughDataError


def sha256_text(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def default_text_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


Prompt = str | list[dict[str, str]]
"""A prompt for self-distillation: a plain user text (one user turn through the chat template)
or a list of chat messages (``{"role", "content"}``), e.g. a follow-up's second round."""

GenerateFn = Callable[[str, list, Path, int, int, str, int], dict]
"""``(target, prompts, part_path, max_new_tokens, seed, dtype, chunk_size) -> info``: answers
``prompts`` and APPENDS one JSON line per answered prompt to ``part_path`` (``prompt``,
``prompt_ids``, ``response_ids``, optionally ``response_text``), flushing at least every
``chunk_size`` prompts.  It may stop early (crash, interruption): what it wrote is kept and a
later call is asked only for the rest."""


def prompt_key(p: Prompt) -> str:
    """The identity of a prompt in caches: the text itself for a plain prompt (as before chat
    prompts existed), else a NUL-prefixed JSON of the messages (never equal to a text)."""
    return p if isinstance(p, str) else "\0chat" + json.dumps(p, sort_keys=True, ensure_ascii=False)


def _self_distill_key(target: str, prompts: list[Prompt], max_new_tokens: int, seed: int, dtype: str) -> str:
    return sha256_text(json.dumps([os.path.realpath(target), prompts, max_new_tokens, seed, dtype]))[:16]


def _settings_key(target: str, max_new_tokens: int, seed: int, dtype: str) -> str:
    return sha256_text(json.dumps([os.path.realpath(target), max_new_tokens, seed, dtype]))[:16]


def part_path(work_dir: Path, target: str, max_new_tokens: int, seed: int, dtype: str) -> Path:
    """The part file ``self_distill`` appends answers to for this target and these settings (whatever the
    prompts): a generator that writes here first (``generate.answer_corpus_items``) leaves the data stage
    nothing to generate."""
    return Path(work_dir) / f"selfdistill-part-{_settings_key(target, max_new_tokens, seed, dtype)}.part.jsonl"


def _reusable_responses(target: str, work_dir: Path, max_new_tokens: int, seed: int, dtype: str
                        ) -> tuple[dict[str, dict], list[str]]:
    """Responses already generated in ``work_dir`` with the same target and settings, by prompt key.

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
                found.setdefault(prompt_key(r["prompt"]), r)
    return found, keys


def read_part(part: Path) -> dict[str, dict]:
    """The complete records of a part file, by prompt key, and the file rewritten to hold only
    them (a line cut short by an interruption is dropped, so appending can go on safely)."""
    if not part.exists():
        return {}
    good: dict[str, dict] = {}
    lines: list[str] = []
    with open(part) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(r, dict) or not {"prompt", "prompt_ids", "response_ids"} <= r.keys():
                continue
            good[prompt_key(r["prompt"])] = r
            lines.append(line)
    tmp = Path(str(part) + ".tmp")
    tmp.write_text("".join(lines))
    os.replace(tmp, part)
    return good


def generate_subprocess(target: str, prompts: list[Prompt], part: Path, max_new_tokens: int, seed: int,
                        dtype: str, chunk_size: int = 64) -> dict:
    """The default ``GenerateFn``: ``python -m vllm_easyspec_train.generate`` in a subprocess (so
    that vLLM's memory and workers are gone afterwards).  Its stderr (the tqdm bar with the time
    left, warnings, tracebacks) goes straight to ours; its stdout (vLLM's log) is shown only on
    failure."""
    pj = part.with_name(part.name.replace(".part.jsonl", ".pending.json"))
    pj.write_text(json.dumps(prompts))
    cmd = [sys.executable, "-m", "vllm_easyspec_train.generate", "--target", target, "--out", str(part),
           "--prompts-json", str(pj), "--max-tokens", str(max_new_tokens), "--seed", str(seed),
           "--dtype", dtype, "--chunk-size", str(chunk_size)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    pj.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise RuntimeError(f"self-distillation generation failed (exit status {proc.returncode}; the answers "
                           f"finished so far are kept in {part} and a rerun resumes from them):\n"
                           f"{(proc.stdout or '')[-4000:]}")
    for line in (proc.stdout or "").splitlines():
        if line.startswith("EASYSPEC_GEN_INFO "):
            return json.loads(line.split(" ", 1)[1])
    return {}


def self_distill(target: str, prompts: list[Prompt], work_dir: Path, max_new_tokens: int,
                 seed: int, dtype: str = "bfloat16", log=print, generate_fn: GenerateFn | None = None,
                 chunk_size: int = 64) -> tuple[Path, dict]:
    """Generate (or reuse) the target's responses; returns (jsonl path, info).

    ``prompts`` are plain texts or chat message lists (``Prompt``).  Prompts answered by an
    earlier run with the same target and settings are reused; only the others are generated.
    Generation appends every finished answer to ``selfdistill-part-<settings>.jsonl`` (one
    part file per target and settings, whatever the prompt list), so an interrupted run,
    restarted with these or other prompts, generates only what is still missing.  For a list
    of plain texts the cache key (and file names) are those of earlier versions.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    key = _self_distill_key(target, prompts, max_new_tokens, seed, dtype)
    out = work_dir / f"selfdistill-{key}.jsonl"
    info_path = out.with_suffix(".info.json")
    if out.exists() and info_path.exists():
        log(f"[eagle] reusing self-distillation data {out}")
        return out, json.loads(info_path.read_text())
    known, reused_keys = _reusable_responses(target, work_dir, max_new_tokens, seed, dtype)
    part = part_path(work_dir, target, max_new_tokens, seed, dtype)
    partial = read_part(part)
    wanted = {prompt_key(p) for p in prompts}
    n_resumed = sum(1 for k in wanted if k in partial and k not in known)
    for k, r in partial.items():
        known.setdefault(k, r)
    missing = list({prompt_key(p): p for p in prompts if prompt_key(p) not in known}.values())
    info: dict = {"n_prompts": len(prompts), "n_reused": len(wanted) - len(missing) - n_resumed,
                  "n_resumed": n_resumed, "reused_from": reused_keys, "generated": {}}
    if missing:
        log(f"[eagle] generating self-distillation data: {len(missing)} prompts x <= {max_new_tokens} tokens "
            f"(vLLM; {info['n_reused']} reused, {n_resumed} resumed from {part.name})")
        info["generated"] = (generate_fn or generate_subprocess)(target, missing, part, max_new_tokens, seed,
                                                                 dtype, chunk_size)
        for k, r in read_part(part).items():
            known.setdefault(k, r)
        still = [p for p in missing if prompt_key(p) not in known]
        if still:
            raise RuntimeError(f"self-distillation generation stopped with {len(still)} of {len(missing)} prompts "
                               f"unanswered; rerun to resume from {part}")
    n_tok = 0
    tmp = Path(str(out) + ".tmp")
    with open(tmp, "w") as f:
        for p in prompts:
            r = known[prompt_key(p)]
            n_tok += len(r["response_ids"])
            f.write(json.dumps(r) + "\n")
    info.update({"n_response_tokens": n_tok, "max_tokens": max_new_tokens, "dtype": dtype, "temperature": 0.0})
    (work_dir / f"prompts-{key}.json").write_text(json.dumps(prompts))
    os.replace(tmp, out)
    info_path.write_text(json.dumps(info))
    if part.exists():  # what this run consumed now lives in ``out``; keep only other prompts' answers
        rest = [json.dumps(r) + "\n" for k, r in read_part(part).items() if k not in wanted]
        if rest:
            Path(str(part) + ".tmp").write_text("".join(rest))
            os.replace(Path(str(part) + ".tmp"), part)
        else:
            part.unlink()
    return out, info


def _answer_text(r: dict, target: str, tok_cache: dict) -> str:
    """The text of a generated answer (records from before chat prompts existed hold only ids)."""
    if "response_text" in r:
        return r["response_text"]
    if "tok" not in tok_cache:
        from transformers import AutoTokenizer

        tok_cache["tok"] = AutoTokenizer.from_pretrained(target)
    return tok_cache["tok"].decode(r["response_ids"], skip_special_tokens=True)


def self_distill_items(target: str, items: Sequence, work_dir: Path, max_new_tokens: int, seed: int,
                       dtype: str = "bfloat16", log=print, generate_fn: GenerateFn | None = None,
                       chunk_size: int = 64) -> tuple[Path, dict]:
    """Self-distillation over corpus items (``corpus.CorpusItem``) in two rounds.

    Round 1 answers every item's first conversation (identical prompts once).  Round 2
    exists only for follow-up items: their messages, then the target's OWN round-1 answer as
    the assistant turn, then the follow-up question; it is built only after round 1's answers
    exist, so no assistant turn is ever written by hand.  A follow-up whose first answer is
    empty (e.g. a prompt too long for the generator) has no second round.  Each round is a
    ``self_distill`` call (cached and resumable).  Returns a JSONL with round 1's records,
    then round 2's, and the info of both rounds.
    """
    first = list({prompt_key(p): p for p in (it.first_round_prompt() for it in items)}.values())
    log(f"[eagle] self-distillation round 1: {len(first)} prompts")
    jl1, info1 = self_distill(target, first, work_dir, max_new_tokens, seed, dtype, log, generate_fn, chunk_size)
    answers: dict[str, dict] = {}
    with open(jl1) as f:
        for line in f:
            r = json.loads(line)
            answers[prompt_key(r["prompt"])] = r
    second: list[Prompt] = []
    tok_cache: dict = {}
    n_no_answer = 0
    for it in items:
        if it.followup is None:
            continue
        r = answers[prompt_key(it.first_round_prompt())]
        if not r["response_ids"]:
            n_no_answer += 1
            continue
        second.append(it.second_round(_answer_text(r, target, tok_cache)))
    second = list({prompt_key(p): p for p in second}.values())
    paths = [jl1]
    info: dict = {"round1": info1, "round2": None, "n_items": len(items),
                  "n_followups_without_first_answer": n_no_answer}
    if second:
        log(f"[eagle] self-distillation round 2 (follow-ups after the target's own answers): {len(second)} prompts")
        jl2, info2 = self_distill(target, second, work_dir, max_new_tokens, seed, dtype, log, generate_fn,
                                  chunk_size)
        paths.append(jl2)
        info["round2"] = info2
    out = work_dir / f"selfdistill-items-{sha256_text(' '.join(p.name for p in paths))[:16]}.jsonl"
    tmp = Path(str(out) + ".tmp")
    with open(tmp, "w") as f:
        for p in paths:
            with open(p) as src:
                for line in src:
                    f.write(line)
    os.replace(tmp, out)
    info["n_response_tokens"] = info1["n_response_tokens"] + (info["round2"] or {}).get("n_response_tokens", 0)
    return out, info


def answered_items(items: Sequence, records: dict[str, dict]) -> list[int]:
    """Positions of the corpus ``items`` whose self-distillation is complete in ``records`` (by prompt key):
    the first round answered and, for a follow-up whose first answer is not empty, the second round too
    (the prompt ``self_distill_items`` builds from that answer)."""
    keep = []
    for i, it in enumerate(items):
        r = records.get(prompt_key(it.first_round_prompt()))
        if r is None:
            continue
        if it.followup is not None and r["response_ids"]:
            if prompt_key(it.second_round(_answer_text(r, "", {}))) not in records:
                continue
        keep.append(i)
    return keep


def load_self_distill(jsonl: Path, max_len: int, stats: dict | None = None) -> list[dict]:
    """Sequences (prompt + answer, cut at ``max_len`` tokens; the loss starts at the answer).
    A record whose answer is empty or entirely past ``max_len`` gives none; ``stats`` (if given)
    receives the counts of records read and dropped."""
    seqs = []
    n = 0
    with open(jsonl) as f:
        for line in f:
            n += 1
            r = json.loads(line)
            toks = (r["prompt_ids"] + r["response_ids"])[:max_len]
            ls = len(r["prompt_ids"]) - 1
            if len(toks) - 1 > ls and len(r["response_ids"]) > 0:
                seqs.append({"tokens": toks, "loss_start": ls, "source": "self-distill"})
    if stats is not None:
        stats.update({"records": n, "dropped": n - len(seqs)})
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
