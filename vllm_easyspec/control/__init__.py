"""Self-tuning speculation (``easyspec.tree.auto``), engine-free: a step's measured cost
(:mod:`.cost`), each node's calibrated chance of acceptance (:mod:`.acceptance`), the choice of depth and nodes
that maximises the batch's expected tokens per second (:mod:`.planning`), and the controller that keeps them
(:mod:`.controller`). The engine side is in :mod:`vllm_easyspec.integration` (runner, tree drafting)."""
