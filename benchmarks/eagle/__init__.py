"""The committed EAGLE-3 head (``heads/qwen2.5-coder-0.5b-instruct-eagle3``) on Qwen2.5-Coder-0.5B-Instruct.

    python -m benchmarks eagle speed [--batch 1 4] [--ks 2 3 4 5 6] [--max-tokens 96] [--dtype float32]
        [--tree-budgets 4 8 16 32] [--lookup-nodes 4] [--lookup-budgets 4] [--policy '{"4": {"chain": 2}, "8": 0}' ...]
        [--prompts heldout|edit|chat|mixed] [--no-draft-model] [--no-eagle1] [--auto 16 ...] [--heads LABEL=HEAD ...]
    python -m benchmarks eagle replay                # offline acceptance: held-out against training prompts
    python -m benchmarks eagle agreement HEAD ...    # held-out agreement against the tokens trained on
    python -m benchmarks eagle profile --setup NAME SPEC ADDITIONAL ...   # where a step's time goes (cProfile)

``speed`` runs vLLM's eagle3 chains, the plugin's EAGLE-2 trees (merged with prompt lookup, under a
``budget_by_batch`` table or the controller) against vanilla, vLLM's ngram and a draft model, through the
shared harness (``benchmarks.eagle.speed``). Each part has its own ``--help``. Results: ``benchmarks/results/``
``eagle_*speed*_b{B}.*``, ``eagle_replay.json``, ``eagle_agreement_vs_tokens.{md,png}``, ``step_profile.md``.
"""
