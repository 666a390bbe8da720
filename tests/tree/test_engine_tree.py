"""Token trees through a real vLLM engine on tiny float32 models (issue 11).

- greedy output with trees equals output without speculation, token for token, on Llama, Qwen2 and
  Mixtral targets, static and dynamic trees, exact (N=1) and fuzzy (N=2) drafting, at batch 1 and in a
  mixed batch of 8 (different prompt lengths, stop strings, EOS, max_tokens);
- with the target as its own draft, every depth of the tree's top-1 path is accepted in a mixed batch (each
  frontier row of a draft level forward has its own position);
- prompt-lookup candidates merged into the trees are accepted and outputs stay exact;
- the tree size follows the batch (``budget_by_batch``) without changing outputs;
- after a tree run the target's KV cache holds the verified chain (the accepted branches were moved);
- requests with structured output and penalties beside min_tokens and sampled ones are speculated and equal
  vanilla (tests/tree/test_engine_tree_options.py has each option);
- aborted requests, preemption and recomputation, and trees cut short by the token budget;
- a drafter that raises costs its steps their drafts, never the engine, and outputs stay exact;
- EasySpec's tensor_parallel mode drafts trees on 2 ranks.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from tests.kv_inspection import (
    assert_same_kv,
    deferral_expected,
    deferral_run,
    read_target_kv,
    start_recording_block_tables,
)
from tests.request_batches import MIXED, SINGLE, generate
from vllm_easyspec.instruments.metrics import read_spec_decode_counters
from vllm_easyspec.instruments.worker_extension import read_drafting_stats, read_tree_stats

STATIC = {"choices": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]}
DYNAMIC = {"top_k": 3, "depth": 3, "budget": 8}
TREES = {"static": STATIC, "dynamic": DYNAMIC}
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}

def _spec(draft_dir) -> dict:
    return {"method": "draft_model", "model": str(draft_dir)}  # num_speculative_tokens follows the tree


def _tree(shape: str, **options) -> dict:
    return {"easyspec": {"tree": TREES[shape]} | options}


_VANILLA: dict[str, dict[str, list]] = {}


def _vanilla(llm_pool, target, name: str, requests) -> list:
    cache = _VANILLA.setdefault(str(target), {})
    if name not in cache:
        cache[name] = generate(llm_pool.get(target), requests)
    return cache[name]


CASES = [
    ("tree_llama_dir", "static", 1),
    ("tree_llama_dir", "dynamic", 2),
    ("tree_qwen2_dir", "static", 2),
    ("tree_qwen2_dir", "dynamic", 1),
    ("tree_moe_dir", "dynamic", 2),
    ("tree_moe_dir", "static", 1),
]
# the static tree's greedy equality stays in the default suite through the fall-back and draft-equals-target tests
SLOW_CASES = {("tree_qwen2_dir", "dynamic", 1), ("tree_moe_dir", "static", 1), ("tree_qwen2_dir", "static", 2),
              ("tree_llama_dir", "static", 1)}


@pytest.mark.parametrize(("target_fixture", "shape", "n"), [
    pytest.param(*case, id=f"{case[0][5:-4]}-{case[1]}-N{case[2]}",
                 marks=[pytest.mark.slow] if case in SLOW_CASES else []) for case in CASES
])
def test_greedy_trees_equal_vanilla(llm_pool, request, tiny_llama_draft_dir, target_fixture, shape, n):
    target = request.getfixturevalue(target_fixture)
    single, mixed = _vanilla(llm_pool, target, "single", SINGLE), _vanilla(llm_pool, target, "mixed", MIXED)
    llm = llm_pool.get(target, speculative_config=_spec(tiny_llama_draft_dir),
                       additional_config=_tree(shape, layer_parallel_size=n))
    assert generate(llm, SINGLE) == single
    assert generate(llm, MIXED) == mixed
    counters = read_spec_decode_counters(llm)
    stats = llm.collective_rpc(read_tree_stats)[0]
    # Trees were verified, some nodes accepted and some not, at more than one depth.
    assert stats["steps"] > 0 and stats["chain_fallbacks"] == 0
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert 0 < counters.num_draft_tokens <= stats["nodes_verified"]  # vLLM publishes counters with a lag
    assert len([a for a in counters.accepted_per_position if a]) >= 2
    drafting = llm.collective_rpc(read_drafting_stats)[0]
    if n > 1:
        assert drafting["fuzzy_forwards"] > 0 and drafting["exact_forwards"] > 0


def test_a_draft_equal_to_the_target_gets_its_whole_top_path_accepted_in_a_batch(llm_pool, tree_llama_dir):
    """With the target as its own draft (float32), the tree's top-1 path is the target's greedy path, so every
    depth of it is accepted in every step, alone and in the mixed batch of 8. Each level forward must give
    every frontier row its own position ``P + depth``; a row with another request's position (or with a
    position read past the end of the positions tensor) drafts children the target rejects."""
    vanilla = _vanilla(llm_pool, tree_llama_dir, "mixed", MIXED)  # before the engine whose counters are read
    llm = llm_pool.get(tree_llama_dir, speculative_config=_spec(tree_llama_dir), additional_config=_tree("static"))
    before = read_spec_decode_counters(llm)
    assert generate(llm, MIXED) == vanilla
    counters = read_spec_decode_counters(llm) - before
    depth = 3  # the static tree's top-1 path: [0], [0, 0], [0, 0, 0]
    assert counters.num_drafts > len(MIXED)
    assert counters.accepted_per_position[:depth] == (counters.num_drafts,) * depth


@pytest.mark.parametrize("choices", [
    [[0], [1], [0, 0]],
    # lookup merged into a branching tree stays in the default suite (here and tests/tree/test_engine_auto.py)
    pytest.param([[0], [0, 0], [0, 0, 0]], marks=pytest.mark.slow),
], ids=["branching", "path"])
def test_prompt_lookup_nodes_merged_into_trees_are_accepted_and_exact(llm_pool, tree_llama_dir, tiny_llama_draft_dir,
                                                                     choices):
    """``sources.prompt_lookup`` merges the continuation of the latest earlier n-gram match into every tree.
    The tiny target's greedy outputs fall into loops, which lookup predicts, so merged nodes get accepted
    (they would not, with a wrong history); outputs still equal vanilla's in a mixed batch. Merged into a
    drafted path, lookup branches some requests' trees and leaves the others paths: one step then verifies
    paths through vLLM's kernel (their branch already in place) beside masked trees (their branch moved)."""
    vanilla = _vanilla(llm_pool, tree_llama_dir, "mixed", MIXED)
    tree = {"choices": choices, "sources": {"prompt_lookup": {"nodes": 4, "min_match": 1, "max_match": 3}}}
    llm = llm_pool.get(tree_llama_dir, speculative_config=_spec(tiny_llama_draft_dir),
                       additional_config={"easyspec": {"tree": tree}})
    before = llm.collective_rpc(read_tree_stats)[0]
    assert generate(llm, MIXED) == vanilla
    stats = llm.collective_rpc(read_tree_stats)[0]
    added = stats["source_nodes"] - before["source_nodes"]
    accepted = stats["source_nodes_accepted"] - before["source_nodes_accepted"]
    assert stats["chain_fallbacks"] == 0
    assert 0 < accepted <= stats["accepted"] - before["accepted"] and 0 < accepted <= added
    if choices[1] == [0, 0]:
        paths = stats["path_requests"] - before["path_requests"]
        assert 0 < paths < stats["tree_requests"] - before["tree_requests"]


