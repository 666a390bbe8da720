"""The child side of a run: start a setup's engine with the plugin's timers on, and time the workload, or each
matrix cell, on it; side by side, every setup's engine in one process, taking turns cell by cell.

Run by ``benchmarks.harness.processes`` as ``python -m benchmarks.harness.engine --child REQUEST RESULT``."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.setups import (
    TOP_LOGITS_RECORDED,
    VANILLA,
    Cell,
    Setup,
    Workload,
    cell_order,
    setup_engine_env,
)
from benchmarks.harness.steps import counter_delta, step_split, steps_by_drafts, undrafted_forward_seconds


def _child_main(request_path: Path, result_path: Path) -> None:
    """Runs inside the child process: build the engine, then time the workload, or each of its cells; or,
    side by side, build every setup's engine and time each cell on each of them in turn."""
    request = json.loads(request_path.read_text())
    workload = Workload(**request["workload"])
    record_top_logits = bool(request.get("record_top_logits"))
    round_index = int(request.get("round", 0))
    cells = cell_order([Cell(**cell) for cell in request.get("cells") or []], round_index)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(workload.target)
    if "setups" in request:
        result_path.write_text(json.dumps({"runs": _side_by_side_round(
            [Setup(**setup) for setup in request["setups"]], workload, tokenizer, cells, round_index)}))
        return
    setup = Setup(**request["setup"])
    llm, engine_start = _start_engine(setup, workload)
    if not cells:
        result = _measure(llm, tokenizer, setup, workload,
                          Cell("", workload.prompts, workload.batch_size, workload.max_tokens),
                          record_top_logits, limit_in_flight=False)
        result["engine_start_seconds"] = engine_start
    else:
        result = {"setup": setup.name, "cells": {}}
        for cell in cells:
            llm.reset_prefix_cache()  # every cell starts as the first would, whatever ran before it
            measured = _measure(llm, tokenizer, setup, workload, cell, record_top_logits, limit_in_flight=True)
            result["cells"][cell.name] = measured | {"engine_start_seconds": engine_start}
    result_path.write_text(json.dumps(result))


SIDE_BY_SIDE_MEMORY_MARGIN = 1.25  # the next engine must find this much more memory than the dearest one took


def side_by_side_memory_refusal(setup_name: str, available: int, taken: list[int], dtype: str) -> str | None:
    """Why the next engine of a side-by-side round would not fit (``available`` bytes free, ``taken`` what each
    engine started so far took), or None. An engine that runs out of memory while loading is killed (-9) and
    the round is lost minutes in, so the round stops before starting it, naming the fix."""
    if not taken or available >= SIDE_BY_SIDE_MEMORY_MARGIN * max(taken):
        return None
    gib = 2**30
    return (f"--side-by-side: engine {len(taken) + 1} ({setup_name}) would not fit: {available / gib:.1f} GiB "
            f"free, and each engine so far took up to {max(taken) / gib:.1f} GiB ({dtype}); choose fewer setups "
            f"with --only (vanilla counts as one) or run without --side-by-side")


def _side_by_side_round(setups: list[Setup], workload: Workload, tokenizer, cells: list[Cell],
                        round_index: int) -> list[dict[str, Any]]:
    """Every setup's engine started (each with its own environment), then each cell timed on each engine in
    turn, the setups rotated by round and cell; vanilla records its top logits in round 0. vLLM's acceptance
    counters are read for the last setup only: each engine unregisters the metrics of those built before it."""
    import psutil

    engines = {}
    base = dict(os.environ)
    taken: list[int] = []  # memory each started engine took
    try:
        for setup in setups:  # the engine's processes inherit the environment it starts in
            available = psutil.virtual_memory().available
            refusal = side_by_side_memory_refusal(setup.name, available, taken, workload.dtype)
            if refusal is not None:
                raise MemoryError(refusal)
            os.environ.clear()
            os.environ.update(base | setup_engine_env(setup))
            engines[setup.name] = _start_engine(setup, workload)
            taken.append(available - psutil.virtual_memory().available)
    finally:
        os.environ.clear()
        os.environ.update(base)
    runs = {setup.name: {"setup": setup.name, "cells": {}} for setup in setups}
    for position, cell in enumerate(cells):
        shift = (round_index + position) % len(setups)
        for setup in setups[shift:] + setups[:shift]:
            llm, engine_start = engines[setup.name]
            llm.reset_prefix_cache()
            measured = _measure(llm, tokenizer, setup, workload, cell,
                                record_top_logits=setup.name == VANILLA and round_index == 0, limit_in_flight=True,
                                counters_readable=setup is setups[-1])
            runs[setup.name]["cells"][cell.name] = measured | {"engine_start_seconds": engine_start}
    return [runs[setup.name] for setup in setups]


