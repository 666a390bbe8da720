"""Token trees under pipeline parallelism (docs/design.md, "Trees under pipeline parallelism"): what only the last
stage knows (drafts, tree parents, accepted nodes out of place) travels on the step's ``ModelRunnerOutput`` to the
scheduler (seam: ``Scheduler.update_from_output``) and on the ``SchedulerOutput`` to every stage (seam:
``Scheduler.schedule``); an earlier stage keeps a tree forward's K/V (:class:`UncommittedTrees`) until its requests'
moves arrive, before their next forward. A drafter runs whole on the last stage (:func:`single_stage_pipeline`).

Invariant: without pipeline parallelism nothing here runs, and every message is what vLLM sends.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_easyspec.integration.tree_grammar import REQUEST_PARENTS
from vllm_easyspec.integration.tree_step import DRAFT_PARENTS, TreeVerifyForward
from vllm_easyspec.tree.verify_step import AcceptedBranch

OUTPUT_DRAFTS = "easyspec_draft_token_ids"  # on ModelRunnerOutput: the step's DraftTokenIds (parents included)
BRANCH_MOVES = "easyspec_branch_moves"  # {request id: [(source column, depth)]} on ModelRunnerOutput / SchedulerOutput
SCHEDULED_PARENTS = "easyspec_scheduled_parents"  # on SchedulerOutput: {request id: parents of its scheduled drafts}
RECENT_TOKENS = "easyspec_recent_tokens"  # on SchedulerOutput: {request id: its last tokens before this step's}
_REQUEST_MOVES = "easyspec_branch_moves"  # on the scheduler's Request: the moves of its last tree step, until sent

Moves = list[tuple[int, int]]  # (source column, depth) of each accepted node out of place, root side first


def pipeline_stages(vllm_config) -> int:
    return vllm_config.parallel_config.pipeline_parallel_size


@dataclass(frozen=True)
class _SingleStageGroup:
    """What model code reads of vLLM's pipeline group (``GroupCoordinator``), for a model held whole by one rank."""

    rank_in_group: int = 0
    world_size: int = 1
    is_first_rank: bool = True
    is_last_rank: bool = True


@contextlib.contextmanager
def single_stage_pipeline(enabled: bool) -> Iterator[None]:
    """While inside (and ``enabled``): ``get_pp_group()`` is a group of this rank alone, so a draft model built or run
    here holds and runs all its layers (vLLM's ``make_layers`` would give the last stage only its last layers)."""
    if not enabled:
        yield
        return
    from vllm.distributed import parallel_state

    # Replaces, while inside, the module global vllm.distributed.parallel_state._PP that get_pp_group() returns.
    group = parallel_state._PP
    parallel_state._PP = _SingleStageGroup()
    try:
        yield
    finally:
        parallel_state._PP = group


@contextlib.contextmanager
def target_layers_counted_whole(model_config, enabled: bool) -> Iterator[None]:
    """While inside (and ``enabled``): the target's ``ModelConfig.get_num_layers`` counts all its layers, not this
    stage's. vLLM numbers an EAGLE head's layers after the target's (``start_layer_id``) by that count, which on the
    last stage names the head's first layer after a target layer of that stage (``Duplicate layer name``)."""
    if not enabled:
        yield
        return
    # Replaces, while inside, vllm.config.model.ModelConfig.get_num_layers on this config alone.
    object.__setattr__(model_config, "get_num_layers", lambda parallel_config: model_config.get_total_num_hidden_layers())
    try:
        yield
    finally:
        object.__delattr__(model_config, "get_num_layers")


