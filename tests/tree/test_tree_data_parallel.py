"""Tree engines under data parallelism (MoE targets, whose ranks meet in every forward): each drafting stage
coordinates with the other ranks exactly as often as vLLM's ``dummy_run`` does on a rank without requests
(``PluginProposerMixin.dp_stage``), and an MoE draft is refused at start-up. The engine test is
tests/test_serve_data_parallel.py (slow)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_easyspec.integration.proposers import DP_SYNCS_PER_STAGE, PluginProposerMixin


class _VllmProposer:
    """vLLM's side: every coordination is an all-reduce with the other ranks; its dummy_run coordinates its first
    two forwards (``SpecDecodeBaseProposer.dummy_run``)."""

    def __init__(self, dp_size: int, num_speculative_tokens: int) -> None:
        self.coordinated: list[int] = []
        self.num_speculative_tokens = num_speculative_tokens
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=dp_size,
                                                                                pipeline_parallel_size=1))
        self.cudagraph_dispatcher = SimpleNamespace(
            dispatch=lambda num_tokens, valid_modes=None: ("eager", SimpleNamespace(num_tokens=num_tokens)))

    def _determine_batch_execution_and_padding(self, num_tokens: int, use_cudagraphs: bool = True):
        self.coordinated.append(num_tokens)
        return "eager", num_tokens, "synced"

    def dummy_run(self, num_tokens: int, **_) -> None:
        for forward in range(self.num_speculative_tokens):
            if forward <= 1:
                self._determine_batch_execution_and_padding(num_tokens)


class _Proposer(PluginProposerMixin, _VllmProposer):
    tree_drafting = object()


@pytest.mark.parametrize("levels", [0, 1, 2, 3, 5])
def test_a_drafting_stage_coordinates_as_often_as_an_idle_ranks_dummy_run(levels):
    busy, idle = _Proposer(dp_size=2, num_speculative_tokens=6), _Proposer(dp_size=2, num_speculative_tokens=6)
    with busy.dp_stage():
        results = [busy._determine_batch_execution_and_padding(8 * (level + 1)) for level in range(levels)]
    idle.dummy_run(1)
    assert len(busy.coordinated) == len(idle.coordinated) == DP_SYNCS_PER_STAGE
    assert busy.coordinated[:levels] == [8, 16][:levels]  # the first two levels are the ones the ranks agree on
    for level, (_, padded, sizes) in enumerate(results[DP_SYNCS_PER_STAGE:], start=DP_SYNCS_PER_STAGE):
        assert padded == 8 * (level + 1) and sizes.tolist() == [padded, padded]  # padded locally
    assert busy.dp_syncs is None  # outside a stage, vLLM's own


def test_an_idle_rank_coordinates_twice_even_after_a_one_token_chain():
    idle = _Proposer(dp_size=2, num_speculative_tokens=1)  # vLLM's propose left it at a {"chain": 1} step's 1
    idle.dummy_run(1)
    assert len(idle.coordinated) == DP_SYNCS_PER_STAGE


def test_without_data_parallelism_nothing_changes():
    alone = _Proposer(dp_size=1, num_speculative_tokens=6)
    with alone.dp_stage():
        for level in range(3):
            alone._determine_batch_execution_and_padding(level + 1)
    alone.dummy_run(1)
    assert alone.coordinated == [1, 2, 3, 1, 1]


def test_an_moe_draft_is_refused_under_data_parallelism(tiny_moe_dir, tiny_llama_draft_dir):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_easyspec.easyspec.config import EasySpecConfigError

    def config(draft, dp_size):
        return EngineArgs(model=str(tiny_moe_dir), data_parallel_size=dp_size,
                          speculative_config={"method": "draft_model", "model": str(draft)},
                          additional_config={"easyspec": {"tree": {"top_k": 2, "depth": 2, "budget": 4}}},
                          ).create_engine_config()

    with pytest.raises(EasySpecConfigError, match="easyspec.tree at --data-parallel-size 2 needs a draft without "
                                                  "MoE layers: .* use a dense draft or an EAGLE head"):
        config(tiny_moe_dir, 2)
    config(tiny_llama_draft_dir, 2)
    config(tiny_moe_dir, 1)
