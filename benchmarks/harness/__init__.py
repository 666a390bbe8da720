"""Side-by-side benchmark harness: named setups run on the same prompts in one run, one JSON row each.

Invariants:
- Every run of a setup is its own child process with a fresh engine; engine start-up is never inside a
  timed region, and no two engines run at once (they would compete for the cores).
- One engine process is not a measurement (a process can run ~1.5x slower for its whole life), so every
  setup runs in ``repeats`` processes, interleaved: round r runs every setup once before round r+1 starts,
  and the order within round r is the setup list rotated by r (``interleaved_order``), so no setup always
  runs first. Machine drift then spreads over all setups instead of landing on one.
- A matrix run side by side (``run_matrix(side_by_side=True)``) starts every setup's engine in one child
  per round and times each cell on every engine in turn before the next cell (the setups rotated by round
  and cell), so the setups' times of one cell lie within a minute or two of each other, not a whole
  process apart: the machine's drift over minutes then moves them together. The engines wait between their
  turns (an idle engine took about 1.5% of one core here) and never run at once. vLLM's acceptance counters
  are read for the last setup only (each new engine unregisters the metrics of those built before it). In
  both modes, round r serves the prompt classes (``Cell.group``) in the order rotated by r (``cell_order``),
  so no class is always the first an engine serves.
- Per setup a row reports the median speed over its runs, with the min, the max and every run's value;
  ``speedup_vs_vanilla`` is median(setup) / median(vanilla) and the range ``speedup_min`` / ``speedup_max``
  is min(setup) / median(vanilla) and max(setup) / median(vanilla). Per-step times (drafting, verify, whole
  step) are medians over the runs too. The speed of a run that serves its prompts at once is its decode
  tok/s (``decode_tok_per_s``: tokens after the first over the span from the first first token to the last
  token). The speed of a matrix cell, where a finished request is replaced by the next prompt so prefills
  fall all through the cell, is its throughput (``throughput_tok_per_s``: every output token over the whole
  timed call): there the span's start is the first prefill step that completes a prompt, which depends on how
  the scheduler splits the first round's prompts, and moved a setup's decode tok/s by up to 25% at batch 16.
- A warm-up request runs before timing; acceptance counters and step timers are read as the difference of
  two snapshots around the timed ``generate`` call, so only steps after the warm-up count. Counters of
  greedy runs are deterministic, so the first run's are reported; ``repeats_agree`` says whether every run
  of the setup produced the same token ids.
- Step split: the workers time every engine step (``execute_model`` + ``sample_tokens``, see
  ``benchmarks.harness.step_timers.time_steps``) and the drafter inside it; verify seconds per
  step = (step seconds - drafting seconds) / steps. For vanilla, verify is the whole decode step.
- Identity is judged against the setup named ``vanilla``: its first run also replays the timed request with
  ``logprobs=TOP_LOGITS_RECORDED`` on an engine started with ``logprobs_mode="raw_logits"`` (untimed, after
  a prefix-cache reset and the same warm-up, and checked to give the same tokens), which records vanilla's
  top token ids and raw logits at every output position. A setup whose tokens differ from vanilla's is a
  near-tie only when, at the first differing position of that prompt, its token is among vanilla's recorded
  top tokens and vanilla's logit margin between its own token and the setup's is within the rounding of the
  run's dtype (``classify_identity``); anything else is a failure, printed as ``LOSSLESS CHECK FAILED``. Other setups' sampling parameters are never changed.

Row schema (``ROW_FIELDS``): later issues add setups, never new scripts or fields with other meanings.

Modules: ``setups`` (setups, workloads, cells, prompts, run order), ``processes`` (the runs in engine child
processes), ``engine`` (inside a child: start an engine, time a workload), ``step_timers`` (the drafting and
engine-step timers inside its workers), ``steps`` (the plugin's step statistics), ``aggregate`` (runs into rows),
``identity`` (near-ties against failures), ``report`` (tables, plots, result files), ``paged_tree_attention``
(the torch tree attention ``kernels`` times).
"""
