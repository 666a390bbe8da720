"""A setup's runs into one row: medians with their min and max, ratios to vanilla's median, the identity
verdict over every run."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.harness.identity import classify_identity, identity_verdict
from benchmarks.harness.setups import MEDIAN_FIELDS, ROW_FIELDS, VANILLA


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max); the median of an even count is the mean of the middle two."""
    if not values:
        raise ValueError("no values")
    return statistics.median(values), min(values), max(values)


def median_or_none(values: list[Any]) -> float | None:
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
            row[key] = median_or_none([r.get(key) for r in results])
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
    return {
        "outputs_identical_to_vanilla": not divergences,
        "identity": identity_verdict(divergences),
        "divergences": sorted(
            divergences, key=lambda d: (d["prompt"] is None, d["prompt"] or 0, d["position"] or 0)
        ),
    }

