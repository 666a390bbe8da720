"""Token-tree speculation components that need no running engine: :mod:`.building` (the batched tree, static
templates, the EAGLE-2 builder; its docstring has the layout conventions they all share), :mod:`.sampling` (the
lossless tree rejection sampler), :mod:`.attention` and :mod:`.compaction` (accepted nodes' K/V to linear slots).
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

__all__ = ["MAX_TREE_NODES", "ChildDrawMode", "DynamicTopKTreeBuilder", "StaticTreeTemplate", "TokenTreeBatch",
           "TreeSamplerOutput", "apply_sampling_constraints", "compact_kv", "tree_compaction_slots",
           "tree_rejection_sample"]
