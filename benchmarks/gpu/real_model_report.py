"""The report of ``real_model.py run``: per cell, the rows the harness aggregates (median, min, max, ratios to
vanilla's median), each with its engine's facts and its step-timed pass; every run; and the markdown table."""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict
from typing import Any

from benchmarks.gpu.engines import T0
from benchmarks.gpu.real_model_setups import TARGET_NAME, RunSettings


def build_report(results: list[dict[str, Any]], settings: RunSettings, cells: list[dict[str, Any]],
                 args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.harness.aggregate import finalize_rows
    from benchmarks.harness.setups import MATRIX_SPEED

    order = [r["setup"] for r in results]
    by_setup = {r["setup"]: r for r in results}
    vanilla_tokens = {}
    rows_by_cell: dict[str, list[dict[str, Any]]] = {}
    for cell in cells:
        runs = [run for r in results for run in r.get("runs", []) if run["cell"] == cell["name"]]
        rows = finalize_rows(runs, order=order, speed=MATRIX_SPEED) if runs else []
        timed = {run["setup"]: run for r in results for run in r.get("timed_runs", []) if run["cell"] == cell["name"]}
        for row in rows:
            for key in () if settings.identity else ("identity", "outputs_identical_to_vanilla", "divergences"):
                row.pop(key, None)  # without --identity no reference logits: not a lossless check (issue 59 item 3)
            first = next(run for run in runs if run["setup"] == row["setup"])
            if row["setup"] == "vanilla":
                vanilla_tokens[cell["name"]] = first["token_ids"]
            ref = vanilla_tokens.get(cell["name"])
            row["prompts_same_as_vanilla"] = (
                None if ref is None else f"{sum(a == b for a, b in zip(first['token_ids'], ref))}/{len(ref)}")
            row["cell"] = cell["name"]
            facts = by_setup[row["setup"]].get("facts", {})
            row["cudagraph_mode"] = facts.get("cudagraph_mode")
            row["model_runner"] = facts.get("model_runner")
            row["others_starting"] = by_setup[row["setup"]].get("others_starting")
            step = timed.get(row["setup"])
            row["timed_pass"] = None if step is None else {
                "tok_per_s": step["throughput_tok_per_s"],
                "decode_step_ms": _decode_step_ms(step),
                "drafting_ms_per_decode_step": None if step.get("drafting_seconds_per_decode_step") is None
                else 1e3 * step["drafting_seconds_per_decode_step"],
                "decode_steps": step.get("decode_steps"),
            }
        rows_by_cell[cell["name"]] = rows
    engines = [{k: v for k, v in r.items() if k not in ("runs", "timed_runs", "profiles")} for r in results]
    runs = [{k: v for k, v in run.items() if k != "token_ids"} | {"timed_pass": kind == "timed_runs"}
            for r in results for kind in ("runs", "timed_runs") for run in r.get(kind, [])]
    profiles = [p | {"setup": r["setup"]} for r in results for p in r.get("profiles", [])]
    report = {"issue": 59, "window": settings.window, "settings": asdict(settings), "target": args.target,
              "head": args.head, "project": args.project, "command": " ".join(sys.argv), "seconds": time.time() - T0,
              "engines": engines, "rows": rows_by_cell, "runs": runs, "profiles": profiles}
    report["markdown"] = markdown(report)
    return report


def _decode_step_ms(run: dict[str, Any]) -> float | None:
    verify, drafting = run.get("verify_seconds_per_decode_step"), run.get("drafting_seconds_per_decode_step")
    if verify is None:
        return None
    return 1e3 * (verify + (drafting or 0.0))


def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:{spec}}{suffix}"


def markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    device = next((e["facts"]["device"] for e in report["engines"] if e.get("facts")), settings["device"])
    run = "the lossless run (tokens against vanilla's, differences by vanilla's logit margin)" \
        if settings["identity"] else f"window {report['window']}"
    lines = [
        f"# Issue 59, {run}: {TARGET_NAME} ({settings['dtype']}) + the committed EAGLE-3 head on {device}",
        "",
        f"Greedy, {settings['max_tokens']} new tokens, {settings['repeats']} repeats per cell inside each engine "
        f"(median [min–max]); batch 1 serves {settings['prompts_at_batch_1']} prompts one after another, batch B "
        f"serves B prompts at once. tok/s = output tokens / timed call. ms/step = one decode step (verify + "
        "drafting) from a further pass with the step timers on, which synchronise the GPU each step (its own "
        "tok/s is in the JSON). The CUDA-graph mode is the one each engine's worker reports after start-up.",
        f"Project {report['project']}; {report['seconds']:.0f} s; command: `{report['command']}`.",
        "",
        "| setup | prompts | batch | tok/s | × vanilla | mean AL | ms/step | drafting ms | same tokens as vanilla "
        "| identity | CUDA graphs | runner |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell_rows in report["rows"].values():
        for row in cell_rows:
            speed = row.get("throughput_tok_per_s")
            tok = (f"{_fmt(speed)} [{_fmt(row.get('throughput_tok_per_s_min'))}–"
                   f"{_fmt(row.get('throughput_tok_per_s_max'))}]") if speed else "–"
            ratio = (f"{_fmt(row.get('speedup_vs_vanilla'), '.2f')} [{_fmt(row.get('speedup_min'), '.2f')}–"
                     f"{_fmt(row.get('speedup_max'), '.2f')}]") if row.get("speedup_vs_vanilla") else "–"
            timed = row.get("timed_pass") or {}
            runner = (row.get("model_runner") or "–").rsplit(".", 2)
            runner_name = ".".join(runner[-2:]) if len(runner) > 1 else runner[0]
            note = f" (others starting: {', '.join(row['others_starting'])})" if row.get("others_starting") else ""
            lines.append(
                f"| {row['setup']}{note} | {row['cell'].rsplit('-b', 1)[0]} | {row['batch_size']} | {tok} | {ratio} "
                f"| {_fmt(row.get('mean_acceptance_length'), '.2f')} | {_fmt(timed.get('decode_step_ms'), '.2f')} "
                f"| {_fmt(timed.get('drafting_ms_per_decode_step'), '.2f')} "
                f"| {row.get('prompts_same_as_vanilla') or '–'} | {row.get('identity') or '–'} "
                f"| {row.get('cudagraph_mode') or '–'} | {runner_name} |")
    failed = [e for e in report["engines"] if not e.get("ok")]
    if failed:
        lines += ["", "Not measured:"]
        for engine in failed:
            lines.append(f"- {engine['setup']}: {engine.get('error') or engine.get('start_failed')}")
    kinds = ("cut_short", "timed_pass_cut_short", "timed_pass_error", "profile_cut_short", "profile_error")
    for engine in [e for e in report["engines"] if any(e.get(k) for k in kinds)]:
        lines.append(f"- {engine['setup']}: " + "; ".join(str(engine[k]) for k in kinds if engine.get(k)))
    lines += _profile_lines(report["profiles"])
    starts = ", ".join(f"{e['setup']} {e['engine_start_seconds']:.0f} s" for e in report["engines"]
                       if e.get("engine_start_seconds"))
    if starts:
        lines += ["", f"Engine start-up: {starts}."]
    return "\n".join(lines)


def _profile_lines(profiles: list[dict[str, Any]]) -> list[str]:
    """The ``--profile`` pass per setup and cell: ms per decode step by runner scope (host / GPU), kernels by kind,
    and the host gap (step_profile.py)."""
    if not profiles:
        return []
    lines = ["", "Profiled pass, ms per step (scope host/GPU; kernels; host gap = wall with no kernel running):", ""]
    for p in profiles:
        scopes = ", ".join(f"{name} {s['host_ms']:.2f}/{s['gpu_ms']:.2f}" for name, s in p["scopes_per_step"].items())
        kernels = ", ".join(f"{kind} {ms:.2f}" for kind, ms in p["kernels_gpu_ms_per_step"].items())
        lines.append(f"- {p['setup']} {p['cell']}: {p['steps']} steps, {p['wall_ms_per_step']:.2f} wall; {scopes}; "
                     f"kernels {kernels}; host gap {p['host_gap_ms_per_step']:.2f}")
    return lines
