"""Token trees at pipeline-parallel size 2 (issue 70, item 3): two stages, one core each, vLLM's multiprocessing
executor. The last stage drafts and samples; the earlier stage verifies each tree over its own layers from the parents
the scheduler sends it and commits the accepted branch the next step brings (integration/pipeline_trees.py). Greedy
output equals vanilla's at one stage (vanilla PP 2 equals PP 1: tests/test_engine_pipeline.py), both stages verified
the same trees, and branch nodes off the top path were accepted."""

from __future__ import annotations

import pytest

from tests.request_batches import MIXED, SINGLE, generate
from tests.tree.test_engine_tree_tp import TP2_ENV, two_rank_tree_engine
from vllm_easyspec.instruments.worker_extension import read_tree_stats


def pp2_tree_engine(llm_pool, monkeypatch, target, speculative_config: dict, tree: dict):
    return two_rank_tree_engine(llm_pool, monkeypatch, target, speculative_config, tree, pipeline_parallel_size=2)


def assert_both_stages_verified_trees(llm) -> dict:
    first, last = llm.collective_rpc(read_tree_stats)
    assert last["steps"] > 0 and last["off_top_path_branches"] > 0, last
    same = ("steps", "tree_requests", "nodes_verified", "path_requests")
    assert {key: first[key] for key in same} == {key: last[key] for key in same}, (first, last)
    return last


def test_draft_model_trees_at_pp2_equal_vanilla(llm_pool, monkeypatch, tree_llama_dir, tiny_llama_draft_dir):
    vanilla = llm_pool.get(tree_llama_dir)
    expected = generate(vanilla, SINGLE) + generate(vanilla, MIXED)
    llm = pp2_tree_engine(llm_pool, monkeypatch, tree_llama_dir,
                          {"method": "draft_model", "model": str(tiny_llama_draft_dir)},
                          {"top_k": 3, "depth": 3, "budget": 8})
    assert generate(llm, SINGLE) + generate(llm, MIXED) == expected
    assert_both_stages_verified_trees(llm)


@pytest.mark.slow  # one source per layout in the default suite (the dynamic tree above)
def test_trees_merged_with_prompt_lookup_at_pp2_equal_vanilla(llm_pool, monkeypatch, tree_llama_dir,
                                                               tiny_llama_draft_dir):
    vanilla = llm_pool.get(tree_llama_dir)
    expected = generate(vanilla, SINGLE) + generate(vanilla, MIXED)
    llm = pp2_tree_engine(llm_pool, monkeypatch, tree_llama_dir,
                          {"method": "draft_model", "model": str(tiny_llama_draft_dir)},
                          {"top_k": 2, "depth": 2, "budget": 4,
                           "sources": {"prompt_lookup": {"nodes": 4, "min_match": 1}}})
    assert generate(llm, SINGLE) + generate(llm, MIXED) == expected
    assert assert_both_stages_verified_trees(llm)["source_nodes_accepted"] > 0


@pytest.mark.slow
def test_auto_trees_at_pp2_equal_vanilla(llm_pool, monkeypatch, tree_llama_dir, tiny_llama_draft_dir):
    """``tree.auto``: both stages time their layers' part of each verify row count at start-up (summed), the last
    stage's controller sizes the trees, the earlier stage verifies whatever it chose."""
    from vllm_easyspec.instruments.worker_extension import read_controller_stats

    vanilla = llm_pool.get(tree_llama_dir)
    expected = generate(vanilla, SINGLE) + generate(vanilla, MIXED)
    llm = pp2_tree_engine(llm_pool, monkeypatch, tree_llama_dir,
                          {"method": "draft_model", "model": str(tiny_llama_draft_dir)},
                          {"top_k": 2, "depth": 3, "budget": 6, "auto": True})
    assert llm.collective_rpc(drafting_costs_nothing_on_the_last_stage) == [False, True]
    assert generate(llm, SINGLE) + generate(llm, MIXED) == expected
    assert assert_both_stages_verified_trees(llm)["accepted"] > 0
    first, last = llm.collective_rpc(read_controller_stats)
    assert first is None and last["nodes_chosen"] > 0
    assert last["verify_curve"]["rows"][:2] == [1, 2] and all(t > 0 for t in last["verify_curve"]["seconds"])


