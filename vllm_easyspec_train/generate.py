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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
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


def generate(target: str, prompts: list, out_path: str, max_tokens: int,
             temperature: float = 0.0, seed: int = 0, dtype: str = "bfloat16",
             max_num_seqs: int = 256, chunk_size: int = 64, max_model_len: int = 2048) -> dict:
    """Answer ``prompts`` greedily (by default), appending each chunk's records to ``out_path``.
    A prompt whose ids leave no room for ``max_tokens`` within ``max_model_len`` gets an empty
    answer with ``finish_reason`` "prompt_too_long" (the data stage drops it)."""
    _set_cpu_env()
    from tqdm.auto import tqdm
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, dtype=dtype, enforce_eager=True, seed=seed,
              max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    t0 = time.time()
    n_tok = n_long = 0
    bar = tqdm(total=len(prompts), desc="self-distill", unit="prompt", file=sys.stderr, mininterval=2.0,
               smoothing=0.05, dynamic_ncols=True)
    with open(out_path, "a") as f:
        for a in range(0, len(prompts), max(1, chunk_size)):
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
            bar.update(len(chunk))
            bar.set_postfix(tok_per_s=f"{n_tok / max(time.time() - t0, 1e-9):.0f}", refresh=False)
    bar.close()
    dt = time.time() - t0
    return {"n_prompts": len(prompts), "n_response_tokens": n_tok, "seconds": round(dt, 1),
            "temperature": temperature, "max_tokens": max_tokens, "dtype": dtype, "chunk_size": chunk_size,
            "n_prompt_too_long": n_long}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True, help="JSON lines, appended to")
    ap.add_argument("--prompts-json", required=True, help="JSON list of prompts: strings or chat message lists")
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk-size", type=int, default=64, help="prompts per engine call (one flush each)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    a = ap.parse_args(argv)
    with open(a.prompts_json) as f:
        prompts = json.load(f)
    info = generate(a.target, prompts, a.out, a.max_tokens, a.temperature, a.seed, a.dtype,
                    chunk_size=a.chunk_size, max_model_len=a.max_model_len)
    print("EASYSPEC_GEN_INFO " + json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
