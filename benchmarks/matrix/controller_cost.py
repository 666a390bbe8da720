"""The speculation controller's own time per step, engine-free: the same synthetic steps fed to
``SpeculationController`` at each batch size, its four calls timed apart.

    python -m benchmarks matrix controller-cost [--batches 1 4 16] [--steps 300] [--repeats 5] [--stem controller_cost]

A step is what the runner does with ``easyspec.tree.auto`` on the EAGLE matrix setup (a 16 + 4-node candidate:
top-k 4, depth 5, 4 prompt-lookup nodes): ``plan_depth`` for every running request, the drafted trees (an EAGLE-2
tree of up to 16 head nodes as deep as the plan drafted, at least one level, and a 4-node lookup path) handed to
``choose``, ``observe`` of each request's verified nodes (each node tested is accepted with probability 0.5), and
``observe_verify`` with the step's seconds. The cost curves are the ones the controller measured on the AVX-512
EPYC in bf16 (``docs/results.md``), so the plans are the ones that machine's cost makes. Trees, acceptance and
timings come from one seeded generator: every run and every commit sees the same steps, so two commits' times
compare the controller's code alone. Each repeat runs a fresh controller for ``--steps`` steps after 100 untimed
ones; the report gives each call's median ms per step over the repeats, with their range.

Results: ``benchmarks/results/{stem}.{md,json}``. Engine runs report the controller's share of a step in
``python -m benchmarks matrix`` (``controller share``), which includes the worker's snapshot for vLLM's metrics.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import vllm_easyspec
from benchmarks.harness.setups import RESULTS_DIR
from vllm_easyspec.control.acceptance import NodeFeatures
from vllm_easyspec.control.controller import RequestTree, SpeculationController
from vllm_easyspec.control.cost import CostCurve, StepCostModel

# measured at start-up on the AVX-512 EPYC, bf16 (docs/results.md, "Cost curves")
VERIFY_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
VERIFY_SECONDS = (0.0515, 0.0529, 0.0529, 0.0529, 0.0645, 0.102, 0.180, 0.387)
LEVEL_ROWS = (1, 2, 4, 8, 16, 32, 64)
LEVEL_SECONDS = (0.0013, 0.0014, 0.0015, 0.0017, 0.0021, 0.003, 0.005)
TOP_K, DEPTH, HEAD_NODES, LOOKUP_NODES = 4, 5, 16, 4
CALLS = ("plan_depth", "choose", "observe", "observe_verify")
WARM_UP_STEPS = 100


def _tree(rng: random.Random, req_id: str, depth: int) -> RequestTree:
    """An EAGLE-2 style tree: TOP_K root children, then the best child of each of the TOP_K best nodes of the
    level above, down to ``depth``, at most HEAD_NODES head nodes; then a LOOKUP_NODES-node lookup path."""
    tokens: list[int] = []
    parents: list[int] = []
    features: list[NodeFeatures] = []
    frontier = [-1]
    for level in range(1, depth + 1):
        children = []
        for parent in frontier[:TOP_K]:
            for _ in range(TOP_K if level == 1 else 1):
                if len(tokens) < HEAD_NODES:
                    parents.append(parent)
                    tokens.append(rng.randrange(32000))
                    features.append(NodeFeatures(False, level, -3 * rng.random()))
                    children.append(len(tokens) - 1)
        frontier = children
    for index in range(LOOKUP_NODES):
        parents.append(-1 if index == 0 else len(tokens) - 1)
        tokens.append(rng.randrange(32000))
        features.append(NodeFeatures(True, index + 1, None))
    return RequestTree(req_id, tokens, parents, features, keeps_order=False)


def run(batch: int, steps: int, seed: int) -> dict[str, float]:
    """ms per step of each call over ``steps`` steps (after the warm-up) of a fresh controller."""
    cost = StepCostModel(CostCurve.from_measurements(VERIFY_ROWS, VERIFY_SECONDS),
                         CostCurve.from_measurements(LEVEL_ROWS, LEVEL_SECONDS),
                         CostCurve.from_measurements(LEVEL_ROWS, LEVEL_SECONDS))
    controller = SpeculationController(cost, max_depth=DEPTH, max_nodes=HEAD_NODES + LOOKUP_NODES, level_width=TOP_K)
    rng = random.Random(seed)
    req_ids = [f"request-{i}" for i in range(batch)]
    seconds: dict[str, float] = defaultdict(float)

    def timed(call: str, function, *arguments):
        started = time.perf_counter()
        result = function(*arguments)
        seconds[call] += time.perf_counter() - started
        return result

    for step in range(WARM_UP_STEPS + steps):
        if step == WARM_UP_STEPS:
            seconds.clear()
        depth = timed("plan_depth", controller.plan_depth, req_ids, 2 * batch, 16.0, [LOOKUP_NODES] * batch)
        controller.observe_first_pass(2 * batch, 0.003, batch)
        if depth > 1:
            controller.observe_draft(depth - 1, TOP_K * batch, 0.002 * (depth - 1))
        controller.observe_drafting(0.004 + 0.002 * max(depth - 1, 0))
        trees = [_tree(rng, req_id, max(depth, 1)) for req_id in req_ids]
        choices = timed("choose", controller.choose, trees)
        for req_id, choice in zip(req_ids, choices, strict=True):
            accepted: set[int] = set()
            for node in range(choice.count):
                parent = choice.parents[node]
                if (parent < 0 or parent in accepted) and rng.random() < 0.5:
                    accepted.add(node)
            timed("observe", controller.observe, req_id, choice.features[: choice.count],
                  choice.parents[: choice.count], accepted)
        rows = batch + sum(choice.count for choice in choices)
        timed("observe_verify", controller.observe_verify, rows, cost.verify(rows) * rng.uniform(0.95, 1.1), 0, batch)
    return {call: 1e3 * seconds[call] / steps for call in CALLS}


def main(argv: list[str], prog: str = "python -m benchmarks matrix controller-cost") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--stem", default="controller_cost")
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(vllm_easyspec.__file__).parent).stdout.strip()  # the code timed
    rows = []
    for batch in args.batches:
        runs = [run(batch, args.steps, seed=repeat) for repeat in range(args.repeats)]
        totals = [sum(r.values()) for r in runs]
        row = {"batch": batch, "total_ms": statistics.median(totals), "total_ms_range": [min(totals), max(totals)]}
        row |= {f"{call}_ms": statistics.median(r[call] for r in runs) for call in CALLS}
        rows.append(row)
        print(f"batch {batch}: {row['total_ms']:.3f} ms per step [{min(totals):.3f}-{max(totals):.3f}]", flush=True)
    command = "python -m benchmarks matrix controller-cost " + " ".join(
        [f"--batches {' '.join(map(str, args.batches))}", f"--steps {args.steps}", f"--repeats {args.repeats}"])
    lines = [f"# The controller's own time per step, engine-free (commit {commit})", "", f"Command: `{command}`", "",
             "| batch | ms per step [min–max over repeats] | " + " | ".join(CALLS) + " |",
             "|---|---|" + "---|" * len(CALLS)]
    for row in rows:
        low, high = row["total_ms_range"]
        lines.append(f"| {row['batch']} | {row['total_ms']:.3f} [{low:.3f}–{high:.3f}] | "
                     + " | ".join(f"{row[f'{call}_ms']:.3f}" for call in CALLS) + " |")
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"{args.stem}.md").write_text("\n".join(lines) + "\n")
    (RESULTS_DIR / f"{args.stem}.json").write_text(json.dumps({"command": command, "commit": commit, "rows": rows},
                                                          indent=1))

