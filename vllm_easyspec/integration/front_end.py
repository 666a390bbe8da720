"""The front end's seam, ``EngineArgs.create_engine_config``: the ``easyspec`` options are parsed once, a
tree fills in the engine arguments it fixes, bad options fail in the process the user started (one line that
names the field and the fix, before any engine process starts), and the resolved options are attached to the
engine's config (:mod:`~vllm_easyspec.integration.options`)."""

from __future__ import annotations

import functools

from vllm_easyspec.easyspec.config import EasySpecConfig, EasySpecConfigError, parse_easyspec_config
from vllm_easyspec.integration.compat import plugin_logger, vllm_release
from vllm_easyspec.integration.metrics import export_controller_metrics
from vllm_easyspec.integration.options import TREE_METHODS, EasySpecOptions, attach_options
from vllm_easyspec.tree.attention import FP8_KV_CACHE_DTYPES

logger = plugin_logger(__name__)


def install() -> None:
    from vllm.config.speculative import SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs

    if getattr(EngineArgs.create_engine_config, "_easyspec_patched", False):
        return
    # Replaces vllm.engine.arg_utils.EngineArgs.create_engine_config: same result, then our checks.
    EngineArgs.create_engine_config = _checked_create_engine_config(EngineArgs.create_engine_config)
    # Replaces vllm.config.speculative.SpeculativeConfig.verify_equal_vocab_size_if_draft_model:
    # same check, but the message names the option that fixes it.
    SpeculativeConfig.verify_equal_vocab_size_if_draft_model = _verify_equal_vocab_size


def _checked_create_engine_config(original):
    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = parse_easyspec_config(self.additional_config)
        prepare_tree_engine_args(self, config)
        vllm_config = original(self, *args, **kwargs)
        options = None if config is None else EasySpecOptions.resolve(config, vllm_config)
        validate_engine_config(vllm_config, options)
        attach_options(vllm_config, options)
        if options is not None and options.tree is not None and options.tree.auto is not None:
            export_controller_metrics(vllm_config)
        return vllm_config

    create_engine_config._easyspec_patched = True
    return create_engine_config


def prepare_tree_engine_args(engine_args, easyspec: EasySpecConfig | None) -> None:
    """With ``easyspec.tree`` (of the options ``easyspec`` parsed from ``engine_args``), fill in what a tree
    fixes before vLLM builds its config.

    ``num_speculative_tokens`` is the tree's node count (vLLM schedules one speculative token per node): it
    is set when absent and a different value is refused with an error naming both fields. Trees verify
    synchronously (the runner rewrites the step's inputs after sampling), so async scheduling is turned off.
    """
    if easyspec is None or easyspec.tree is None:
        return
    spec = engine_args.speculative_config
    method = None if not isinstance(spec, dict) else spec.get("method")
    if method not in TREE_METHODS:
        raise EasySpecConfigError(
            f"easyspec.tree needs --speculative-config with \"method\" one of {', '.join(TREE_METHODS)} (a draft "
            f"model, an EAGLE head or an MTP head drafts the tree), got method {method!r}; use one of those, or remove "
            "easyspec.tree"
        )
    rule = spec.get("rejection_sample_method")
    if rule in vllm_release().lossy_rejection_methods:  # tree steps would ignore it, chain steps apply it
        raise EasySpecConfigError(f"easyspec.tree verifies losslessly, but speculative_config.rejection_sample_method "
                                  f"{rule!r} accepts drafts the target would not sample; remove it (or set \"standard\" "
                                  "or \"block\"), or remove easyspec.tree")
    if method != "draft_model" and easyspec.is_fuzzy:
        raise EasySpecConfigError(
            f"easyspec.layer_parallel_size / layer_groups group a draft model's layers, but method {method!r} "
            "drafts with a one-layer EAGLE head; remove them, or use \"method\": \"draft_model\""
        )
    if easyspec.tree.retokenize and not (method == "draft_model" and spec.get("use_heterogeneous_vocab")):
        raise EasySpecConfigError(
            "easyspec.tree.retokenize bridges a draft and a target with different vocabularies, so it needs "
            f"\"method\": \"draft_model\" with \"use_heterogeneous_vocab\": true (got method {method!r}, "
            f"use_heterogeneous_vocab {spec.get('use_heterogeneous_vocab', False)}); set those or remove retokenize"
        )
    nodes = easyspec.tree.num_nodes
    given = spec.get("num_speculative_tokens")
    if given is None:
        engine_args.speculative_config = spec = dict(spec, num_speculative_tokens=nodes)
        logger.info("easyspec.tree has %d nodes: num_speculative_tokens set to %d", nodes, nodes)
    elif given != nodes:
        raise EasySpecConfigError(f"speculative_config.num_speculative_tokens = {given} but easyspec.tree "
                                  f"has {nodes} nodes ({easyspec.tree.describe()}); a tree verifies one "
                                  f"speculative token per node, so set num_speculative_tokens to {nodes} or "
                                  "leave it out")
    if spec.get("disable_padded_drafter_batch"):
        raise EasySpecConfigError(
            "easyspec.tree needs the padded drafter batch; remove \"disable_padded_drafter_batch\" from "
            "the speculative config"
        )
    if engine_args.async_scheduling:
        raise EasySpecConfigError("easyspec.tree verifies synchronously; remove --async-scheduling "
                                  "(async_scheduling=True)")
    engine_args.async_scheduling = False
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        # On GPUs the tree rows go through the plugin's subclass of TRITON_ATTN (the default until FLASH_ATTN's has
        # run on a GPU) or FLASH_ATTN, which serve every other row with vLLM's kernel (integration/gpu/).
        backend = engine_args.attention_backend
        name = getattr(backend, "name", backend)
        if name not in (None, *TREE_GPU_BACKENDS):
            raise EasySpecConfigError(f"easyspec.tree on a GPU needs one of the attention backends {TREE_GPU_BACKENDS}, "
                                      f"got {name}; remove --attention-backend or set it to one of them")
        engine_args.attention_backend = name or TREE_GPU_BACKENDS[0]