def test_tree_size_follows_the_batch_and_outputs_stay_exact(llm_pool, tree_llama_dir, tiny_llama_draft_dir):
    """``budget_by_batch``: alone a request verifies whole trees; from 2 running requests on one node each,
    from 4 on a top-1 chain of 2 (vLLM's own chain verify), from 6 on none. Switching size between steps
    keeps every output equal to vanilla."""
    single, mixed = _vanilla(llm_pool, tree_llama_dir, "single", SINGLE), _vanilla(llm_pool, tree_llama_dir, "mixed", MIXED)
    tree = STATIC | {"budget_by_batch": {"2": 1, "4": {"chain": 2}, "6": 0}}
    llm = llm_pool.get(tree_llama_dir, speculative_config=_spec(tiny_llama_draft_dir),
                       additional_config={"easyspec": {"tree": tree}})
    nodes = len(STATIC["choices"])
    before = llm.collective_rpc(read_tree_stats)[0]
    assert generate(llm, SINGLE) == single
    alone = llm.collective_rpc(read_tree_stats)[0]
    assert alone["last_node_limit"] == nodes and alone["steps_without_speculation"] == 0
    assert alone["nodes_verified"] - before["nodes_verified"] == nodes * (alone["tree_requests"] - before["tree_requests"]) > 0
    assert generate(llm, MIXED) == mixed
    batched = llm.collective_rpc(read_tree_stats)[0]
    tree_requests = batched["tree_requests"] - alone["tree_requests"]
    chain_requests = batched["chain_requests"] - alone["chain_requests"]
    assert batched["steps_without_speculation"] > 0  # eight requests start together
    # the steps after them verify no drafts: vLLM's plain sampler serves them (as it serves prefill steps)
    without_drafts = batched["steps_without_drafts"] - alone["steps_without_drafts"]
    assert without_drafts >= batched["steps_without_speculation"] - alone["steps_without_speculation"] - 1 > 0
    assert batched["chain_steps"] > alone["chain_steps"] and chain_requests >= 4
    assert 0 < batched["nodes_verified"] - alone["nodes_verified"] < 2 * (tree_requests + chain_requests)


