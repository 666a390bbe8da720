"""The speculation controller (``easyspec.tree.auto``) against every fixed setup, for each prompt class and
batch size, with both drafters of the default target, side by side in one run.

    python -m benchmarks matrix [--batches 1 2 4 8 16] [--classes chat heldout edit mixed]
        [--pairs eagle draft] [--max-tokens 32] [--rounds 2] [--min-prompts 4] [--repeats 2] [--only REGEX]
        [--side-by-side] [--ragged] [--stem auto_matrix]
    python -m benchmarks matrix controller-cost [--batches 1 4 16] [--steps 300]   # engine-free
    python -m benchmarks matrix moe-cost [--layers 4] [--experts 8]   # verify cost curves, MoE vs dense

Setups (``SETUPS``): vanilla; vLLM's ``eagle3`` chains with the committed head at k = 2 and 3, and k set by
batch size with vLLM's ``num_speculative_tokens_per_batch_size`` (``EAGLE_SCHEDULE``); the plugin's fixed
merged EAGLE-2 trees (4 and 8 head nodes + 4 prompt-lookup nodes); the 4-node one with the README's
``budget_by_batch`` table; the controller on a 16 + 4-node candidate (and, as ``eagle-auto-8`` and
``eagle-auto-4``, on the 8 + 4 and the 4 + 4 ones); and with SmolLM2-135M drafting across vocabularies: vLLM's
``draft_model`` chain at k = 1 (its fastest k), that chain by batch size (``DRAFT_SCHEDULE``), the bridged
tree of 4 root children + 4 lookup nodes, that tree with a table that stops speculating from batch 4, and the
controller on a 12 + 4-node candidate. A cell is one prompt class at one batch size: ``rounds x batch``
prompts (at least ``--min-prompts``) served ``batch`` at a time, a finished request replaced by the next
prompt, ``--max-tokens`` each. Every engine process times every cell in turn (``harness.processes.run_matrix``); each
setup runs in ``--repeats`` interleaved processes; round r serves the classes in their order rotated by r.
With ``--side-by-side`` each round's engines are all started at once and take turns cell by cell, so the
setups' times of a cell are taken minutes apart at most (in 24 GiB four engines of one pair fit in bfloat16,
five came within 1 GiB of it, and in float32 three fit: choose the setups with ``--only``; a round that would
not fit stops before the engine that would not, naming this).

The report gives the controller's ratio to vanilla and to the best fixed setup by round, and again at equal
process speed (``equal_speed_ratios``: each round's ratio times how much longer the controller's process took
for the same target model forward on undrafted steps), the split a missed goal is read by.

Results: ``benchmarks/results/{stem}.{json,md}``, ``{stem}_speed.png`` (speed against batch per class),
``{stem}_calibration.png`` (the controller's predicted against observed acceptance, by bin) and
``{stem}_cost.png`` (the verify and draft-level cost curves it measured). Finished runs are kept in
``benchmarks/results/logs/{stem}.runs.jsonl``: the same command resumes an interrupted matrix.

The two studies beside it: ``controller-cost`` times the controller's own calls per step on synthetic steps
(``benchmarks.matrix.controller_cost``), and ``moe-cost`` the verify cost curve it measures at start-up on a
mixture-of-experts target against a dense one (``benchmarks.matrix.moe_cost``).
"""
