"""The engines of ``real_model.py run``, each in its own process: the worker extension that reads what an engine
runs with; the child (``run_one``, started as ``real_model.py --one SPEC``) that starts its setup's engine, reports
ready, waits for its turn and measures; the parent (``run_group``) that starts a group together, measures its
engines one at a time and kills every process. The invariants are in ``real_model.py``'s docstring."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.gpu.real_model_setups import (
    GPU_KV_CACHE_BYTES,
    GROUP_WAIT_S,
    MIN_MEASURE_S,
    START_LIMIT_S,
    WITHOUT_PLUGIN,
    RealSetup,
    RunSettings,
)
from benchmarks.harness.step_timers import HarnessWorkerExtension

ROOT = Path(__file__).resolve().parents[2]
T0 = time.time()  # the run's clock: log lines, --deadline and the report's seconds count from here
ENTRY_POINT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "real_model.py")  # runs run_one with --one
WORKER_EXTENSION_CLS = "benchmarks.gpu.engines.RealModelWorkerExtension"  # imported by vLLM in each worker


# ---------------------------------------------------------------------------------------------- worker side
class RealModelWorkerExtension(HarnessWorkerExtension):
    """The harness's worker extension (its counters and step timers, inert until asked), and what this engine
    actually runs with, read in its worker after start-up."""

    def real_model_engine_facts(self) -> dict[str, Any]:
        import torch

        from vllm_easyspec import plugin

        config = self.vllm_config
        compilation = config.compilation_config
        runner = type(self.model_runner)
        return {
            "cudagraph_mode": str(compilation.cudagraph_mode),
            "compilation_mode": getattr(compilation.mode, "name", str(compilation.mode)),
            "cudagraph_capture_sizes": list(compilation.cudagraph_capture_sizes or []),
            "model_runner": f"{runner.__module__}.{runner.__name__}",
            "async_scheduling": config.scheduler_config.async_scheduling,
            "plugin_registered": plugin.plugin_state()["registered"],
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": str(torch.__version__),  # a str subclass that vLLM's msgpack encoder refuses
        }

    def real_model_profile(self, action: str) -> dict[str, Any] | None:
        """``start``: profile this worker from now on; ``stop``: the profile's per-step summary (step_profile.py)."""
        from benchmarks.gpu import step_profile

        if action == "start":
            self._real_model_profiler = step_profile.start()
            return None
        return step_profile.summary(self._real_model_profiler)