@pytest.mark.slow  # the same catch-up for the EAGLE head: tests/eagle/test_eagle_tree.py, default suite
def test_deferred_first_passes_catch_up_the_draft_kv(llm_pool, tree_llama_dir, tiny_llama_draft_dir):
    """``budget_by_batch`` gives no nodes from 2 running requests on: while a short request runs beside a long
    one, no step drafts and the drafter's first passes wait; once the long one runs alone, its next first pass
    catches them up. Its draft KV at every position then equals that of an engine that never skipped (stale or
    misplaced K/V would differ), and both outputs equal vanilla's."""
    def engine(tree: dict):
        return llm_pool.get(tree_llama_dir, speculative_config=_spec(tiny_llama_draft_dir),
                            additional_config={"easyspec": {"tree": tree}})

    expected = deferral_expected(llm_pool.get(tree_llama_dir))
    reference, reference_skips = deferral_run(engine(STATIC), expected, "always")
    deferred, skips = deferral_run(engine(STATIC | {"budget_by_batch": {"2": 0}}), expected, "deferred")
    assert reference_skips == 0 and skips >= 5  # the two requests ran side by side, drafting nothing
    assert_same_kv(deferred, reference)


def test_target_kv_after_trees_is_the_verified_chain(llm_pool, tree_llama_dir, tiny_llama_draft_dir):
    """Accepted branches are moved to linear slots: the target KV equals a chain engine's, position by
    position (it would hold rejected siblings' K/V or wrong RoPE positions otherwise)."""
    prompt = [[1] + [3 + (j * 11) % 60 for j in range(20)]]

    def target_kv(additional_config):
        llm = llm_pool.get(tree_llama_dir, speculative_config=_spec(tiny_llama_draft_dir) | {"num_speculative_tokens": 8},
                           additional_config=additional_config)
        llm.collective_rpc(start_recording_block_tables)
        ((tokens, _, _),) = generate(llm, [(prompt[0], {"max_tokens": 30, "ignore_eos": True})])
        return tokens, llm.collective_rpc(read_target_kv, args=(len(prompt[0]) + len(tokens) - 1,))[0]

    chain_tokens, chain_kv = target_kv({"easyspec": {}})
    tree_tokens, tree_kv = target_kv(_tree("static"))
    assert tree_tokens == chain_tokens
    assert chain_kv.keys() == tree_kv.keys() and chain_kv
    for name in chain_kv:
        for part in ("key", "value"):
            torch.testing.assert_close(tree_kv[name][part], chain_kv[name][part], atol=1e-5, rtol=1e-5)


def _structured(**constraint):
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(**constraint)


OPTION_REQUESTS = [
    ([1, 5, 9, 13, 17], {"max_tokens": 30, "ignore_eos": True}),
    ([1, 60, 3, 3, 3, 3, 3, 21], {"max_tokens": 30, "ignore_eos": True, "repetition_penalty": 1.6}),
    ([1, 7, 8], {"max_tokens": 20, "structured_outputs": _structured(regex="(w1[0-9]|w2[0-9])+")}),
    ([1, 40, 41, 42], {"max_tokens": 25, "ignore_eos": True, "presence_penalty": 1.0, "frequency_penalty": 0.5}),
    ([1, 33, 17, 50], {"max_tokens": 25, "structured_outputs": _structured(choice=["w5w9w13w17", "w20w21"])}),
    ([1, 12, 13], {"max_tokens": 15, "min_tokens": 10}),  # trees mask stop tokens by depth themselves
    ([1, 21, 22, 23], {"max_tokens": 20, "ignore_eos": True, "temperature": 0.8, "seed": 3}),  # sampled, beside greedy ones
    ([1, 30, 31], {"max_tokens": 20, "ignore_eos": True, "temperature": 1.0, "top_k": 5, "top_p": 0.9}),
]
SAMPLED = {6, 7}  # their outputs are random draws; the greedy requests beside them must equal vanilla


