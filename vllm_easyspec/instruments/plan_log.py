"""A JSON-lines log of the ``easyspec.tree.auto`` controller's depth plan, one line per step, for finding out why it
drafts as deep as it does.

Set ``VLLM_EASYSPEC_PLAN_LOG=/path/prefix`` before the engine starts; each worker process appends one line per
``plan_depth`` call to ``/path/prefix.<pid>.jsonl``: the step's requests, how many had a prompt-lookup path, the
first pass's rows, every option the plan priced (``depth`` 0 with no nodes: drafting nothing; ``depth`` 0 with
nodes: the lookup paths alone; then each depth) with its nodes, expected accepted ``gain`` and predicted
``rate`` in tokens per second, the depth planned, the depth drafted (the outcome guard and exploring can
change it) and why. Off (no cost) when the variable is unset.

``python -m vllm_easyspec.instruments.plan_log FILE...`` prints, per batch size, how often each depth was
drafted and each option's median predicted gain and rate over drafting nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

PLAN_LOG_VARIABLE = "VLLM_EASYSPEC_PLAN_LOG"


def plan_log_path() -> str | None:
    """Where this process writes its plan log, or None when the log is off."""
    prefix = os.environ.get(PLAN_LOG_VARIABLE)
    return None if not prefix else f"{prefix}.{os.getpid()}.jsonl"


def appender(path: str) -> Callable[[dict[str, Any]], None]:
    """A function that appends one record to ``path`` as a JSON line (the file stays open, line-buffered)."""
    handle = open(path, "a", buffering=1)  # noqa: SIM115  (open for the engine's life)

    def append(record: dict[str, Any]) -> None:
        handle.write(json.dumps(record) + "\n")

    return append


def _option_name(option: dict[str, Any]) -> str:
    """An option after the first (drafting nothing): a depth, or the lookup paths alone (depth 0)."""
    return f"depth {option['depth']}" if option["depth"] > 0 else "lookup paths alone"


def summary(records: Iterable[dict[str, Any]]) -> str:
    """Markdown: per batch size, the steps, the depths drafted, and each option's median nodes, gain and
    rate over drafting nothing (the steps that priced it)."""
    by_batch: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        by_batch.setdefault(record["requests"], []).append(record)
    lines = []
    for batch in sorted(by_batch):
        steps = by_batch[batch]
        drafted = Counter(step["drafted"] for step in steps)
        lookup = sum(step["with_lookup"] for step in steps) / (batch * len(steps))
        held = sum(step["held_back"] for step in steps)
        lines += [f"## {batch} request{'s' if batch > 1 else ''}: {len(steps)} steps",
                  "",
                  f"Drafted depth: {', '.join(f'{d}: {n}' for d, n in sorted(drafted.items()))}; requests with a "
                  f"lookup path {lookup:.0%}; held back by the outcome guard {held}.",
                  "",
                  "| option | steps | median nodes | median gain | median rate / drafting nothing |",
                  "|---|---|---|---|---|"]
        priced: dict[str, list[tuple[int, float, float]]] = {}
        for step in steps:
            options = step["options"]
            if not options:
                continue
            base = options[0]["rate"]
            for option in options[1:]:
                priced.setdefault(_option_name(option), []).append(
                    (option["nodes"], option["gain"], option["rate"] / base if base else 0.0))
        for name, values in priced.items():
            nodes, gains, ratios = zip(*values, strict=True)
            lines.append(f"| {name} | {len(values)} | {statistics.median(nodes):g} | {statistics.median(gains):.2f} "
                         f"| {statistics.median(ratios):.2f} |")
        lines.append("")
    return "\n".join(lines)


def read(paths: Iterable[str]) -> list[dict[str, Any]]:
    records = []
    for path in paths:
        with open(path) as handle:
            records += [json.loads(line) for line in handle if line.strip()]
    return records


def main(argv: list[str] | None = None) -> None:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        sys.exit("usage: python -m vllm_easyspec.instruments.plan_log FILE...")
    print(summary(read(paths)))


if __name__ == "__main__":
    main()
