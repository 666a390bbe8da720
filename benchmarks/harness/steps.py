"""The plugin's step statistics as a run reads them: counters over the timed call, the step split into drafting
and verify, and the step log by the draft tokens each step verifies."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.harness.aggregate import median_or_none

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


def step_split(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
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
            "verify_seconds": median_or_none(entry["verify"]),
            "forward_seconds": median_or_none(entry["forward"]),
            "drafting_stages": len(entry["drafting"]),
            "drafting_seconds": median_or_none(entry["drafting"]),
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