def eagle3_reads_aux_states(speculative_config) -> bool:
    """Whether the head reads the target's auxiliary hidden states (EAGLE-3), as vLLM's proposer decides on the last
    stage (``SpecDecodeBaseProposer._get_eagle3_use_aux_hidden_state_from_config``); every earlier stage must then
    collect its layers' and send them on, which vLLM sets up only where a drafter exists."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    proposer = SimpleNamespace(method=speculative_config.method,
                               draft_model_config=speculative_config.draft_model_config)
    return SpecDecodeBaseProposer._get_eagle3_use_aux_hidden_state_from_config(proposer)


@dataclass
class UncommittedTrees:
    """An earlier stage's tree forwards whose accepted branches have not arrived: each masked request's forward
    (its K/V kept by the attention backend) until the scheduler sends the request's moves or drops it."""

    forwards: dict[str, TreeVerifyForward] = field(default_factory=dict)

    def keep(self, forward: TreeVerifyForward) -> None:
        if forward.masked is not None:
            for request in forward.masked.requests:
                self.forwards[request.req_id] = forward

    def commit(self, scheduler_output, write: Callable[[TreeVerifyForward, AcceptedBranch], None]) -> None:
        """Before a stage's forward: the moves that came with ``scheduler_output`` committed through ``write``;
        requests scheduled again (restarted ones included) or finished forget their kept forward."""
        moves: dict[str, Moves] = getattr(scheduler_output, BRANCH_MOVES, None) or {}
        by_forward: dict[int, tuple[TreeVerifyForward, list[tuple[int, int, int]]]] = {}
        for req_id, request_moves in moves.items():
            forward = self.forwards.get(req_id)
            if forward is None:
                continue
            index = next(i for i, request in enumerate(forward.step.requests) if request.req_id == req_id)
            entries = by_forward.setdefault(id(forward), (forward, []))[1]
            entries.extend((index, column, depth) for column, depth in request_moves)
        for forward, entries in by_forward.values():
            index, column, depth = (torch.tensor(values, dtype=torch.long) for values in zip(*entries, strict=True))
            write(forward, AcceptedBranch(index, column, forward.step.prefix_lens[index] + depth,
                                          torch.zeros_like(index)))
        done = set(scheduler_output.num_scheduled_tokens) | scheduler_output.finished_req_ids
        for req_id in done & set(self.forwards):
            del self.forwards[req_id]


# ---------------------------------------------------------------------------------------------- scheduler seams
def install() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.schedule, "_easyspec_patched", False):
        return
    # Replaces vllm.v1.core.sched.scheduler.Scheduler.update_from_output: vLLM's, then (pipeline parallelism only)
    # the step's drafts applied and each request's branch moves kept (module docstring).
    Scheduler.update_from_output = _update_from_output(Scheduler.update_from_output)
    # Replaces vllm.v1.core.sched.scheduler.Scheduler.schedule: vLLM's output, plus (pipeline parallelism only) the
    # scheduled trees' parents and each request's branch moves for the earlier stages.
    Scheduler.schedule = _schedule(Scheduler.schedule)


def _update_from_output(original):
    from vllm.v1.request import RequestStatus

    @functools.wraps(original)
    def update_from_output(self, scheduler_output, model_runner_output):
        if pipeline_stages(self.vllm_config) == 1:
            return original(self, scheduler_output, model_runner_output)
        stale = {req_id for req_id in scheduler_output.num_scheduled_tokens  # preempted while in flight
                 if getattr(self.requests.get(req_id), "num_stale_output_tokens", 0) > 0}
        outputs = original(self, scheduler_output, model_runner_output)
        live = {req_id for req_id in scheduler_output.num_scheduled_tokens if req_id not in stale
                and (request := self.requests.get(req_id)) is not None and request.status == RequestStatus.RUNNING
                and request.num_in_flight_tokens == 0}  # no later prefill chunk of it scheduled meanwhile
        for req_id, moves in (getattr(model_runner_output, BRANCH_MOVES, None) or {}).items():
            if req_id in live:
                setattr(self.requests[req_id], _REQUEST_MOVES, moves)
        drafts = getattr(model_runner_output, OUTPUT_DRAFTS, None)
        if drafts is not None:  # only for requests running on this step's output with nothing else in flight: a
            # request preempted since recomputes its prompt, one whose next prefill chunk is in flight was drafted
            # from part of its prompt (vLLM's own post_step never sees either case)
            self.update_draft_token_ids(_drafts_of(drafts, live))
        return outputs

    return update_from_output


