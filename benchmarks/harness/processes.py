"""The parent side of a run: every setup's runs in engine child processes, in interleaved order, aggregated
into rows (the invariants are in the package docstring)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.harness.aggregate import finalize_rows
from benchmarks.harness.identity import report_identity
from benchmarks.harness.setups import (
    BENCHMARKS_DIR,
    DEFAULT_REPEATS,
    MATRIX_SPEED,
    RESULTS_DIR,
    VANILLA,
    Cell,
    Setup,
    Workload,
    interleaved_order,
    setup_engine_env,
)


def run_setups(
    setups: list[Setup], workload: Workload, repeats: int = DEFAULT_REPEATS, progress: bool = True
) -> list[dict[str, Any]]:
    """Run every setup in ``repeats`` interleaved engine processes; one row per setup (see the package
    docstring for the medians, ranges and identity verdicts). Prints identity failures and near-ties."""
    raw = _run_interleaved(setups, workload, repeats, progress)
    rows = finalize_rows(raw, order=[s.name for s in setups])
    report_identity(rows)
    return rows


def run_matrix(
    setups: list[Setup], workload: Workload, cells: list[Cell], repeats: int = DEFAULT_REPEATS,
    runs_file: Path | None = None, progress: bool = True, side_by_side: bool = False, speed: str = MATRIX_SPEED,
) -> dict[str, list[dict[str, Any]]]:
    """Like ``run_setups``, but each engine process times every cell in turn (engine start-up is paid once per
    process, not per cell); the engine's ``max_num_seqs`` is ``workload.batch_size``, at least every cell's
    batch. Returns one list of rows per cell, each aggregated exactly as ``run_setups`` aggregates its runs.
    With ``side_by_side``, each round's engines are resident together and take turns cell by cell (package
    docstring).

    ``runs_file`` (JSON lines) keeps every finished run; a run already there is not run again (side by side:
    a round whose every setup is there), so an interrupted matrix resumes where it stopped. Rows are of
    ``speed``: ``MATRIX_SPEED`` (package docstring), or ``decode_tok_per_s`` as ``run_setups`` reports."""
    if max(cell.batch_size for cell in cells) > workload.batch_size:
        raise ValueError(f"workload.batch_size {workload.batch_size} is below a cell's batch")
    names = [s.name for s in setups]
    run = _run_side_by_side if side_by_side else _run_interleaved
    raw = run(setups, workload, repeats, progress, cells, runs_file)
    rows_by_cell = {}
    for cell in cells:
        rows = finalize_rows([run["cells"][cell.name] | {"round": run["round"]} for run in raw], order=names,
                             speed=speed)
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
    """Every round in one child whose engines, one per setup, take turns cell by cell (package docstring); the
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


def _run_in_child(
    setup: Setup, workload: Workload, round_index: int = 0, record_top_logits: bool = False,
    cells: list[Cell] | None = None,
) -> dict[str, Any]:
    request = {"setup": asdict(setup), "workload": asdict(workload), "record_top_logits": record_top_logits,
               "cells": [asdict(cell) for cell in cells or []], "round": round_index}
    env = os.environ | setup_engine_env(setup)
    return _child(request, env, workload, f"{setup.name}-r{round_index}", f"setup {setup.name!r}")


def _run_round_in_child(setups: list[Setup], workload: Workload, round_index: int,
                        cells: list[Cell]) -> list[dict[str, Any]]:
    """One side-by-side round: a run per setup, in the order of ``setups``."""
    request = {"setups": [asdict(setup) for setup in setups], "workload": asdict(workload),
               "cells": [asdict(cell) for cell in cells], "round": round_index}
    return _child(request, dict(os.environ), workload, f"side-by-side-r{round_index}",
                  f"round {round_index}")["runs"]


def _child(request: dict[str, Any], env: dict[str, str], workload: Workload, log_name: str,
           what: str) -> dict[str, Any]:
    """Runs ``request`` in a child process (``engine._child_main``) and returns its result."""
    with tempfile.TemporaryDirectory(prefix="easyspec-bench-") as scratch:
        request_path = Path(scratch) / "request.json"
        result = Path(scratch) / "result.json"
        request_path.write_text(json.dumps(request))
        env = env | {"VLLM_CPU_KVCACHE_SPACE": str(workload.kv_cache_gib)}
        log_path = RESULTS_DIR / "logs" / f"{os.getpid()}-{log_name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as log:
            completed = subprocess.run(
                [sys.executable, "-m", "benchmarks.harness.engine", "--child", str(request_path), str(result)],
                cwd=BENCHMARKS_DIR.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        if completed.returncode != 0:
            tail = "\n".join(log_path.read_text().splitlines()[-15:])
            raise RuntimeError(f"{what} failed (exit {completed.returncode}); log {log_path}:\n{tail}")
        return json.loads(result.read_text())

