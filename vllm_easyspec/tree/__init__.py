"""Token-tree speculation components that need no running engine.

* :mod:`.building`: the batched tree object (:class:`TokenTreeBatch`), static tree templates (choice lists) and
  the EAGLE-2 dynamic builder.
* :mod:`.sampling`: the lossless tree rejection sampler (vLLM chain-shaped output).
* :mod:`.attention`: the engine's CPU tree attention.
* :mod:`.compaction`: moves accepted nodes' K/V to linear slots after verification.

Layout conventions shared by all of them: the :mod:`.building` module docstring.
"""

from .building import (
    MAX_TREE_NODES,
    ChildDrawMode,
    DynamicTopKTreeBuilder,
    StaticTreeTemplate,
    TokenTreeBatch,
)
from .compaction import compact_kv, tree_compaction_slots
from .sampling import TreeSamplerOutput, apply_sampling_constraints, tree_rejection_sample

__all__ = [
    "MAX_TREE_NODES",
    "ChildDrawMode",
    "DynamicTopKTreeBuilder",
    "StaticTreeTemplate",
    "TokenTreeBatch",
    "TreeSamplerOutput",
    "apply_sampling_constraints",
    "compact_kv",
    "tree_compaction_slots",
    "tree_rejection_sample",
]