def test_requests_with_options_beside_min_tokens_and_sampled_ones_equal_vanilla(llm_pool, tree_llama_dir,
                                                                                tiny_llama_draft_dir):
    """A mixed batch: plain greedy requests, structured output and penalties (per node), a min_tokens request and
    sampled requests (temperature, top-k, top-p, seed) together; none falls back, and every deterministic output
    equals vanilla's."""
    expected = _vanilla(llm_pool, tree_llama_dir, "options", OPTION_REQUESTS)
    llm = llm_pool.get(tree_llama_dir, speculative_config=_spec(tiny_llama_draft_dir),
                       additional_config=_tree("static", layer_parallel_size=1))
    before = llm.collective_rpc(read_tree_stats)[0]
    outputs = generate(llm, OPTION_REQUESTS)
    for index, (output, reference) in enumerate(zip(outputs, expected, strict=True)):
        if index in SAMPLED:
            assert len(output[0]) == OPTION_REQUESTS[index][1]["max_tokens"]
        else:
            assert output == reference, index
    assert outputs[4][1].split() in (["w5", "w9", "w13", "w17"], ["w20", "w21"]) and all(10 <= t < 30 for t in outputs[2][0][:-1])
    after = llm.collective_rpc(read_tree_stats)[0]
    assert after["requests_without_speculation"] == before["requests_without_speculation"]
    assert after["tree_requests"] > before["tree_requests"]


def test_aborted_requests_leave_the_others_exact(llm_pool, tree_llama_dir, tiny_llama_draft_dir):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    expected = _vanilla(llm_pool, tree_llama_dir, "mixed", MIXED)
    llm = llm_pool.get(tree_llama_dir, speculative_config=_spec(tiny_llama_draft_dir),
                       additional_config=_tree("static", layer_parallel_size=1))
    engine = llm.llm_engine
    for index, (prompt, options) in enumerate(MIXED):
        engine.add_request(f"abort-{index}", TokensPrompt(prompt_token_ids=prompt),
                           SamplingParams(temperature=0.0, **options))
    finished, steps = {}, 0
    aborted = ["abort-0", "abort-5"]
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
        steps += 1
        if steps == 3:
            engine.abort_request(aborted)
    for index, (tokens, _, _) in enumerate(expected):
        if f"abort-{index}" not in aborted:
            assert finished[f"abort-{index}"] == tokens


def fail_drafting_calls(worker, calls: tuple[int, ...]) -> None:
    """The worker's drafter raises at its ``calls``-th ``propose`` calls from now (1 = the next one)."""
    drafter = worker.model_runner.drafter
    original = drafter.propose
    counter = itertools.count(1)

    def propose(*args, **kwargs):
        if next(counter) in calls:
            raise RuntimeError("drafter fault injected by the test")
        return original(*args, **kwargs)

    drafter.propose = propose


def failed_drafting_steps(worker) -> int:
    """The runner's count of steps whose drafter raised."""
    return worker.model_runner.failed_drafting_steps


def drafting_fault_counts(worker) -> tuple[int, int]:
    """The runner's counts of steps whose drafter raised and of steps whose drafter it paused."""
    return worker.model_runner.failed_drafting_steps, worker.model_runner.paused_drafting_steps


def restore_drafting(worker) -> int:
    """Undo :func:`fail_drafting_calls` (the pause it left behind included, for the next test on this pooled
    engine); the runner's count of steps whose drafter raised."""
    runner = worker.model_runner
    del runner.drafter.propose  # the instance attribute: the class's propose again
    runner._drafting_pause = runner._failures_in_a_row = 0
    return failed_drafting_steps(worker)


