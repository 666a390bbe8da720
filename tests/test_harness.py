"""Benchmark harness bookkeeping (no engine): ratios and identity against vanilla."""

from __future__ import annotations

from benchmarks.harness import finalize_rows


def _raw(name: str, tok_s: float, ids: list[int]) -> dict:
    return {"setup": name, "decode_tok_per_s": tok_s, "token_ids": [ids]}


def test_ratios_use_the_mean_of_the_bookend_vanilla_runs():
    rows = finalize_rows([_raw("vanilla", 8.0, [1, 2]), _raw("spec", 15.0, [1, 2]),
                          _raw("other", 9.0, [1, 3]), _raw("vanilla-end", 12.0, [1, 2])])
    by = {r["setup"]: r for r in rows}
    assert by["spec"]["speedup_vs_vanilla"] == 1.5
    assert by["vanilla"]["speedup_vs_vanilla"] == 0.8 and by["vanilla-end"]["speedup_vs_vanilla"] == 1.2
    assert by["spec"]["outputs_identical_to_vanilla"] and not by["other"]["outputs_identical_to_vanilla"]


def test_without_bookend_the_single_vanilla_run_is_the_baseline():
    rows = finalize_rows([_raw("vanilla", 8.0, [1]), _raw("spec", 12.0, [1])])
    assert rows[1]["speedup_vs_vanilla"] == 1.5
