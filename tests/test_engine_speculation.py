"""Speculation through a real vLLM engine on tiny float32 models: greedy output equals output without
speculation, and at temperature > 0 the output law equals the target's (and a biased verifier is caught).
"""

from __future__ import annotations

import pytest

from benchmarks.harness.step_timers import read_timed_drafting_stats, time_drafter
from tests.distribution import (
    ALPHA,
    install_biased_rejection_sampler,
    restore_rejection_sampler,
    run_distribution_test,
)
from vllm_easyspec.instruments.metrics import read_spec_decode_counters
from vllm_easyspec.instruments.worker_extension import read_drafting_stats

PROMPTS = [[1, 5, 9, 13, 17], [1, 40, 41, 42], [1, 7], [1, 60, 3, 3, 3, 3, 3, 21]]
MAX_TOKENS = 40
K = 3


def _greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def _spec(draft_dir, **extra) -> dict:
    return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": K} | extra



@pytest.fixture(scope="module")
def vanilla_llama_tokens(llm_pool, tiny_llama_dir):
    return _greedy(llm_pool.get(tiny_llama_dir))


@pytest.mark.parametrize("plugin_active", [False, True], ids=["builtin_draft_model", "plugin_exact"])
def test_greedy_speculation_equals_vanilla_llama(
    llm_pool, tiny_llama_dir, tiny_llama_draft_dir, vanilla_llama_tokens, plugin_active
):
    additional = {"easyspec": {}} if plugin_active else {}
    llm = llm_pool.get(tiny_llama_dir, speculative_config=_spec(tiny_llama_draft_dir), additional_config=additional)
    if not plugin_active:
        # Benchmarks time vLLM's own proposers at the same boundary as the plugin's (one propose per step).
        assert llm.collective_rpc(read_drafting_stats) == [None]  # the built-in drafter does not time itself
        assert llm.collective_rpc(time_drafter) == [True]
        assert llm.collective_rpc(time_drafter) == [True]  # idempotent: one wrapper, not two
    before = read_spec_decode_counters(llm)
    assert _greedy(llm) == vanilla_llama_tokens
    counters = read_spec_decode_counters(llm) - before
    assert counters.num_drafts > 0
    # The family-sharing draft accepts some drafts but not all: the comparison exercised both paths.
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    if not plugin_active:
        timed = llm.collective_rpc(read_timed_drafting_stats)[0]
        assert timed["steps"] > 0 and timed["drafting_seconds"] > 0
        assert timed["drafted_requests"] >= counters.num_drafts


@pytest.mark.slow  # chains on the other targets; trees cover Qwen2 and MoE targets in the default suite
@pytest.mark.parametrize("target_fixture", ["tiny_qwen2_dir", "tiny_moe_dir"])
def test_greedy_speculation_equals_vanilla_other_targets(llm_pool, request, tiny_llama_draft_dir, target_fixture):
    target = request.getfixturevalue(target_fixture)
    vanilla = _greedy(llm_pool.get(target))
    llm = llm_pool.get(target, speculative_config=_spec(tiny_llama_draft_dir), additional_config={"easyspec": {}})
    assert _greedy(llm) == vanilla


def test_plugin_reports_drafting_time(llm_pool, tiny_llama_dir, tiny_llama_draft_dir):
    llm = llm_pool.get(
        tiny_llama_dir,
        speculative_config=_spec(tiny_llama_draft_dir),
        additional_config={"easyspec": {}},
    )
    _greedy(llm)
    stats = llm.collective_rpc(read_drafting_stats)
    assert stats and stats[0]["steps"] > 0 and stats[0]["drafting_seconds"] > 0


@pytest.fixture(scope="module")
def sampling_engine(llm_pool, tiny_llama_dir, tiny_llama_draft_dir):
    return llm_pool.get(tiny_llama_dir, speculative_config=_spec(tiny_llama_draft_dir), additional_config={"easyspec": {}})


def test_distribution_with_speculation_matches_target(sampling_engine, tiny_llama_dir):
    result = run_distribution_test(sampling_engine, tiny_llama_dir, temperature=1.0)
    assert result.passes, f"chi2={result.statistic:.1f} dof={result.degrees_of_freedom} p={result.p_value:.2e}"


def test_distribution_test_rejects_a_biased_verifier(sampling_engine, tiny_llama_dir):
    sampling_engine.collective_rpc(install_biased_rejection_sampler)
    try:
        result = run_distribution_test(sampling_engine, tiny_llama_dir, temperature=1.0)
    finally:
        sampling_engine.collective_rpc(restore_rejection_sampler)
    assert result.p_value < ALPHA, f"biased verifier not detected: chi2={result.statistic:.1f} p={result.p_value:.2e}"
