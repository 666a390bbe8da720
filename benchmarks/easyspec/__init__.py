"""EasySpec drafting with a draft model: fuzzy layer-parallel drafting against exact, its drafting time and
speed, and token trees drafted by the same model.

    python -m benchmarks easyspec acceptance     # exact vs fuzzy N=2,3,4 x every_round/never, pairs a, b, c
    python -m benchmarks easyspec tp             # drafting time on 2 CPU ranks (tensor_parallel, fused-TP)
    python -m benchmarks easyspec e2e            # decode tok/s at batch 1 and 8, TP 1 and 2, pair c
    python -m benchmarks easyspec table4         # cosine of exact and fuzzy states (Table-4 analog, transformers)
    python -m benchmarks easyspec tree-verify    # target forward: tree of N nodes vs chain of N vs one token
    python -m benchmarks easyspec tree-compare   # tree vs chain at equal node budgets, pairs c, a, b
    python -m benchmarks easyspec tree-ablation  # Figure-4 analog: tree width x N x calibration, pair b
    python -m benchmarks easyspec tree-e2e       # pair c at batch 1 and 8: vanilla, vLLM, EasySpec chain and trees
    python -m benchmarks easyspec tree-lookup    # pair c, default and code-edit prompts: trees + prompt lookup

Pairs: (a) SmolLM2-135M drafting for itself, (b) Qwen2.5-Coder-0.5B drafting for itself, (c) SmolLM2-135M
drafting for Qwen2.5-Coder-0.5B across vocabularies (``use_heterogeneous_vocab``, the default pair). Greedy.
Each part has its own ``--help``. Results: ``benchmarks/results/easyspec_*`` and ``tree_*`` (.json, .md, .png).
"""