def test_a_drafter_that_raises_costs_its_steps_their_drafts_not_the_engine(
    llm_pool, tree_llama_dir, tiny_llama_draft_dir
):
    expected = _vanilla(llm_pool, tree_llama_dir, "mixed", MIXED)
    llm = llm_pool.get(tree_llama_dir, speculative_config=_spec(tiny_llama_draft_dir),
                       additional_config=_tree("static", layer_parallel_size=1))
    failed_before = llm.collective_rpc(failed_drafting_steps)[0]
    before = llm.collective_rpc(read_tree_stats)[0]
    llm.collective_rpc(functools.partial(fail_drafting_calls, calls=(2, 3, 5)))
    try:
        outputs = generate(llm, MIXED)
    finally:
        failed = llm.collective_rpc(restore_drafting)[0] - failed_before
    assert outputs == expected
    assert failed == 3
    after = llm.collective_rpc(read_tree_stats)[0]
    assert after["tree_requests"] > before["tree_requests"]  # the steps between the faults drafted trees
    assert generate(llm, MIXED) == expected  # and the engine serves on


def test_a_drafter_that_raises_every_step_is_tried_a_few_times_not_every_step(
    llm_pool, tree_llama_dir, tiny_llama_draft_dir
):
    expected = _vanilla(llm_pool, tree_llama_dir, "mixed", MIXED)
    llm = llm_pool.get(tree_llama_dir, speculative_config=_spec(tiny_llama_draft_dir),
                       additional_config=_tree("static", layer_parallel_size=1))
    failed_before, paused_before = llm.collective_rpc(drafting_fault_counts)[0]
    llm.collective_rpc(functools.partial(fail_drafting_calls, calls=tuple(range(1, 10_000))))
    try:
        outputs = generate(llm, MIXED)
        failed, paused = (after - before for after, before in
                          zip(llm.collective_rpc(drafting_fault_counts)[0], (failed_before, paused_before)))
    finally:
        llm.collective_rpc(restore_drafting)
    assert outputs == expected
    # the k-th failure in a row pauses the drafter for 2^(k-1) - 1 steps: k failures cover 2^k - 1 steps
    steps = failed + paused
    assert steps > 8 and 0 < failed <= steps.bit_length() < steps
    assert generate(llm, MIXED) == expected  # restored: the engine drafts and serves on


@pytest.mark.parametrize(
    ("engine_options", "expect"),
    [
        ({"num_gpu_blocks_override": 6, "max_num_batched_tokens": 64}, "preemption"),
        ({"max_num_batched_tokens": 24}, "truncated trees"),
    ],
    ids=["six-kv-blocks", "token-budget-24"],
)
def test_preemption_and_truncated_trees_keep_outputs_exact(
    llm_pool, tree_llama_dir, tiny_llama_draft_dir, engine_options, expect
):
    """Six KV blocks of 32 tokens force preemption and recomputation; a token budget of 24 makes the
    scheduler cut trees short (a prefix of a tree is a tree)."""
    expected = _vanilla(llm_pool, tree_llama_dir, "mixed", MIXED)
    llm = llm_pool.get(tree_llama_dir, speculative_config=_spec(tiny_llama_draft_dir),
                       additional_config=_tree("dynamic", layer_parallel_size=1),
                       block_size=32, max_model_len=128, max_num_seqs=8, **engine_options)
    assert generate(llm, MIXED) == expected
    stats = llm.collective_rpc(read_tree_stats)[0]
    assert stats["steps"] > 0
    if expect == "preemption":
        assert sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions") > 0
    else:
        assert stats["truncated_trees"] > 0


@pytest.mark.slow  # EasySpec's tensor_parallel mode on two ranks: tests/easyspec covers it for chains
def test_tensor_parallel_mode_drafts_trees_on_two_ranks(llm_pool, monkeypatch, tree_llama_dir, tiny_llama_draft_dir):
    expected = _vanilla(llm_pool, tree_llama_dir, "single", SINGLE)
    for key, value in TP2_ENV.items():
        monkeypatch.setenv(key, value)
    llm = llm_pool.get(tree_llama_dir, speculative_config=_spec(tiny_llama_draft_dir),
                       additional_config=_tree("static", layer_parallel_size=2, mode="tensor_parallel"),
                       tensor_parallel_size=2, distributed_executor_backend="mp")
    assert generate(llm, SINGLE) == expected
    ranks = llm.collective_rpc(read_drafting_stats)
    assert ranks[0]["parallel_group_calls"] == ranks[1]["parallel_group_calls"] > 0
    trees = llm.collective_rpc(read_tree_stats)
    assert trees[0] == trees[1] and trees[0]["steps"] > 0