# ---------------------------------------------------------------------------------------------- one engine (child)
def _wait_for_turn(work: Path) -> dict[str, Any] | None:
    """The parent's go (with the time to stop by), or None when told to stop or when the parent is gone."""
    parent = os.getppid()
    while True:
        if (work / "go.json").exists():
            return json.loads((work / "go.json").read_text())
        if (work / "stop").exists() or os.getppid() != parent:
            return None
        time.sleep(0.1)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def run_one(spec: dict[str, Any]) -> None:
    """Child process: start the setup's engine, report ready, wait for its turn, measure, write the result."""
    work = Path(spec["work"])
    result: dict[str, Any] = {"setup": spec["setup"]["name"], "ok": False, "runs": [], "timed_runs": [],
                              "profiles": []}
    try:
        from transformers import AutoTokenizer
        from vllm import LLM

        from benchmarks.harness.engine import _measure
        from benchmarks.harness.setups import Cell, Setup, Workload

        setup = Setup(name=spec["setup"]["name"], description=spec["setup"]["description"],
                      speculative_config=spec["setup"]["speculative_config"],
                      additional_config=spec["setup"]["additional_config"])
        settings = RunSettings(**spec["settings"])
        kwargs = dict(model=spec["target"], dtype=settings.dtype, seed=0, max_model_len=2048,
                      max_num_seqs=max(settings.batches), disable_log_stats=False,
                      worker_extension_cls=WORKER_EXTENSION_CLS,
                      speculative_config=setup.speculative_config, additional_config=setup.additional_config or {})
        kwargs |= spec["setup"]["engine"] or {}
        if settings.eager:
            kwargs["enforce_eager"] = True
        if settings.device == "cuda":
            kwargs.update(kv_cache_memory_bytes=GPU_KV_CACHE_BYTES,
                          gpu_memory_utilization=round(min(0.9, 0.8 / settings.start_together), 3))
        result["engine_kwargs"] = {k: v for k, v in kwargs.items() if k != "model"}
        started = time.perf_counter()
        llm = LLM(**kwargs)
        result["engine_start_seconds"] = time.perf_counter() - started
        try:
            result["facts"] = llm.collective_rpc("real_model_engine_facts", timeout=60)[0]
        except Exception as exc:  # noqa: BLE001 - the engine still serves; the log lines say what it runs
            result["facts"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        _write_json(work / "ready.json", {"engine_start_seconds": result["engine_start_seconds"]})
        go = _wait_for_turn(work)
        if go is None:
            result["error"] = "stopped before its turn"
            return
        result["others_starting"] = go["others_starting"]
        tokenizer = AutoTokenizer.from_pretrained(spec["target"])
        workload = Workload(target=spec["target"], prompts=[], max_tokens=settings.max_tokens,
                            batch_size=max(settings.batches), dtype=settings.dtype)
        cells = [Cell(**cell) for cell in spec["cells"]]
        longest = 0.0
        order = [(round_index, cell) for round_index in range(settings.repeats) for cell in cells]
        for round_index, cell in order:  # cells interleaved: drift over the engine's life spreads over all
            # the first round is the engine's row in every cell: only the run's deadline stops it
            stop_by = go["deadline"] if round_index == 0 else go["stop_by"]
            if time.time() + 1.5 * longest + 5 > stop_by:
                result["cut_short"] = f"stopped before round {round_index + 1}, cell {cell.name}: its time was up"
                break
            began = time.time()
            llm.reset_prefix_cache()
            top_logits = settings.identity and setup.name == "vanilla" and round_index == 0  # its replay untimed
            run = _measure(llm, tokenizer, setup, workload, cell, record_top_logits=top_logits, limit_in_flight=True)
            longest = max(longest, time.time() - began)
            result["runs"].append(run | {"cell": cell.name, "round": round_index})
        result["ok"] = bool(result["runs"])
        _write_json(work / "result.json", result)  # the timed repeats are safe whatever the step-timed pass does
        if settings.profile and "cut_short" not in result:  # before the step timers, which synchronise each step
            _profile_pass(llm, tokenizer, setup, workload, cells, result, stop_by=go["stop_by"] - 1.5 * longest)
        if settings.timed_pass and "cut_short" not in result:
            try:
                if setup.speculative_config:
                    llm.collective_rpc("easyspec_time_drafter")
                llm.collective_rpc("easyspec_time_steps")
                for cell in cells:
                    if time.time() + 1.5 * longest + 5 > go["stop_by"]:
                        result["timed_pass_cut_short"] = f"no time left for {cell.name}"
                        break
                    llm.reset_prefix_cache()
                    run = _measure(llm, tokenizer, setup, workload, cell, record_top_logits=False,
                                   limit_in_flight=True)
                    result["timed_runs"].append(run | {"cell": cell.name})
            except Exception as exc:  # noqa: BLE001 - reported; the timed repeats above stand
                result["timed_pass_error"] = f"{type(exc).__name__}: {exc}"[:1000]
    except BaseException as exc:  # noqa: BLE001 - every failure is the setup's result, never the run's end
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        result["traceback"] = traceback.format_exc()[-4000:]
    finally:
        _write_json(work / "result.json", result)
        print("RESULT_WRITTEN", flush=True)
        os._exit(0)  # no engine teardown: the parent reads the result and moves on


def _profile_pass(llm, tokenizer, setup, workload, cells, result: dict[str, Any], stop_by: float) -> None:
    """One more untimed pass per cell under torch's profiler; its per-step summary goes to ``result["profiles"]``."""
    from benchmarks.harness.engine import _measure

    for cell in cells:
        if time.time() > stop_by:
            result["profile_cut_short"] = f"no time left for {cell.name}"
            return
        try:
            llm.reset_prefix_cache()
            llm.collective_rpc("real_model_profile", args=("start",))
            _measure(llm, tokenizer, setup, workload, cell, record_top_logits=False, limit_in_flight=True)
            result["profiles"].append({"cell": cell.name} | llm.collective_rpc("real_model_profile", args=("stop",))[0])
        except Exception as exc:  # noqa: BLE001 - reported; the timed repeats stand
            result["profile_error"] = f"{type(exc).__name__}: {exc}"[:1000]
            return


# ---------------------------------------------------------------------------------------------- parent
def log(*parts: Any) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *parts, flush=True)