def _start_engine(setup: Setup, workload: Workload) -> tuple[Any, float]:
    """The setup's engine with the step and drafting timers on; its start-up seconds."""
    from vllm import LLM

    from benchmarks.harness.step_timers import WORKER_EXTENSION_CLS

    engine_options: dict[str, Any] = dict(workload.engine_options)
    if setup.name == VANILLA:
        # Every vanilla run gets the same engine; without a logprobs request this mode costs nothing.
        engine_options["logprobs_mode"] = "raw_logits"
    started = time.perf_counter()
    llm = LLM(
        model=workload.target,
        dtype=workload.dtype,
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=workload.batch_size,
        tensor_parallel_size=setup.tensor_parallel_size,
        distributed_executor_backend="mp",
        speculative_config=setup.speculative_config,
        additional_config=setup.additional_config or {},
        worker_extension_cls=WORKER_EXTENSION_CLS,
        disable_log_stats=False,
        seed=0,
        **engine_options,
    )
    engine_start = time.perf_counter() - started
    if setup.speculative_config:
        llm.collective_rpc("easyspec_time_drafter")  # drafting time for vLLM's own proposers too
    llm.collective_rpc("easyspec_time_steps")  # whole engine steps, every setup
    return llm, engine_start


def _measure(llm, tokenizer, setup: Setup, workload: Workload, cell: Cell, record_top_logits: bool,
             limit_in_flight: bool, counters_readable: bool = True) -> dict[str, Any]:
    """Warm up, then time one generate over ``cell``'s prompts (at most ``cell.batch_size`` in flight when
    ``limit_in_flight``, else as many as the engine's ``max_num_seqs``); counters are differences of
    snapshots around the timed call. Without ``counters_readable`` (an engine built before another in the same
    process, whose vLLM metrics the newer one unregistered) vLLM's acceptance counters are reported as None."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_easyspec.instruments.metrics import read_spec_decode_counters
    from vllm_easyspec.models import prompt_token_ids

    prompts = [TokensPrompt(prompt_token_ids=prompt_token_ids(tokenizer, text)) for text in cell.prompts]
    in_flight = cell.batch_size if limit_in_flight else None
    params = cell.sampling_params(temperature=workload.temperature, seed=0)
    warm_up = SamplingParams(temperature=0.0, max_tokens=8, **cell.structured_options())  # compiles its grammar
    llm.generate(prompts[:1], warm_up, use_tqdm=False)
    drafting_before = _drafting_seconds_and_steps(llm)
    steps_before = _step_stats(llm)
    counters_before = read_spec_decode_counters(llm)
    controller_before = llm.collective_rpc("easyspec_controller_stats")[0]
    tree_before = llm.collective_rpc("easyspec_tree_stats")[0]
    llm.collective_rpc("easyspec_take_step_log")  # the log starts empty with the timed call
    started = time.perf_counter()
    outputs = _generate(llm, prompts, params, in_flight)
    generate_seconds = time.perf_counter() - started
    step_log = llm.collective_rpc("easyspec_take_step_log")[0]
    counters = read_spec_decode_counters(llm) - counters_before if counters_readable else None
    steps_after = _step_stats(llm)
    drafting_after = _drafting_seconds_and_steps(llm)

    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    output_tokens = sum(len(t) for t in token_ids)
    decode_seconds = _decode_seconds(outputs) or generate_seconds
    decode_tokens = sum(max(len(t) - 1, 0) for t in token_ids)
    drafting_seconds_per_step = None
    drafting_share = None
    if drafting_before is not None and drafting_after is not None:
        seconds = drafting_after[0] - drafting_before[0]
        steps = drafting_after[1] - drafting_before[1]
        drafting_seconds_per_step = seconds / steps if steps else None
        drafting_share = seconds / generate_seconds
    spec = setup.speculative_config or {}
    result = {
        "setup": setup.name,
        "description": setup.description,
        "target": Path(workload.target).name,
        "draft": Path(spec["model"]).name if spec.get("model") else None,
        "method": spec.get("method", "none") if spec else "none",
        "num_speculative_tokens": spec.get("num_speculative_tokens"),
        "batch_size": cell.batch_size,
        "tensor_parallel_size": setup.tensor_parallel_size,
        "dtype": workload.dtype,
        "logits_dtype": str(llm.model_config.dtype).removeprefix("torch."),
        "temperature": workload.temperature,
        "num_prompts": len(prompts),
        "max_tokens": cell.max_tokens,
        "output_tokens": output_tokens,
        "generate_seconds": generate_seconds,
        "decode_seconds": decode_seconds,
        "decode_tok_per_s": decode_tokens / decode_seconds if decode_seconds else None,
        "throughput_tok_per_s": output_tokens / generate_seconds,
        "mean_acceptance_length": counters and counters.mean_acceptance_length,
        "acceptance_rate": counters and counters.acceptance_rate,
        "per_position_acceptance": counters and counters.per_position_acceptance,
        "num_drafts": counters and counters.num_drafts,
        # tree nodes (or chain drafts) verified per speculative step, from vLLM's counters
        "nodes_per_step": counters and counters.nodes_per_step,
        "drafting_seconds_per_step": drafting_seconds_per_step,
        "drafting_share_of_decode": drafting_share,
        **step_split(steps_before, steps_after),
        "decode_steps_by_drafts": None if step_log is None else steps_by_drafts(step_log),
        "undrafted_forward_seconds": None if step_log is None else undrafted_forward_seconds(step_log),
        "undrafted_model_seconds": None if step_log is None else undrafted_forward_seconds(step_log, "model_seconds"),
        "token_ids": token_ids,
        # easyspec.tree.auto: the controller's counters over the timed call, its cost curves and calibration
        # tables as they stand after it (None without it)
        "controller": counter_delta(controller_before, llm.collective_rpc("easyspec_controller_stats")[0]),
        # easyspec.tree: the runner's counters over the timed call (tree steps, chain steps, paths in tree steps;
        # None without trees)
        "tree_stats": counter_delta(tree_before, llm.collective_rpc("easyspec_tree_stats")[0]),
    }
    if record_top_logits:
        # Untimed replay of the timed request under the same conditions (empty prefix cache, same warm-up,
        # same requests in flight), asking for vanilla's top raw logits at every output position.
        llm.reset_prefix_cache()
        llm.generate(prompts[:1], warm_up, use_tqdm=False)
        params_top = cell.sampling_params(temperature=workload.temperature, seed=0, logprobs=TOP_LOGITS_RECORDED)
        with_logprobs = _generate(llm, prompts, params_top, in_flight)
        replay_ids = [list(o.outputs[0].token_ids) for o in with_logprobs]
        result["logprobs_tokens_match"] = replay_ids == token_ids
        result["vanilla_top"] = [_top_logits_per_position(o.outputs[0].logprobs) for o in with_logprobs]
    return result


def _generate(llm, prompts: list[Any], params: list[Any], in_flight: int | None) -> list[Any]:
    """``llm.generate``'s outputs in prompt order (``params[i]`` for ``prompts[i]``); with ``in_flight``, at most
    that many requests run at once, each finished one replaced by the next prompt."""
    if in_flight is None or in_flight >= len(prompts):
        return llm.generate(prompts, params, use_tqdm=False)
    engine = llm.llm_engine
    waiting = list(enumerate(prompts))
    index_of: dict[str, int] = {}
    outputs: dict[int, Any] = {}

    def submit() -> None:
        index, prompt = waiting.pop(0)
        external = f"cell-{index}-{time.monotonic_ns()}"
        index_of[external] = index
        index_of[engine.add_request(external, prompt, params[index])] = index

    for _ in range(in_flight):
        submit()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[index_of[output.request_id]] = output
                if waiting:
                    submit()
    if len(outputs) != len(prompts):
        raise RuntimeError(f"{len(outputs)} of {len(prompts)} requests finished")
    return [outputs[i] for i in range(len(prompts))]


def _top_logits_per_position(logprobs) -> list[list[list[float]]]:
    """[[token, logit], ...] per output position, best first (values are raw logits here)."""
    positions = []
    for entry in logprobs or []:
        ranked = sorted(
            ((int(t), float(lp.logprob)) for t, lp in (entry or {}).items()), key=lambda tv: -tv[1]
        )
        positions.append([[t, v] for t, v in ranked[:TOP_LOGITS_RECORDED]])
    return positions


def _decode_seconds(outputs) -> float | None:
    """Wall time from the first request's first token to the last request's last token (engine clock)."""
    stats = [o.metrics for o in outputs if getattr(o, "metrics", None) is not None]
    if len(stats) != len(outputs):
        return None
    first = min(s.first_token_ts for s in stats)
    last = max(s.last_token_ts for s in stats)
    return last - first if last > first else None


def _drafting_seconds_and_steps(llm) -> tuple[float, int] | None:
    stats = llm.collective_rpc("easyspec_drafting_stats")
    if not stats or stats[0] is None:
        return None
    return stats[0]["drafting_seconds"], stats[0]["steps"]


def _step_stats(llm) -> dict[str, float] | None:
    stats = llm.collective_rpc("easyspec_step_stats")
    return stats[0] if stats else None


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", nargs=2, metavar=("REQUEST", "RESULT"), required=True)
    args = parser.parse_args()
    _child_main(Path(args.child[0]), Path(args.child[1]))
