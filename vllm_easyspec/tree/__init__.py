"""Token-tree speculation components that need no running engine.

* :mod:`.building`: the batched tree object (:class:`TokenTreeBatch`) and the static (choice list)
  and EAGLE-2 dynamic builders.
* :mod:`.sampling`: the lossless tree rejection sampler (chain-shaped output for vLLM).
* :mod:`.attention`: tree attention over vLLM's paged KV cache (reference, CPU path, Triton).
* :mod:`.compaction`: moves accepted nodes' K/V to linear slots after verification.
"""

from .building import (
    MAX_TREE_NODES,
    ChildDrawMode,
    DynamicTopKTreeBuilder,
    StaticTreeBuilder,
    StaticTreeTemplate,
    TokenTreeBatch,
    VerifyLayout,
)

__all__ = [
    "MAX_TREE_NODES",
    "ChildDrawMode",
    "DynamicTopKTreeBuilder",
    "StaticTreeBuilder",
    "StaticTreeTemplate",
    "TokenTreeBatch",
    "VerifyLayout",
]