def drafting_costs_nothing_on_the_last_stage(worker) -> bool:
    """Worker-side: the last stage's controller drafts as if drafting were free (tests/controller_costs.py: a tiny
    draft costs what its tiny target does, so the controller rightly drafts little); the earlier stage has none."""
    from tests.controller_costs import drafting_costs_nothing

    return worker.model_runner.tree_verifier.policy.controller is not None and drafting_costs_nothing(worker)


@pytest.mark.slow
def test_trees_bridged_by_text_at_pp2_equal_vanilla(llm_pool, monkeypatch, byte_level_pair):
    target, draft = byte_level_pair
    vanilla = llm_pool.get(target)
    expected = generate(vanilla, SINGLE) + generate(vanilla, MIXED)
    llm = pp2_tree_engine(llm_pool, monkeypatch, target,
                          {"method": "draft_model", "model": str(draft), "use_heterogeneous_vocab": True},
                          {"choices": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], "retokenize": True})
    assert generate(llm, SINGLE) + generate(llm, MIXED) == expected
    assert_both_stages_verified_trees(llm)


@pytest.mark.slow  # a server with two stage workers
def test_trees_at_pp2_through_the_server_equal_vanilla(tmp_path, llm_pool, tree_llama_dir, tiny_llama_draft_dir):
    """``vllm-easyspec serve --pipeline-parallel-size 2`` with a draft-model tree: the mixed batch as concurrent
    completions, each text equal to vanilla ``LLM()``'s, drafts accepted (vLLM's counters)."""
    import json
    import os
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from tests.serving import free_port, post, serve_command, serving

    expected = generate(llm_pool.get(tree_llama_dir), MIXED)
    port = free_port()
    command = serve_command(tree_llama_dir, port, "--pipeline-parallel-size", "2",
                            "--distributed-executor-backend", "mp", "--speculative-config",
                            json.dumps({"method": "draft_model", "model": str(tiny_llama_draft_dir)}),
                            "--additional-config", json.dumps({"easyspec": {"tree": {"top_k": 3, "depth": 3,
                                                                                      "budget": 8}}}))
    model = str(tree_llama_dir)
    bodies = [{"model": model, "prompt": prompt, "temperature": 0.0} | options for prompt, options in MIXED]
    with serving(command, port, tmp_path / "serve.log", env=os.environ | TP2_ENV):
        with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
            completions = list(pool.map(lambda body: post(port, "/v1/completions", body), bodies))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            metrics = response.read().decode()
    texts = [(choice["text"], choice["finish_reason"]) for choice in (c["choices"][0] for c in completions)]
    assert texts == [(text, finish) for _, text, finish in expected]
    accepted = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0, accepted


@pytest.mark.slow
def test_preempted_and_truncated_trees_at_pp2_keep_outputs_exact(llm_pool, monkeypatch, tree_llama_dir,
                                                                  tiny_llama_draft_dir):
    """Six KV blocks of 32 tokens force preemption and recomputation while requests are in flight (a preempted
    request's drafts and moves are dropped: it recomputes into new blocks), and a token budget of 16 cuts trees
    short (the earlier stage gets the cut parents)."""
    vanilla = llm_pool.get(tree_llama_dir)
    expected = generate(vanilla, MIXED)
    for key, value in TP2_ENV.items():
        monkeypatch.setenv(key, value)
    llm = llm_pool.get(tree_llama_dir, speculative_config={"method": "draft_model", "model": str(tiny_llama_draft_dir)},
                       additional_config={"easyspec": {"tree": {"top_k": 3, "depth": 3, "budget": 8}}},
                       pipeline_parallel_size=2, distributed_executor_backend="mp", multiprocess=True,
                       block_size=32, max_model_len=128, max_num_seqs=3, num_gpu_blocks_override=6,
                       max_num_batched_tokens=16)
    assert generate(llm, MIXED) == expected
    preemptions = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    truncated = assert_both_stages_verified_trees(llm)["truncated_trees"]
    assert preemptions > 0 and truncated > 0, (preemptions, truncated)
