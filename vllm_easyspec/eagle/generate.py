"""Self-distillation data: the target answers the project's prompt set with vLLM.

Run as a subprocess (``python -m vllm_easyspec.eagle.generate``) so that the vLLM
engine's memory and worker processes are gone before feature extraction starts.
Writes one JSON object per line: ``prompt``, ``prompt_ids``, ``response_ids``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from vllm_easyspec.models import prompt_token_ids


def _set_cpu_env() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def generate(target: str, prompts: list[str], out_path: str, max_tokens: int,
             temperature: float = 0.0, seed: int = 0, dtype: str = "bfloat16",
             max_num_seqs: int = 256) -> dict:
    _set_cpu_env()
    from vllm import LLM, SamplingParams

    llm = LLM(model=target, dtype=dtype, enforce_eager=True, seed=seed,
              max_model_len=2048, max_num_seqs=max_num_seqs)
    tok = llm.get_tokenizer()
    prompt_ids = [prompt_token_ids(tok, p) for p in prompts]
    sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    t0 = time.time()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], sp)
    dt = time.time() - t0
    n_tok = 0
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        for p, ids, o in zip(prompts, prompt_ids, outs):
            resp = list(o.outputs[0].token_ids)
            n_tok += len(resp)
            f.write(json.dumps({"prompt": p, "prompt_ids": ids, "response_ids": resp}) + "\n")
    os.replace(tmp, out_path)
    return {"n_prompts": len(prompts), "n_response_tokens": n_tok, "seconds": round(dt, 1),
            "temperature": temperature, "max_tokens": max_tokens, "dtype": dtype}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts-json", required=True, help="JSON list of prompt strings")
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args(argv)
    with open(a.prompts_json) as f:
        prompts = json.load(f)
    info = generate(a.target, prompts, a.out, a.max_tokens, a.temperature, a.seed, a.dtype)
    print("EASYSPEC_GEN_INFO " + json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