def _drafts_of(drafts, req_ids: set[str]):
    """``drafts`` (vLLM's ``DraftTokenIds``, tree parents included) of the requests ``req_ids`` only."""
    kept = [index for index, req_id in enumerate(drafts.req_ids) if req_id in req_ids]
    if len(kept) == len(drafts.req_ids):
        return drafts
    result = type(drafts)([drafts.req_ids[i] for i in kept], [drafts.draft_token_ids[i] for i in kept])
    parents = getattr(drafts, DRAFT_PARENTS, None)
    if parents:
        setattr(result, DRAFT_PARENTS, {req_id: value for req_id, value in parents.items() if req_id in req_ids})
    return result


def _schedule(original):
    @functools.wraps(original)
    def schedule(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        if pipeline_stages(self.vllm_config) == 1:
            return output
        restarted = ({request.req_id for request in output.scheduled_new_reqs}
                     | set(output.scheduled_cached_reqs.resumed_req_ids))
        moves, parents = {}, {}
        for req_id in output.num_scheduled_tokens:
            request = self.requests[req_id]
            request_moves = getattr(request, _REQUEST_MOVES, None)
            if request_moves is not None:
                setattr(request, _REQUEST_MOVES, None)
                if req_id not in restarted:  # a restarted request recomputes into new blocks
                    moves[req_id] = request_moves
            tokens = output.scheduled_spec_decode_tokens.get(req_id)
            request_parents = getattr(request, REQUEST_PARENTS, None)
            if tokens and request_parents is not None:
                parents[req_id] = request_parents[: len(tokens)]
        setattr(output, BRANCH_MOVES, moves)
        setattr(output, SCHEDULED_PARENTS, parents)
        spec = self.vllm_config.speculative_config
        if spec is not None:
            cached = output.scheduled_cached_reqs
            setattr(output, RECENT_TOKENS, {
                req_id: self.requests[req_id].all_token_ids[max(0, computed - spec.num_speculative_tokens): computed]
                for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True)})
        return output

    schedule._easyspec_patched = True
    return schedule


def catch_up_accepted_tokens(scheduler_output, requests, input_batch) -> None:
    """Before vLLM's ``GPUModelRunner._update_states`` on a stage before the last: each running request's accepted
    drafts appended to its tokens. vLLM sends such a stage only the tokens it computes next (``new_token_ids``, from
    ``num_computed_tokens``), so without this it counted a step's accepted drafts as one token and filled their
    places with the bonus token; with them its own update appends the bonus after them."""
    recent: dict[str, list[int]] = getattr(scheduler_output, RECENT_TOKENS, None) or {}
    cached = scheduler_output.scheduled_cached_reqs
    for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
        state = requests.get(req_id)
        missing = 0 if state is None or req_id in cached.resumed_req_ids else computed - state.num_tokens
        if missing <= 0 or req_id not in recent:
            continue
        tokens = recent[req_id][-missing:]
        state.output_token_ids.extend(tokens)
        row = input_batch.req_id_to_index.get(req_id)
        if row is None:  # out of the persistent batch since its last step: vLLM adds it back from its state
            continue
        start = int(input_batch.num_tokens_no_spec[row])
        input_batch.token_ids_cpu[row, start : start + missing] = tokens
        input_batch.is_token_ids[row, start : start + missing] = True
        input_batch.num_tokens_no_spec[row] = start + missing


def attach_step_output(output: Any, drafts: Any, moves: dict[str, Moves]) -> None:
    """The last stage's ``ModelRunnerOutput`` carries the step's drafts (``DraftTokenIds`` or None) and moves."""
    if output is None:
        return
    setattr(output, OUTPUT_DRAFTS, drafts)
    setattr(output, BRANCH_MOVES, moves)
