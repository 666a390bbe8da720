"""EasySpec through a real vLLM engine on tiny float32 models (issue behaviour 3-5).

- greedy output with fuzzy drafting (fused, and tensor_parallel / head-sharded fused on 2 CPU ranks)
  equals greedy output without speculation, token for token, with Llama and Qwen2 drafts;
- the draft KV cache, read back after a request, equals an exact draft's at every position below the
  last bonus token under ``every_round``, and differs under ``never`` (so the check can fail);
- at temperature 1 the output law with EasySpec drafts equals the target's (chi-square test).
"""

from __future__ import annotations

import pytest
import torch

from tests.distribution import ALPHA, run_distribution_test
from tests.kv_inspection import read_draft_kv, start_recording_block_tables
from vllm_easyspec.easyspec.config import EasySpecConfigError
from vllm_easyspec.instruments.metrics import read_spec_decode_counters
from vllm_easyspec.instruments.worker_extension import read_drafting_stats
from vllm_easyspec.integration.fuzzy_models import check_fuzzy_architecture

PROMPTS = [[1, 5, 9, 13, 17], [1, 40, 41, 42], [1, 7], [1, 60, 3, 3, 3, 3, 3, 21]]
MAX_TOKENS = 40
K = 3
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def _greedy(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def _spec(draft_dir) -> dict:
    return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": K}


def _easyspec(**options) -> dict:
    return {"easyspec": options}


@pytest.fixture(scope="module")
def vanilla_llama_tokens(llm_pool, tiny_llama_dir):
    return _greedy(llm_pool.get(tiny_llama_dir))


def _check_fuzzy_run(llm, vanilla, expect_mode: str, expect_fuzzy_first: bool | None) -> dict:
    stats_before = llm.collective_rpc(read_drafting_stats)[0]
    assert _greedy(llm) == vanilla
    stats = llm.collective_rpc(read_drafting_stats)
    # vLLM's counters are cumulative and published asynchronously: check the engine accepted drafts at all
    # (so the equality above exercised accepted and rejected drafts), not a per-call difference.
    counters = read_spec_decode_counters(llm)
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert stats[0]["steps"] > stats_before["steps"]
    first = stats[0]
    assert first["mode"] == expect_mode
    assert first["fuzzy_forwards"] > stats_before["fuzzy_forwards"]  # fuzzy drafting actually ran
    if expect_fuzzy_first is not None:  # None: on_mismatch, where it depends on the acceptance pattern
        assert (first["fuzzy_first_forwards"] > stats_before["fuzzy_first_forwards"]) == expect_fuzzy_first
    return first


# Tests run in file order and are ordered so that the engine pool (two live engines) builds each engine
# once: exact draft (KV reference) -> vanilla -> N=2 every_round -> N=2 never -> Qwen2 draft -> TP 2.
# vLLM's get_metrics() reads the process-wide Prometheus registry, and every new engine unregisters the
# collectors of the engines built before it: an engine's acceptance counters are readable only while it is
# the newest engine. So the vanilla reference is built before the every_round engine is first used.

KV_PROMPT = [1] + [3 + (j * 11) % 60 for j in range(20)]
KV_MAX_TOKENS = 24


def _draft_kv_after_request(llm) -> tuple[list[int], dict[str, dict[str, torch.Tensor]]]:
    """Greedy-generate KV_PROMPT and read the draft KV at every position below the last sampled token
    (the last step's bonus token; the last step's first draft forward wrote all positions up to it)."""
    llm.collective_rpc(start_recording_block_tables)
    (tokens,) = _greedy(llm, prompts=[KV_PROMPT], max_tokens=KV_MAX_TOKENS)
    num_positions = len(KV_PROMPT) + len(tokens) - 1
    return tokens, llm.collective_rpc(read_draft_kv, args=(num_positions,))[0]


@pytest.fixture(scope="module")
def exact_draft_kv(llm_pool, tiny_llama_dir, tiny_llama_draft_dir):
    llm = llm_pool.get(tiny_llama_dir, speculative_config=_spec(tiny_llama_draft_dir), additional_config=_easyspec())
    return _draft_kv_after_request(llm)


def _fused_llama_engine(llm_pool, target, draft, calibration: str, n: int = 2):
    return llm_pool.get(
        target,
        speculative_config=_spec(draft),
        additional_config=_easyspec(layer_parallel_size=n, calibration=calibration, mode="fused"),
    )


def _max_kv_difference(a, b) -> float:
    assert a.keys() == b.keys() and len(a) == 8
    return max(float((a[name][part] - b[name][part]).abs().max()) for name in a for part in ("key", "value"))


def _kv_difference_after_request(llm, exact_draft_kv) -> float:
    exact_tokens, exact_kv = exact_draft_kv
    before = llm.collective_rpc(read_drafting_stats)[0]["fuzzy_forwards"]
    tokens, kv = _draft_kv_after_request(llm)
    assert tokens == exact_tokens
    assert llm.collective_rpc(read_drafting_stats)[0]["fuzzy_forwards"] > before
    return _max_kv_difference(kv, exact_kv)


def test_every_round_calibration_makes_draft_kv_exact(
    llm_pool, tiny_llama_dir, tiny_llama_draft_dir, exact_draft_kv, vanilla_llama_tokens
):
    llm = _fused_llama_engine(llm_pool, tiny_llama_dir, tiny_llama_draft_dir, "every_round")
    difference = _kv_difference_after_request(llm, exact_draft_kv)
    assert difference <= 1e-5, f"calibrated draft KV differs from the exact draft's by {difference}"


def test_greedy_fused_every_round_equals_vanilla(llm_pool, tiny_llama_dir, tiny_llama_draft_dir, vanilla_llama_tokens):
    llm = _fused_llama_engine(llm_pool, tiny_llama_dir, tiny_llama_draft_dir, "every_round")
    stats = _check_fuzzy_run(llm, vanilla_llama_tokens, "fused", expect_fuzzy_first=False)
    assert stats["fused_group_calls"] > 0
    assert stats["exact_first_forwards"] == stats["steps"]
    assert stats["groups"] == [[1], [2, 3], [4, 5], [6]]


def test_distribution_with_easyspec_drafts_matches_target(llm_pool, tiny_llama_dir, tiny_llama_draft_dir):
    llm = _fused_llama_engine(llm_pool, tiny_llama_dir, tiny_llama_draft_dir, "every_round")
    before = llm.collective_rpc(read_drafting_stats)[0]["fuzzy_forwards"]
    result = run_distribution_test(llm, tiny_llama_dir, temperature=1.0)
    assert llm.collective_rpc(read_drafting_stats)[0]["fuzzy_forwards"] > before
    assert result.p_value >= ALPHA, (
        f"chi2={result.statistic:.1f} dof={result.degrees_of_freedom} p={result.p_value:.2e}"
    )


@pytest.mark.slow  # calibration "never" is an ablation
def test_greedy_fused_never_equals_vanilla(llm_pool, tiny_llama_dir, tiny_llama_draft_dir, vanilla_llama_tokens):
    llm = _fused_llama_engine(llm_pool, tiny_llama_dir, tiny_llama_draft_dir, "never")
    stats = _check_fuzzy_run(llm, vanilla_llama_tokens, "fused", expect_fuzzy_first=True)
    assert stats["fused_group_calls"] > 0


def test_never_calibration_keeps_fuzzy_draft_kv(llm_pool, tiny_llama_dir, tiny_llama_draft_dir, exact_draft_kv):
    """The same KV check fails without calibration: the second layer of each group holds fuzzy K/V."""
    llm = _fused_llama_engine(llm_pool, tiny_llama_dir, tiny_llama_draft_dir, "never")
    difference = _kv_difference_after_request(llm, exact_draft_kv)
    assert difference > 1e-3, f"never-calibrated KV unexpectedly exact (max difference {difference})"


@pytest.mark.slow
def test_greedy_fused_qwen2_draft_on_mismatch_equals_vanilla(
    llm_pool, tiny_llama_dir, tiny_qwen2_dir, vanilla_llama_tokens
):
    llm = llm_pool.get(
        tiny_llama_dir,
        speculative_config=_spec(tiny_qwen2_dir),
        additional_config=_easyspec(layer_parallel_size=3, calibration="on_mismatch"),
    )
    stats = _check_fuzzy_run(llm, vanilla_llama_tokens, "fused", expect_fuzzy_first=None)
    assert stats["groups"] == [[1, 2], [3, 4]]


@pytest.mark.parametrize(
    "mode", ["tensor_parallel", pytest.param("fused", marks=pytest.mark.slow)]
)
def test_greedy_two_ranks_equals_vanilla(
    llm_pool, monkeypatch, tiny_llama_dir, tiny_llama_draft_dir, vanilla_llama_tokens, mode
):
    """tensor_parallel: full draft on each rank, one layer of a group per rank, all-gather; fused at
    TP 2: head-sharded draft, one all-reduce per group. Both ranks must hold the same drafts."""
    for key, value in TP2_ENV.items():
        monkeypatch.setenv(key, value)
    llm = llm_pool.get(
        tiny_llama_dir,
        speculative_config=_spec(tiny_llama_draft_dir),
        additional_config=_easyspec(layer_parallel_size=2, mode=mode),
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    _check_fuzzy_run(llm, vanilla_llama_tokens, mode, expect_fuzzy_first=False)
    ranks = llm.collective_rpc(read_drafting_stats)
    assert len(ranks) == 2
    calls = "parallel_group_calls" if mode == "tensor_parallel" else "fused_group_calls"
    assert ranks[0][calls] == ranks[1][calls] > 0


# ---- unsupported architectures ---------------------------------------------------------------------------


def test_unsupported_architecture_error_names_it_and_the_fix():
    with pytest.raises(EasySpecConfigError) as info:
        check_fuzzy_architecture(["MixtralForCausalLM"])
    message = str(info.value)
    assert "MixtralForCausalLM is unsupported for fuzzy drafting" in message
    assert "layer_parallel_size to 1" in message
    check_fuzzy_architecture(["Qwen2ForCausalLM"])
    check_fuzzy_architecture(["LlamaForCausalLM"])


@pytest.mark.slow  # two stages in processes of their own; trees at two stages: tests/tree/test_engine_tree_pipeline.py
def test_greedy_two_stages_equals_vanilla(llm_pool, monkeypatch, tiny_llama_dir, tiny_llama_draft_dir,
                                          vanilla_llama_tokens):
    """EasySpec chains at pipeline-parallel size 2: the fused draft whole on the last stage, its drafts sent to the
    scheduler with the step's output (integration/pipeline_trees.py)."""
    for key, value in TP2_ENV.items():
        monkeypatch.setenv(key, value)
    llm = llm_pool.get(tiny_llama_dir, speculative_config=_spec(tiny_llama_draft_dir),
                       additional_config=_easyspec(layer_parallel_size=2, calibration="every_round", mode="fused"),
                       pipeline_parallel_size=2, distributed_executor_backend="mp", multiprocess=True)
    assert _greedy(llm) == vanilla_llama_tokens
    stages = llm.collective_rpc(read_drafting_stats)
    assert stages[0] is None and stages[1]["fuzzy_forwards"] > 0, stages
