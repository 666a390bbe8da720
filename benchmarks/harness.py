"""Side-by-side benchmark harness: named setups run on the same prompts in one run, one JSON row each.

Invariants:
- Every setup runs in its own child process with a fresh engine, one after the other, so that setups do
  not share caches or compete for the two cores; engine start-up is never inside a timed region.
- A warm-up request runs before timing; acceptance counters are read as the difference of two snapshots
  around the timed ``generate`` call.
- Ratios are taken against the setup named ``vanilla`` of the same run; output identity compares token
  ids with that setup. With ``bookend_vanilla``, vanilla also runs last (row ``vanilla-end``) and the
  ratios use the mean of the two vanilla speeds, so drift of the machine during a run shows in the two
  vanilla rows instead of in every ratio.

Row schema (``ROW_FIELDS``): later issues add setups, never new scripts or fields with other meanings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

BENCHMARKS_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCHMARKS_DIR / "results"
PROMPTS_FILE = BENCHMARKS_DIR / "prompts.json"

ROW_FIELDS = (
    "setup", "description", "target", "draft", "method", "num_speculative_tokens", "batch_size",
    "tensor_parallel_size", "dtype", "temperature", "num_prompts", "max_tokens", "output_tokens",
    "generate_seconds", "decode_seconds", "decode_tok_per_s", "speedup_vs_vanilla",
    "mean_acceptance_length", "acceptance_rate", "per_position_acceptance", "num_drafts",
    "outputs_identical_to_vanilla", "drafting_seconds_per_step", "drafting_share_of_decode",
    "engine_start_seconds",
)  # fmt: skip


@dataclass
class Setup:
    """One engine configuration to compare; ``name`` is unique within a run."""

    name: str
    description: str = ""
    speculative_config: dict[str, Any] | None = None
    additional_config: dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Workload:
    target: str
    prompts: list[str]
    max_tokens: int = 64
    batch_size: int = 1
    dtype: str = "bfloat16"
    temperature: float = 0.0
    kv_cache_gib: int = 2


def load_prompts(limit: int | None = None, kinds: tuple[str, ...] | None = None) -> list[str]:
    entries = json.loads(PROMPTS_FILE.read_text())["prompts"]
    texts = [e["text"] for e in entries if kinds is None or e["kind"] in kinds]
    if limit is not None:
        # Interleave kinds so a short run still covers chat, code and math.
        by_kind: dict[str, list[str]] = {}
        for entry in entries:
            if kinds is None or entry["kind"] in kinds:
                by_kind.setdefault(entry["kind"], []).append(entry["text"])
        texts = [t for group in zip(*by_kind.values()) for t in group][:limit]
    return texts


def engine_env(tensor_parallel_size: int) -> dict[str, str]:
    """Thread binding this 2-core machine needs: both cores for one process, one core per TP rank."""
    bind = "0-1" if tensor_parallel_size == 1 else "|".join(str(r) for r in range(tensor_parallel_size))
    return {
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "TOKENIZERS_PARALLELISM": "false",
    }


VANILLA = "vanilla"  # the baseline setup every ratio and identity check refers to
VANILLA_END = "vanilla-end"  # the same setup run again last (bookend_vanilla)


def run_setups(setups: list[Setup], workload: Workload, progress: bool = True,
               bookend_vanilla: bool = False) -> list[dict[str, Any]]:
    """Run every setup in its own process; return one row per setup with ratios against ``vanilla``."""
    names = [s.name for s in setups]
    if len(set(names)) != len(names):
        raise ValueError(f"setup names must be unique, got {names}")
    if bookend_vanilla:
        first = next((s for s in setups if s.name == VANILLA), None)
        if first is None:
            raise ValueError("bookend_vanilla needs a setup named 'vanilla'")
        setups = [*setups, replace(first, name=VANILLA_END)]
    raw: list[dict[str, Any]] = []
    bar = tqdm(setups, desc="setups", unit="setup", disable=not progress)
    for setup in bar:
        bar.set_postfix_str(setup.name)
        raw.append(_run_in_child(setup, workload))
    return finalize_rows(raw)


def finalize_rows(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    vanilla = next((r for r in raw if r["setup"] == VANILLA), None)
    speeds = [r["decode_tok_per_s"] for r in raw if r["setup"] in (VANILLA, VANILLA_END)]
    baseline = sum(speeds) / len(speeds) if speeds and all(speeds) else None
    rows = []
    for result in raw:
        row = {name: result.get(name) for name in ROW_FIELDS}
        if vanilla is not None and baseline:
            row["speedup_vs_vanilla"] = result["decode_tok_per_s"] / baseline
            row["outputs_identical_to_vanilla"] = result["token_ids"] == vanilla["token_ids"]
        rows.append(row)
    return rows


def _run_in_child(setup: Setup, workload: Workload) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="easyspec-bench-") as scratch:
        request = Path(scratch) / "request.json"
        result = Path(scratch) / "result.json"
        request.write_text(json.dumps({"setup": asdict(setup), "workload": asdict(workload)}))
        env = os.environ | engine_env(setup.tensor_parallel_size) | setup.env
        env["VLLM_CPU_KVCACHE_SPACE"] = str(workload.kv_cache_gib)
        log_path = RESULTS_DIR / "logs" / f"{os.getpid()}-{setup.name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as log:
            completed = subprocess.run(
                [sys.executable, "-m", "benchmarks.harness", "--child", str(request), str(result)],
                cwd=BENCHMARKS_DIR.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        if completed.returncode != 0:
            tail = "\n".join(log_path.read_text().splitlines()[-15:])
            raise RuntimeError(f"setup {setup.name!r} failed (exit {completed.returncode}); log {log_path}:\n{tail}")
        return json.loads(result.read_text())


def _child_main(request_path: Path, result_path: Path) -> None:
    """Runs inside the child process: build the engine, warm up, time one generate call."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_easyspec.integration.worker_extension import WORKER_EXTENSION_CLS
    from vllm_easyspec.metrics import read_spec_decode_counters
    from vllm_easyspec.models import prompt_token_ids

    request = json.loads(request_path.read_text())
    setup = Setup(**request["setup"])
    workload = Workload(**request["workload"])
    tokenizer = AutoTokenizer.from_pretrained(workload.target)
    prompt_ids = [prompt_token_ids(tokenizer, text) for text in workload.prompts]
    started = time.perf_counter()
    llm = LLM(
        model=workload.target,
        dtype=workload.dtype,
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=workload.batch_size,
        tensor_parallel_size=setup.tensor_parallel_size,
        distributed_executor_backend="mp",
        speculative_config=setup.speculative_config,
        additional_config=setup.additional_config or {},
        worker_extension_cls=WORKER_EXTENSION_CLS,
        disable_log_stats=False,
        seed=0,
    )
    engine_start = time.perf_counter() - started
    if setup.speculative_config:
        llm.collective_rpc("easyspec_time_drafter")  # drafting time for vLLM's own proposers too
    params = SamplingParams(temperature=workload.temperature, max_tokens=workload.max_tokens, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    drafting_before = _drafting_seconds_and_steps(llm)
    counters_before = read_spec_decode_counters(llm)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_seconds = time.perf_counter() - started
    counters = read_spec_decode_counters(llm) - counters_before
    drafting_after = _drafting_seconds_and_steps(llm)

    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    output_tokens = sum(len(t) for t in token_ids)
    decode_seconds = _decode_seconds(outputs) or generate_seconds
    decode_tokens = sum(max(len(t) - 1, 0) for t in token_ids)
    drafting_seconds_per_step = None
    drafting_share = None
    if drafting_before is not None and drafting_after is not None:
        seconds = drafting_after[0] - drafting_before[0]
        steps = drafting_after[1] - drafting_before[1]
        drafting_seconds_per_step = seconds / steps if steps else None
        drafting_share = seconds / generate_seconds
    spec = setup.speculative_config or {}
    result = {
        "setup": setup.name,
        "description": setup.description,
        "target": Path(workload.target).name,
        "draft": Path(spec["model"]).name if spec.get("model") else None,
        "method": spec.get("method", "none") if spec else "none",
        "num_speculative_tokens": spec.get("num_speculative_tokens"),
        "batch_size": workload.batch_size,
        "tensor_parallel_size": setup.tensor_parallel_size,
        "dtype": workload.dtype,
        "temperature": workload.temperature,
        "num_prompts": len(prompts),
        "max_tokens": workload.max_tokens,
        "output_tokens": output_tokens,
        "generate_seconds": generate_seconds,
        "decode_seconds": decode_seconds,
        "decode_tok_per_s": decode_tokens / decode_seconds if decode_seconds else None,
        "mean_acceptance_length": counters.mean_acceptance_length,
        "acceptance_rate": counters.acceptance_rate,
        "per_position_acceptance": counters.per_position_acceptance,
        "num_drafts": counters.num_drafts,
        "drafting_seconds_per_step": drafting_seconds_per_step,
        "drafting_share_of_decode": drafting_share,
        "engine_start_seconds": engine_start,
        "token_ids": token_ids,
    }
    result_path.write_text(json.dumps(result))


def _decode_seconds(outputs) -> float | None:
    """Wall time from the first request's first token to the last request's last token (engine clock)."""
    stats = [o.metrics for o in outputs if getattr(o, "metrics", None) is not None]
    if len(stats) != len(outputs):
        return None
    first = min(s.first_token_ts for s in stats)
    last = max(s.last_token_ts for s in stats)
    return last - first if last > first else None


def _drafting_seconds_and_steps(llm) -> tuple[float, int] | None:
    stats = llm.collective_rpc("easyspec_drafting_stats")
    if not stats or stats[0] is None:
        return None
    return stats[0]["drafting_seconds"], stats[0]["steps"]


# ---- reports ----


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| setup | method | k | batch | TP | decode tok/s | vs vanilla | mean acc. len | per-position acceptance "
        "| draft ms/step | draft share | identical |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [header]
    for r in rows:
        per_pos = " / ".join(f"{100 * a:.0f}%" for a in r["per_position_acceptance"] or []) or "–"
        ms = None if r["drafting_seconds_per_step"] is None else 1e3 * r["drafting_seconds_per_step"]
        share = None if r["drafting_share_of_decode"] is None else 100 * r["drafting_share_of_decode"]
        lines.append(
            f"| {r['setup']} | {r['method']} | {_fmt(r['num_speculative_tokens'])} | {r['batch_size']} "
            f"| {r['tensor_parallel_size']} | {_fmt(r['decode_tok_per_s'], '.1f')} "
            f"| {_fmt(r['speedup_vs_vanilla'])}x | {_fmt(r['mean_acceptance_length'])} | {per_pos} "
            f"| {_fmt(ms, '.1f')} | {_fmt(share, '.0f')}{'%' if share is not None else ''} "
            f"| {_fmt(r['outputs_identical_to_vanilla'])} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed_ax, accept_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["setup"] for r in rows]
    speedups = [r["speedup_vs_vanilla"] or 0.0 for r in rows]
    speed_ax.bar(names, speedups, color=["#999999" if n.startswith("vanilla") else "#3b7dd8" for n in names])
    speed_ax.axhline(1.0, color="black", linewidth=0.8)
    speed_ax.set_ylabel("decode tok/s relative to vanilla")
    speed_ax.tick_params(axis="x", rotation=30)
    for row in rows:
        per_pos = row["per_position_acceptance"] or []
        if per_pos:
            accept_ax.plot(range(1, len(per_pos) + 1), per_pos, marker="o", label=row["setup"])
    accept_ax.set_xlabel("draft position")
    accept_ax.xaxis.get_major_locator().set_params(integer=True)
    accept_ax.set_ylabel("acceptance rate (accepted / drafts)")
    accept_ax.set_ylim(0, 1)
    if accept_ax.lines:
        accept_ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(rows: list[dict[str, Any]], stem: str, title: str, command: str) -> dict[str, Path]:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    paths = {ext: RESULTS_DIR / f"{stem}.{ext}" for ext in ("json", "md", "png")}
    paths["json"].write_text(json.dumps({"title": title, "command": command, "rows": rows}, indent=2) + "\n")
    paths["md"].write_text(f"# {title}\n\nCommand: `{command}`\n\n{markdown_table(rows)}\n")
    plot(rows, paths["png"], title)
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", nargs=2, metavar=("REQUEST", "RESULT"), required=True)
    args = parser.parse_args()
    _child_main(Path(args.child[0]), Path(args.child[1]))