@dataclass
class EngineProcess:
    setup: RealSetup
    work: Path
    log_path: Path
    process: subprocess.Popen | None = None
    started: float = 0.0
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return (self.work / "ready.json").exists()

    @property
    def finished(self) -> bool:
        return self.process is None or self.process.poll() is not None

    def kill(self) -> None:
        """The whole process group: the setup's process and the engine core and workers it started, which
        outlive it when it ends with ``os._exit`` (and would keep their GPU memory)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def read_result(self, fallback: str) -> dict[str, Any]:
        try:
            result = json.loads((self.work / "result.json").read_text())
        except (OSError, ValueError):
            result = {"setup": self.setup.name, "ok": False, "runs": [], "timed_runs": [], "error": fallback}
        result["log_lines"] = log_lines(self.log_path)
        if not result.get("ok"):
            result["log_tail"] = self.log_path.read_text(errors="replace").splitlines()[-25:]
        return result


LOG_PATTERNS = re.compile(r"cudagraph|cuda graph|graph capturing|capturing cuda|attention backend|model runner|"
                          r"torch\.compile|compilation|V2 Model Runner|Traceback|Error", re.IGNORECASE)


def log_lines(path: Path, limit: int = 24) -> list[str]:
    """The engine log's lines about graphs, compilation, the attention backend and the model runner, and
    errors; each once, in order, shortened."""
    seen: list[str] = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return seen
    for line in text.splitlines():
        short = re.sub(r"^\(\S+ pid=\d+\) ", "", line.strip())[:300]
        if LOG_PATTERNS.search(short) and short not in seen:
            seen.append(short)
    return seen[:limit]


def substitute(value: Any, head: str) -> Any:
    if isinstance(value, str):
        return value.replace("$HEAD", head)
    if isinstance(value, dict):
        return {k: substitute(v, head) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, head) for v in value]
    return value


def child_environment(setup: RealSetup, settings: RunSettings, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
    if not setup.plugin:
        env |= WITHOUT_PLUGIN
    if settings.profile:  # vLLM's runner names its step's parts for the profiler (step_profile.py)
        env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    if settings.device == "cpu":  # the dry run: the engine core inside the setup's process (starts 3x faster)
        from benchmarks.harness.setups import engine_env

        env |= engine_env(1) | {"VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                                "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if settings.start_together > 1:  # engines compiling at once each get their own compile cache
        env["VLLM_CACHE_ROOT"] = str(work.parent / "vllm_cache" / setup.name)
    return env


def start_engine(engine: EngineProcess, settings: RunSettings, target: str, head: str,
                 cells: list[dict[str, Any]]) -> None:
    engine.work.mkdir(parents=True, exist_ok=True)
    for stale in engine.work.iterdir():
        stale.unlink()
    spec = {"setup": substitute(asdict(engine.setup), head), "settings": asdict(settings), "target": target,
            "cells": cells, "work": str(engine.work)}
    (engine.work / "spec.json").write_text(json.dumps(spec))
    with engine.log_path.open("w") as log_file:
        engine.process = subprocess.Popen(
            [sys.executable, ENTRY_POINT, "--one", str(engine.work / "spec.json")],
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
            env=child_environment(engine.setup, settings, engine.work))
    engine.started = time.time()


def _wait_while_starting(engines: list[EngineProcess], until: float, start_limit: float) -> None:
    """Until every engine given is ready, has exited or is past its start limit, or until ``until``."""
    while time.time() < until and any(
        not e.ready and not e.finished and time.time() - e.started < start_limit for e in engines
    ):
        time.sleep(0.5)


def run_group(group: list[EngineProcess], settings: RunSettings, deadline: float, target: str, head: str,
              cells: list[dict[str, Any]], measure_estimate: float) -> list[dict[str, Any]]:
    """Start the group's engines together; measure them one at a time in order once all are ready (or after
    ``GROUP_WAIT_S``: an engine slow to start does not hold up the others, their rows then name it in
    ``others_starting``); an engine not ready when its turn comes is waited for up to its start limit. Every
    process is gone when this returns."""
    for engine in group:
        start_engine(engine, settings, target, head, cells)
        log(f"START {engine.setup.name} (pid {engine.process.pid})")
    start_limit = START_LIMIT_S[settings.mode]
    last_call = deadline - MIN_MEASURE_S
    _wait_while_starting(group, min(last_call, time.time() + GROUP_WAIT_S[settings.mode]), start_limit)
    results = []
    try:
        for engine in group:
            _wait_while_starting([engine], last_call, start_limit)
            if not engine.ready:
                why = ("exited before it was ready" if engine.finished
                       else f"not ready within {start_limit} s" if time.time() < last_call
                       else "not ready before the deadline")
                engine.kill()
                results.append(engine.read_result(f"engine start failed: {why}") | {"start_failed": why})
                log(f"FAIL  {engine.setup.name}: {results[-1].get('error')}")
                continue
            left = deadline - time.time()
            if left < MIN_MEASURE_S:
                (engine.work / "stop").touch()
                engine.kill()
                results.append({"setup": engine.setup.name, "ok": False, "skipped": True, "runs": [],
                                "timed_runs": [], "error": f"skipped: {left:.0f} s left before the deadline"})
                log(f"SKIP  {engine.setup.name}: {results[-1]['error']}")
                continue
            others = [e.setup.name for e in group if e is not engine and not e.ready and not e.finished]
            stop_by = min(deadline, time.time() + max(measure_estimate * 2, 60))
            _write_json(engine.work / "go.json", {"stop_by": stop_by, "deadline": deadline,
                                                  "others_starting": others})
            log(f"MEASURE {engine.setup.name} (further rounds until +{stop_by - T0:.0f}s)"
                + (f", still starting: {', '.join(others)}" if others else ""))
            try:
                engine.process.wait(timeout=max(1.0, deadline - time.time() + 10))
            except subprocess.TimeoutExpired:
                pass
            engine.kill()  # its engine core too, before the next engine is measured
            results.append(engine.read_result("killed at the run's deadline"))
            r = results[-1]
            log(f"DONE  {engine.setup.name}: {'ok' if r.get('ok') else 'FAIL ' + str(r.get('error'))[:300]}, "
                f"start {r.get('engine_start_seconds', 0):.0f}s, {len(r.get('runs', []))} runs + "
                f"{len(r.get('timed_runs', []))} timed, graphs {r.get('facts', {}).get('cudagraph_mode')}")
    finally:
        for engine in group:
            engine.kill()
    return results
