"""Self-distillation data: the target answers a prompt set with vLLM.

Run as a subprocess (``python -m vllm_easyspec_train.generate``) so that the vLLM
engine's memory and worker processes are gone before feature extraction starts.
A prompt is a plain user text or a list of chat messages; both go through the
target's chat template.  APPENDS one JSON object per answered prompt to ``--out``
(``prompt``, ``prompt_ids``, ``response_ids``, ``response_text``, ``finish_reason``),
``--chunk-size`` prompts at a time, flushed and synced after each chunk, so an
interrupted run loses at most the chunk in flight.  A tqdm bar on stderr shows the
prompts done, the rate and the time left.  The last stdout line is
``EASYSPEC_GEN_INFO {json}``.

``--items-jsonl`` answers a corpus file (``corpus.Corpus.write_jsonl``) in its two rounds with
one engine: every item's first conversation, then each follow-up after the target's own first
answer (the prompts ``data.self_distill_items`` builds), so the data stage later finds every
answer in the part file.  ``--deadline`` (a ``time.time()`` value) stops starting new chunks
once it has passed; what was answered is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from vllm_easyspec.models import prompt_token_ids


def _set_cpu_env() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def render_prompt_ids(tok: Any, prompt: str | list[dict[str, str]]) -> list[int]:
    """Token ids of a prompt with the generation prompt appended.  A plain text is one user
    turn (``prompt_token_ids``, exactly as before chat prompts existed); a message list goes
    through the chat template as it is, so a one-user-message list equals its text.  Without a
    chat template the messages are written as ``Role: content`` lines."""
    if isinstance(prompt, str):
        return prompt_token_ids(tok, prompt)
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    else:
        ids = tok("".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in prompt) + "Assistant:")
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def open_engine(target: str, dtype: str = "bfloat16", seed: int = 0, max_model_len: int = 2048,
                max_num_seqs: int = 256, cuda_graphs: bool = False, gpu_memory_utilization: float | None = None):
    """A vLLM engine for the target: eager unless ``cuda_graphs``; ``gpu_memory_utilization`` only when
    given (vLLM's default otherwise)."""
    _set_cpu_env()
    from vllm import LLM

    kwargs: dict[str, Any] = {"model": target, "dtype": dtype, "enforce_eager": not cuda_graphs, "seed": seed,
                              "max_model_len": max_model_len, "max_num_seqs": max_num_seqs}
    if gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    return LLM(**kwargs)


def answer_prompts(llm, prompts: list, out_path: str, max_tokens: int, temperature: float = 0.0, seed: int = 0,
                   chunk_size: int = 64, max_model_len: int = 2048, deadline: float | None = None,
                   desc: str = "self-distill") -> dict:
    """Answer ``prompts`` with ``llm`` (greedily by default), appending each chunk's records to ``out_path``.
    A prompt whose ids leave no room for ``max_tokens`` within ``max_model_len`` gets an empty answer with
    ``finish_reason`` "prompt_too_long" (the data stage drops it).  No chunk starts after ``deadline``."""
    from tqdm.auto import tqdm
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    t0 = time.time()
    n_tok = n_long = n_done = 0
    stopped = False
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", file=sys.stderr, mininterval=2.0, disable=None,
               smoothing=0.05, dynamic_ncols=True)
    with open(out_path, "a") as f:
        for a in range(0, len(prompts), max(1, chunk_size)):
            if deadline is not None and time.time() >= deadline:
                stopped = True
                break
            chunk = prompts[a:a + max(1, chunk_size)]
            ids = [render_prompt_ids(tok, p) for p in chunk]
            fits = [len(x) + max_tokens <= max_model_len for x in ids]
            run = [{"prompt_token_ids": x} for x, ok in zip(ids, fits) if ok]
            outs = iter(llm.generate(run, sp, use_tqdm=False) if run else [])
            lines = []
            for p, x, ok in zip(chunk, ids, fits):
                if ok:
                    o = next(outs).outputs[0]
                    resp, text, why = list(o.token_ids), o.text, o.finish_reason
                else:
                    resp, text, why = [], "", "prompt_too_long"
                    n_long += 1
                n_tok += len(resp)
                lines.append(json.dumps({"prompt": p, "prompt_ids": x, "response_ids": resp, "response_text": text,
                                         "finish_reason": why}) + "\n")
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
            n_done += len(chunk)
            bar.update(len(chunk))
            bar.set_postfix(tok_per_s=f"{n_tok / max(time.time() - t0, 1e-9):.0f}", refresh=False)
    bar.close()
    dt = time.time() - t0
    return {"n_prompts": len(prompts), "n_answered": n_done, "n_response_tokens": n_tok, "seconds": round(dt, 1),
            "response_tokens_per_second": round(n_tok / max(dt, 1e-9), 1), "temperature": temperature,
            "max_tokens": max_tokens, "chunk_size": chunk_size, "n_prompt_too_long": n_long,
            "stopped_at_deadline": stopped}


