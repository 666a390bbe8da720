"""Issue 60's GPU window, planned: every device call of ``benchmarks/gpu/train_head.sh``'s window in order, with
the bytes it ships and its device seconds, and the run call's phases with ESTIMATED seconds.

    python -m vllm_easyspec_train.gpu_flow prepare     # the corpus file (once; about 30 s)
    python benchmarks/gpu/train_head.py plan [--max-new-tokens 256 --epochs 2 ...]

The call costs (cold start, part calls, install, conversion, engine start) are the ones
``benchmarks/gpu/real_model.py plan`` uses (``SECONDS`` in ``benchmarks/gpu/window_plan.py``: measured with the
kit unless marked assumed there); the kit's and the target's parts are cut and listed by that planner's
functions. The flow's own rates (``FLOW_RATES``: generation, features, training on an H100/H200 with the 0.5B
bf16 target) are ESTIMATES until a GPU run measures them: a run's ``flow.json`` records the real ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu import target_parts, window_plan  # noqa: E402
from benchmarks.gpu.real_model_setups import TARGET_NAME  # noqa: E402

MiB = 1 << 20
RUN_CARRY = [".gpu/proj", ".gpu/target", ".gpu/train"]
LIMIT_S = 570  # train_head.sh's LIMIT inside the call's timeout_s of 600
FLOW_RATES = {  # ESTIMATES (assumed, not measured): tokens per second on one H100/H200, 0.5B bf16 target
    "generate": 20000.0,  # answer tokens, vLLM eager, 512 sequences at once
    "features": 150000.0,  # sequence tokens, transformers forward + greedy label
    "train": 60000.0,  # sequence tokens a second of EAGLE-3 training (4 draft steps, batch 16)
}
ANSWER_FILL = 0.83  # answer tokens / --max-new-tokens: 883,059 over 4,140 answers at 256, measured on the CPU


def corpus_tokens(corpus_file: Path, max_new_tokens: int, seq_len: int) -> dict:
    """Prompt and answer tokens the corpus file will give: prompts counted with the target's tokenizer
    (``corpus.estimate_tokens``), answers at ``ANSWER_FILL`` of ``max_new_tokens``, each sequence cut at
    ``seq_len``."""
    from vllm_easyspec_train.corpus import Corpus, _load_tokenizer, estimate_tokens

    corpus = Corpus.read_jsonl(corpus_file)
    est = estimate_tokens(corpus, _load_tokenizer(None), max_new_tokens)
    answers_per_seq = ANSWER_FILL * max_new_tokens
    n_seq = est["first_round_prompts"] + est["second_round_prompts"]
    prompt_per_seq = est["prompt_tokens"] / max(1, n_seq)
    kept_answer = max(0.0, min(answers_per_seq, seq_len - prompt_per_seq))
    return {"items": len(corpus.items), "sequences": n_seq, "prompt_tokens": est["prompt_tokens"],
            "answer_tokens": int(n_seq * answers_per_seq), "counted_with": est["counted_with"],
            "sequence_tokens": int(n_seq * (min(prompt_per_seq, seq_len) + kept_answer))}


def run_call_phases(tokens: dict, epochs: float) -> list[tuple[str, tuple[float, float]]]:
    """(phase, (low, high) seconds) of the run call; generation, features and training from ``FLOW_RATES``."""
    s = window_plan.SECONDS
    gen = tokens["answer_tokens"] / FLOW_RATES["generate"]
    feat = tokens["sequence_tokens"] / FLOW_RATES["features"]
    train = epochs * tokens["sequence_tokens"] / FLOW_RATES["train"]
    return [("install", s["install"]), ("GGUF check and conversion", s["convert"]),
            ("generation engine start (eager)", s["engine_eager"]),
            (f"generation, {tokens['answer_tokens'] / 1e6:.2f}M answer tokens (estimate)", (gen, 1.5 * gen)),
            (f"features, {tokens['sequence_tokens'] / 1e6:.2f}M tokens (estimate)", (feat, 1.5 * feat)),
            (f"training, {epochs:g} epochs (estimate)", (train, 1.5 * train)), ("packing the pieces", (5, 15))]


def plan(args: argparse.Namespace) -> int:
    corpus_file = ROOT / args.corpus
    if not corpus_file.is_file():
        print(f"no {args.corpus}: python -m vllm_easyspec_train.gpu_flow prepare", file=sys.stderr)
        return 1
    now, slim = window_plan.travel_bytes_after_slim()
    carried = sum(target_parts.folder_bytes(ROOT / c) for c in (".gpu/proj", ".gpu/train"))
    part_size = min(target_parts.PART_LIMIT, int((window_plan.CALL_LIMIT - slim - 1.5 * MiB) // MiB * MiB))
    target = target_parts.prepare(TARGET_NAME, part_size)
    kit, kit_source = window_plan.kit_parts(part_size)
    tokens = corpus_tokens(corpus_file, args.max_new_tokens, args.seq_len)
    phases = run_call_phases(tokens, args.epochs)
    run_s = (sum(p[1][0] for p in phases), sum(p[1][1] for p in phases))
    calls = [(f"carry [\"{name}\"]", f"cat {name}/* {'>' if i == 0 else '>>'} /tmp/blob && ls -l /tmp/blob", size)
             for i, (name, size, _after) in enumerate(kit)]
    calls += [(f"carry [\"{p.folder}\"]", p.command(), p.size) for p in target.parts]
    run_bytes = carried + (ROOT / ".gpu/target/manifest.json").stat().st_size
    print(f"Working tree: {now / MiB:.1f} MiB now, {slim / MiB:.1f} MiB after slim.sh (what every call ships). "
          f"Kit parts: {kit_source}. Corpus: {tokens['items']} items, {corpus_file.stat().st_size / MiB:.1f} MiB.")
    print("\nDevice calls, in order, back to back (a gap over 30 s loses the machine and /tmp):")
    for number, (carry, command, size) in enumerate(calls, 1):
        flag = "  OVER 64 MiB" if size + slim > window_plan.CALL_LIMIT else ""
        print(f"{number:>2}/{len(calls) + 1}  {carry}  command: {command}   (ships {(size + slim) / MiB:.1f} MiB; "
              f"~{window_plan.SECONDS['part_call'][0]} s){flag}")
    print(f"{len(calls) + 1:>2}/{len(calls) + 1}  carry {json.dumps(RUN_CARRY)}  timeout_s 600  command: bash "
          f"benchmarks/gpu/train_head.sh   (ships {(run_bytes + slim) / MiB:.1f} MiB; ~{run_s[0]:.0f}-{run_s[1]:.0f} s)")
    print(f"\nThe run call (LIMIT {LIMIT_S} s; every phase after the conversion has a deadline, see gpu_flow run):")
    for name, (low, high) in phases:
        print(f"  {name:52s} {low:6.0f}-{high:.0f} s")
    cold = window_plan.SECONDS["cold_start"]
    total = (cold[0] + len(calls) * window_plan.SECONDS["part_call"][0] + run_s[0],
             cold[1] + len(calls) * window_plan.SECONDS["part_call"][1] + run_s[1])
    print(f"Device seconds: ~{total[0]:.0f}-{total[1]:.0f} of the {window_plan.BUDGET_S} s window.")
    if run_s[1] > LIMIT_S:
        print(f"The run call may not fit in {LIMIT_S} s at the high estimate: the deadlines cut generation and "
              "training, and flow.json says where. Two windows instead: FLOW_ARGS=--stop-after-data in the first "
              "(the answers come back as selfdistill.jsonl.xz: commit it under heads/), then --data in the second.")
    if not (ROOT / ".gpu" / "slimmed").exists():
        print("\nBefore the first call: bash ../shared/gpu/slim.sh (and --restore before any commit).")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="print the window's device calls, bytes and estimated seconds")
    p.add_argument("--corpus", default=".gpu/train/corpus.jsonl.gz")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=1280)
    p.add_argument("--epochs", type=float, default=2.0)
    return plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
