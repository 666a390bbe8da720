"""``tree.auto`` at start-up: the step's cost measured once the KV caches exist, and the policy that uses it.

:func:`start_auto_budget` times forwards of the target (its forward and logits over the row counts a verify can
have) and of the drafter's model (one level's rows, with and without logits), fits the
:class:`~vllm_easyspec.control.cost.StepCostModel`, and returns the
:class:`~vllm_easyspec.integration.node_policy.AutoBudget` the runner's tree step calls from then on. This is
the one place where the plugin waits for the device on purpose: once, before the engine serves.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from vllm_easyspec.control.controller import SpeculationController
from vllm_easyspec.control.cost import CostCurve, ForwardTimings, StepCostModel, time_forwards
from vllm_easyspec.instruments.device_clock import DeviceClock
from vllm_easyspec.instruments.plan_log import appender, plan_log_path
from vllm_easyspec.integration.compat import plugin_logger
from vllm_easyspec.integration.metrics import ControllerPublisher
from vllm_easyspec.integration.node_policy import AutoBudget
from vllm_easyspec.tree.config import TreeConfig

logger = plugin_logger(__name__)
DENSE_CALIBRATION_ROWS = 8  # start-up cost curves: every row count up to this one is timed


def start_auto_budget(runner: Any, tree: TreeConfig) -> AutoBudget:
    """The step's cost measured on ``runner`` (vLLM's model runner, KV caches allocated), then the controller
    that uses it, publishing its figures to vLLM's metrics from tensor-parallel rank 0."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from vllm_easyspec.integration.pipeline_trees import pipeline_stages, single_stage_pipeline

    started = time.perf_counter()
    level_width, max_nodes = _tree_shape(tree)
    verify = time_target_verify(runner, tree)
    with single_stage_pipeline(pipeline_stages(runner.vllm_config) > 1):  # the draft, whole
        level = _forward_timings(runner, calibration_rows(
            min(runner.scheduler_config.max_num_seqs * level_width, runner.max_num_tokens)), draft=True)
    cost = StepCostModel(
        verify=CostCurve.from_measurements(verify.rows, verify.with_logits),
        draft_level=CostCurve.from_measurements(level.rows, level.with_logits),
        draft_forward=CostCurve.from_measurements(level.rows, level.without_logits),
    )
    logger.info("easyspec.tree.auto: step cost measured in %.1f s: %s", time.perf_counter() - started,
                cost.describe())
    controller = SpeculationController(cost, max_depth=tree.max_depth, max_nodes=max_nodes, level_width=level_width)
    plan_log = plan_log_path()
    if plan_log is not None:
        controller.plan_log = appender(plan_log)
    publish = None
    if get_tensor_model_parallel_rank() == 0:
        publish = ControllerPublisher(controller, runner.vllm_config.instance_id).publish
    return AutoBudget(tree, controller, DeviceClock(runner.device), publish, agree=_rank_zeros_decision())


def _tree_shape(tree: TreeConfig) -> tuple[int, int]:
    """(nodes drafted per level, most nodes per request) of ``tree`` under ``auto``."""
    level_width = tree.top_k if not tree.is_static else max(
        len(level) for level in tree.template().expansion_levels())
    return level_width, tree.num_nodes if tree.auto.max_nodes is None else tree.auto.max_nodes


def time_target_verify(runner: Any, tree: TreeConfig) -> ForwardTimings:
    """The target's forward (and logits) over each row count a verify step of ``tree`` can have, timed on
    ``runner``. Under pipeline parallelism every stage calls this at start-up (a stage before the last drafts
    nothing, but its layers are part of each verify): each forward's seconds are the sum over the stages, and every
    stage times the same forwards."""
    max_nodes = _tree_shape(tree)[1]
    rows = calibration_rows(min(runner.scheduler_config.max_num_seqs * (1 + max_nodes), runner.max_num_tokens))
    return _forward_timings(runner, rows, draft=False)


def _rank_zeros_decision():
    """With tensor-parallel ranks, each decision becomes rank 0's (one small object broadcast over the ranks' CPU
    group per decision); alone, the decision as it is."""
    from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

    from vllm_easyspec.integration.node_policy import alone

    if get_tensor_model_parallel_world_size() == 1:
        return alone
    group = get_tp_group()
    return lambda decision: group.broadcast_object(decision, src=0)