TREE_GPU_BACKENDS = ("TRITON_ATTN", "FLASH_ATTN")  # integration/gpu/attention_backend.py subclasses these


def validate_engine_config(vllm_config, options: EasySpecOptions | None) -> None:
    """Checks of the resolved options against the engine's config (the draft's layer groups and architecture
    were checked when ``options`` were resolved)."""
    if options is None:
        return
    spec = vllm_config.speculative_config
    if options.tree is not None and spec is not None and spec.method in TREE_METHODS:
        _validate_tree_engine_config(vllm_config, options.tree)
    drafts = options.drafts_with_draft_model or options.drafts_eagle_trees
    if drafts and vllm_config.use_v2_model_runner:
        raise EasySpecConfigError("additional_config.easyspec drafts through vLLM's V1 model runner, but "
                                  "this engine would run Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=0 "
                                  "(and drop features that force V2, such as watermarking), or remove "
                                  "additional_config.easyspec")
    if not drafts:
        logger.warning(
            "additional_config.easyspec is set but speculative decoding is not method 'draft_model' "
            "(got %s); the EasySpec options have no effect. Add --speculative-config "
            "'{\"method\": \"draft_model\", \"model\": DRAFT, \"num_speculative_tokens\": K}'.",
            None if spec is None else spec.method,
        )


def _validate_tree_engine_config(vllm_config, tree) -> None:
    """What a token tree needs from the target engine, whichever drafter drafts it."""
    scheduler = vllm_config.scheduler_config
    level_rows = scheduler.max_num_seqs * tree.widest_frontier
    if level_rows > scheduler.max_num_batched_tokens:  # a level's rows go through the drafter's token buffers
        raise EasySpecConfigError(f"easyspec.tree drafts up to {tree.widest_frontier} nodes per request in one "
                                  f"forward, {level_rows} rows at --max-num-seqs {scheduler.max_num_seqs}, more "
                                  f"than --max-num-batched-tokens {scheduler.max_num_batched_tokens}; raise "
                                  f"--max-num-batched-tokens to {level_rows} or lower --max-num-seqs")
    draft = getattr(vllm_config.speculative_config, "draft_model_config", None)
    dp_size = vllm_config.parallel_config.data_parallel_size
    if dp_size > 1 and vllm_config.model_config.is_moe and draft is not None and draft.is_moe:
        raise EasySpecConfigError(f"easyspec.tree at --data-parallel-size {dp_size} needs a draft without MoE layers: "
                                  "an MoE draft's forwards meet the other ranks', which run vLLM's chain drafting "
                                  "when idle, and a tree drafts one forward per level; use a dense draft or an "
                                  "EAGLE head, or remove easyspec.tree")
    kv_cache_dtype = vllm_config.cache_config.cache_dtype
    # both tree paths read fp8 caches as vLLM's kernels do (integration/cpu/kv_layout.py, kernels/tree_attention.py)
    readable = ("auto", None, *FP8_KV_CACHE_DTYPES)
    if kv_cache_dtype not in readable:
        raise EasySpecConfigError(f"easyspec.tree reads the paged KV cache for tree attention, in "
                                  f"{', '.join(filter(None, readable))} caches, but --kv-cache-dtype "
                                  f"is {kv_cache_dtype!r}; remove --kv-cache-dtype or easyspec.tree")


def _verify_equal_vocab_size(self) -> None:
    if self.method != "draft_model" or self.target_model_config is None or self.draft_model_config is None:
        return
    target_vocab = self.target_model_config.get_vocab_size()
    draft_vocab = self.draft_model_config.get_vocab_size()
    if target_vocab != draft_vocab:
        raise ValueError(
            f"speculative_config: the draft's vocabulary ({draft_vocab} tokens) differs from the target's "
            f"({target_vocab} tokens); set \"use_heterogeneous_vocab\": true in the speculative config to "
            "draft across vocabularies, or use a draft that shares the target's tokenizer"
        )