def generate(target: str, prompts: list, out_path: str, max_tokens: int,
             temperature: float = 0.0, seed: int = 0, dtype: str = "bfloat16",
             max_num_seqs: int = 256, chunk_size: int = 64, max_model_len: int = 2048) -> dict:
    """Answer ``prompts`` with a fresh eager engine (``answer_prompts``)."""
    llm = open_engine(target, dtype, seed, max_model_len, max_num_seqs)
    info = answer_prompts(llm, prompts, out_path, max_tokens, temperature, seed, chunk_size, max_model_len)
    return {**info, "dtype": dtype}


def answer_corpus_items(llm, items: list, out_path: str, max_tokens: int, seed: int = 0, chunk_size: int = 64,
                        max_model_len: int = 2048, deadline: float | None = None) -> dict:
    """Both self-distillation rounds of corpus ``items`` with one engine, appending to ``out_path`` (a part
    file of ``data.self_distill``): first every first-round prompt not answered there yet, then the
    follow-ups whose first answer exists and is not empty.  With a ``deadline``, the first round stops early
    enough to leave the follow-ups their share of the time left."""
    from .data import prompt_key, read_part

    start = time.time()
    done = read_part(Path(out_path))
    firsts = list({prompt_key(p): p for p in (it.first_round_prompt() for it in items)}.values())
    todo1 = [p for p in firsts if prompt_key(p) not in done]
    n_follow = sum(it.followup is not None for it in items)
    first_deadline = None
    if deadline is not None:
        share = n_follow / max(1, len(todo1) + n_follow)
        first_deadline = deadline - (deadline - start) * share
    info1 = answer_prompts(llm, todo1, out_path, max_tokens, 0.0, seed, chunk_size, max_model_len,
                           first_deadline, desc="round 1")
    done = read_part(Path(out_path))
    second: dict[str, list] = {}
    for it in items:
        r = done.get(prompt_key(it.first_round_prompt())) if it.followup is not None else None
        if r is not None and r["response_ids"]:
            conv = it.second_round(r["response_text"])
            second.setdefault(prompt_key(conv), conv)
    todo2 = [p for k, p in second.items() if k not in done]
    info2 = answer_prompts(llm, todo2, out_path, max_tokens, 0.0, seed, chunk_size, max_model_len, deadline,
                           desc="round 2")
    seconds = time.time() - start
    n_tok = info1["n_response_tokens"] + info2["n_response_tokens"]
    return {"round1": info1, "round2": info2, "n_items": len(items), "n_response_tokens": n_tok,
            "seconds": round(seconds, 1), "response_tokens_per_second": round(n_tok / max(seconds, 1e-9), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_easyspec_train.generate")
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True, help="JSON lines, appended to")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts-json", help="JSON list of prompts: strings or chat message lists")
    src.add_argument("--items-jsonl", help="a corpus file (corpus.py --out): both rounds of its items")
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk-size", type=int, default=64, help="prompts per engine call (one flush each)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="sequences the engine runs at once")
    ap.add_argument("--cuda-graphs", action="store_true", help="capture CUDA graphs (default: eager)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--deadline", type=float, default=None, help="time.time() after which no chunk starts")
    a = ap.parse_args(argv)
    llm = open_engine(a.target, a.dtype, a.seed, a.max_model_len, a.max_num_seqs, a.cuda_graphs,
                      a.gpu_memory_utilization)
    if a.items_jsonl:
        from .corpus import Corpus

        items = Corpus.read_jsonl(a.items_jsonl).items
        info = answer_corpus_items(llm, items, a.out, a.max_tokens, a.seed, a.chunk_size, a.max_model_len,
                                   a.deadline)
    else:
        with open(a.prompts_json) as f:
            prompts = json.load(f)
        info = answer_prompts(llm, prompts, a.out, a.max_tokens, a.temperature, a.seed, a.chunk_size,
                              a.max_model_len, a.deadline)
    print("EASYSPEC_GEN_INFO " + json.dumps({**info, "dtype": a.dtype}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