def _forward_timings(runner: Any, rows: list[int], draft: bool) -> ForwardTimings:
    """Forwards of the target, or of the drafter's model, timed as :func:`time_forwards` says; attention runs
    without metadata (no context), as in vLLM's profiling runs."""
    from vllm.distributed import get_pp_group
    from vllm.forward_context import set_forward_context

    drafter = runner.drafter
    model = drafter.model if draft else runner.model
    stage = get_pp_group()
    first_stage, last_stage = draft or stage.is_first_rank, draft or stage.is_last_rank  # the draft runs whole
    in_step = _in_step_across_data_parallel_ranks(runner)
    if not draft:
        in_step = _across_pipeline_stages(in_step)

    @in_step
    def forward(count: int) -> tuple[float, float]:
        inputs = {"input_ids": runner.input_ids.gpu[:count], "positions": runner.positions[:count]}
        if draft and drafter.pass_hidden_states_to_model:  # an EAGLE head reads a hidden state per row
            inputs["hidden_states"] = torch.zeros(count, drafter.hidden_size, dtype=runner.dtype,
                                                  device=runner.device)
        if not first_stage:  # a later stage's input: the earlier stage's tensors
            inputs["intermediate_tensors"] = runner.sync_and_gather_intermediate_tensors(count, None, False)
        started = time.perf_counter()
        with torch.inference_mode(), set_forward_context(None, runner.vllm_config, num_tokens=count):
            output = model(**inputs)
            hidden = output[0] if isinstance(output, tuple) else output
            if not last_stage:  # an earlier stage: no logits
                hidden = hidden["hidden_states"]
                _wait_for(hidden)
                return (time.perf_counter() - started,) * 2
            _wait_for(hidden)
            forwarded = time.perf_counter()
            model.compute_logits(hidden[:count])
        _wait_for(hidden)
        return time.perf_counter() - started, forwarded - started

    return time_forwards(rows, forward)


def _across_pipeline_stages(in_step):
    """Under pipeline parallelism a verify forward runs every stage's layers in turn: each timed forward's seconds
    are summed over the stages (alone: as they are)."""
    from vllm.distributed import get_pp_group

    stages = get_pp_group()
    if stages.world_size == 1:
        return in_step

    def across(forward):
        timed_here = in_step(forward)

        def timed(count: int) -> tuple[float, float]:
            seconds = torch.tensor(timed_here(count), dtype=torch.float64)
            torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.SUM, group=stages.cpu_group)
            return tuple(seconds.tolist())
        return timed

    return across


def _in_step_across_data_parallel_ranks(runner: Any):
    """Under data parallelism (MoE targets) each rank's forwards meet the others' (vLLM coordinates their row
    counts, an MoE layer gathers every rank's tokens), so every rank must time the same forwards: each forward's
    seconds become the slowest rank's, and :func:`time_forwards` decides alike everywhere."""
    if runner.vllm_config.parallel_config.data_parallel_size == 1:
        return lambda forward: forward
    from vllm.distributed import get_dp_group

    def in_step(forward):
        def timed(count: int) -> tuple[float, float]:
            seconds = torch.tensor(forward(count), dtype=torch.float64)
            torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX, group=get_dp_group().cpu_group)
            return tuple(seconds.tolist())
        return timed

    return in_step


def _wait_for(tensor: torch.Tensor) -> None:
    """Start-up timing only: the device's work so far is done (a no-op on the host)."""
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def calibration_rows(most: int) -> list[int]:
    """Row counts a cost curve is measured at: every count up to :data:`DENSE_CALIBRATION_ROWS` (where a
    lone request's nodes fall, and where the cost of a row count is least regular), powers of two past it, and
    ``most``; none above ``most``."""
    most = max(most, 1)
    rows = list(range(1, min(most, DENSE_CALIBRATION_ROWS) + 1))
    while rows[-1] * 2 < most:
        rows.append(1 << rows[-1].bit_length())
    return sorted(set(rows) | {most})
