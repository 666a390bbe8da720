"""``additional_config["easyspec"]``, read once per engine process.

The front end (:mod:`~vllm_easyspec.integration.front_end`) parses and checks the user's options and records the
result, :class:`EasySpecOptions`, for that ``VllmConfig``; every seam reads it through :func:`easyspec_options`
(an engine process, with its own copy of the config, reads it the first time a seam asks).

Invariant: the options of one ``VllmConfig`` object are resolved once and never recomputed. They are kept
beside the config, not on it: vLLM copies its configs field by field (``vllm.config.utils.replace``) and
refuses attributes that are not fields.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from vllm_easyspec.easyspec.config import EasySpecConfig, parse_easyspec_config
from vllm_easyspec.easyspec.layer_grouping import LayerGrouping, resolve_layer_groups
from vllm_easyspec.tree.config import TreeConfig

# speculative methods whose drafter can draft trees, as given ("deepseek_mtp": vLLM's older name of "mtp")
TREE_METHODS = ("draft_model", "eagle", "eagle3", "mtp", "deepseek_mtp")
TREE_EAGLE_METHODS = ("eagle", "eagle3", "mtp")  # ... of which an EAGLE or MTP head (vLLM's EagleProposer) drafts them
# id(VllmConfig) -> (a reference to that config, its options); the entry goes when the config does
_RESOLVED: dict[int, tuple[Any, EasySpecOptions | None]] = {}


@dataclass(frozen=True)
class EasySpecOptions:
    """The validated ``easyspec`` options of one engine and what they resolve to against its config."""

    config: EasySpecConfig
    method: str | None  # the speculative method, None without speculative decoding
    layer_grouping: LayerGrouping | None  # a draft model's layer groups (method draft_model), else None
    across_vocabularies: bool  # a draft model with use_heterogeneous_vocab

    @property
    def tree(self) -> TreeConfig | None:
        return self.config.tree

    @property
    def is_fuzzy(self) -> bool:
        """A draft model drafts with fuzzy layer groups (EasySpec, ``layer_parallel_size`` > 1)."""
        return self.layer_grouping is not None and bool(self.layer_grouping.fuzzy_groups)

    @property
    def drafts_with_draft_model(self) -> bool:
        return self.method == "draft_model"

    @property
    def drafts_eagle_trees(self) -> bool:
        return self.tree is not None and self.method in TREE_EAGLE_METHODS

    @property
    def bridges_by_text(self) -> bool:
        """Trees cross vocabularies by text (:meth:`~vllm_easyspec.tree.config.TreeConfig.bridges_by_text`)."""
        return self.tree is not None and self.tree.bridges_by_text(self.across_vocabularies)

    @classmethod
    def resolve(cls, config: EasySpecConfig, vllm_config: Any) -> EasySpecOptions:
        """``config`` against ``vllm_config``: the draft model's layer groups (checked against its layer count,
        the tensor-parallel size and, for fuzzy groups, its architecture)."""
        spec = getattr(vllm_config, "speculative_config", None)
        method = None if spec is None else spec.method
        grouping = None
        if method == "draft_model":
            draft = spec.draft_model_config
            grouping = resolve_layer_groups(
                config,
                num_layers=draft.hf_text_config.num_hidden_layers,
                tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
            )
            if grouping.fuzzy_groups:
                from vllm_easyspec.integration.fuzzy_models import check_fuzzy_architecture

                check_fuzzy_architecture(draft.hf_config.architectures, draft.hf_text_config)
        across = method == "draft_model" and bool(spec.use_heterogeneous_vocab)
        return cls(config=config, method=method, layer_grouping=grouping, across_vocabularies=across)


def attach_options(vllm_config: Any, options: EasySpecOptions | None) -> None:
    """Make ``options`` the options of ``vllm_config`` in this process."""
    key = id(vllm_config)
    try:
        reference = weakref.ref(vllm_config, lambda _: _RESOLVED.pop(key, None))
    except TypeError:  # an object without weak references (a test's stand-in config): kept alive
        reference = lambda config=vllm_config: config  # noqa: E731
    _RESOLVED[key] = (reference, options)


def easyspec_options(vllm_config: Any) -> EasySpecOptions | None:
    """The engine's options, or None when the user did not ask for the plugin (module docstring)."""
    entry = _RESOLVED.get(id(vllm_config))
    if entry is None or entry[0]() is not vllm_config:
        config = parse_easyspec_config(getattr(vllm_config, "additional_config", None))
        attach_options(vllm_config, None if config is None else EasySpecOptions.resolve(config, vllm_config))
        entry = _RESOLVED[id(vllm_config)]
    return entry[1]


def tree_options(vllm_config: Any) -> TreeConfig | None:
    """The engine's tree, or None without ``easyspec.tree``."""
    options = easyspec_options(vllm_config)
    return None if options is None else options.tree

