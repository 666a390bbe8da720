"""Nothing on the step path waits for the device unless instruments are on.

The runner's device is the second device of ``fake_device`` inside ``counting_syncs()``: its tensors say
``is_cuda``, CUDA events are stand-ins, and every call that would make the host wait for a GPU is counted
(``torch.cuda.synchronize``, an event's ``synchronize``, a read of a device tensor's values). The plugin's
drafting stage, the ``tree.auto`` policy's timings of first pass, levels, drafting and verify, and the verify
step's end must count none. Before the timings went through CUDA events read a step later, three drafting steps
counted three ``torch.cuda.synchronize`` calls (``DraftingStats.count_step``) and an ``auto`` verify step one
(``TreeRunnerMixin._sample``).
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.fake_device import counting_syncs, second_device
from vllm_easyspec.control.controller import SpeculationController
from vllm_easyspec.control.cost import CostCurve, StepCostModel
from vllm_easyspec.instruments.device_clock import DeviceClock, DraftingStats
from vllm_easyspec.integration.node_policy import AutoBudget, TreeBudget, VerifyShape
from vllm_easyspec.tree.config import TreeConfig

TREE = TreeConfig.model_validate({"top_k": 2, "depth": 3, "budget": 6, "auto": {}})


def _controller() -> SpeculationController:
    cost = StepCostModel(CostCurve.from_measurements([1, 8], [0.010, 0.012]),
                         CostCurve.from_measurements([1], [0.002]))
    return SpeculationController(cost, max_depth=TREE.max_depth, max_nodes=TREE.num_nodes, level_width=2)


def _auto(device: torch.device) -> AutoBudget:
    return AutoBudget(TREE, _controller(), DeviceClock(torch.device("cuda")))


def test_a_plugin_proposers_drafting_steps_wait_for_nothing():
    """``PluginProposerMixin.propose`` (the EasySpec chain and every tree drafter go through it) times and
    counts the step without waiting; the counters are complete once an instrument settles them."""
    from vllm_easyspec.integration.proposers import PluginProposerMixin

    class VllmProposer:  # vLLM's propose: drafts on the device
        def propose(self, **arguments):
            return self.drafts

    class Proposer(PluginProposerMixin, VllmProposer):
        pass

    with second_device() as device, counting_syncs() as waits:
        proposer = object.__new__(Proposer)
        proposer.device = torch.device("cuda")  # the runner's device, as vLLM gives it to the proposer
        proposer.vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(pipeline_parallel_size=1))
        proposer._set_up_plugin(types.SimpleNamespace(tree=None))
        proposer.drafts = torch.zeros(2, 3, dtype=torch.int64, device=device)
        for _ in range(3):
            proposer.propose(num_speculative_tokens=3, target_token_ids=None, target_positions=None,
                             target_hidden_states=None, next_token_ids=None, token_indices_to_sample=None,
                             common_attn_metadata=None, sampling_metadata=None)
        assert len(waits) == 0, waits.describe()
        stats = proposer.drafting_stats.settled().as_dict()
    assert stats["steps"] == 3 and stats["drafted_requests"] == 6 and stats["drafting_seconds"] > 0


def test_the_auto_policys_drafting_and_verify_timings_wait_for_nothing():
    """A whole ``tree.auto`` step as the drafter and the runner time it (first pass, levels, drafting stage,
    then the verify, closed by ``TreeRunnerMixin._sample``): the controller gets every timing, none waits."""
    from vllm.v1.outputs import SamplerOutput

    from vllm_easyspec.integration.runner import TreeRunnerMixin
    from vllm_easyspec.integration.tree_step import TreeVerifier

    with second_device() as device, counting_syncs() as waits:
        policy = _auto(device)
        seen = []
        for name in ("observe_first_pass", "observe_draft", "observe_drafting", "observe_verify"):
            method = getattr(policy.controller, name)
            setattr(policy.controller, name, lambda *a, _m=method, _n=name, **k: (seen.append(_n), _m(*a, **k)))
        depth = policy.plan_depth(["a", "b"], 4, {}, None)
        drafting = policy.start()
        mark = policy.start()
        policy.first_pass_done(mark, rows=4, requests=2)
        mark = policy.start()
        policy.levels_done(mark, levels=max(depth, 1), rows_per_level=4)
        policy.drafting_done(drafting)
        policy.verify_started(policy.start(), VerifyShape(rows=6, masked_rows=0, requests=2, masked_requests=0))
        output = SamplerOutput(sampled_token_ids=torch.zeros(2, 1, dtype=torch.int32, device=device),
                               logprobs_tensors=None)
        runner = types.SimpleNamespace(
            tree_verifier=TreeVerifier(requests={}, policy=policy), _step_trace=None,
            input_batch=types.SimpleNamespace(update_async_output_token_ids=lambda: None, sampling_metadata=None),
            sampler=lambda logits, sampling_metadata: output)
        TreeRunnerMixin._sample(runner, torch.zeros(2, 5, device=device), types.SimpleNamespace(max_spec_len=0))
        assert len(waits) == 0, waits.describe()
    assert seen == ["observe_first_pass", "observe_draft", "observe_drafting", "observe_verify"]
    assert policy.controller.current_cycle is None  # the verify closed the cycle its plan opened


class _LateEvent:
    """A CUDA event the device passes only when the test says so."""

    done: set[int] = set()
    _next = 0

    def __init__(self, enable_timing: bool = False) -> None:
        _LateEvent._next += 1
        self.id = _LateEvent._next

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.id in _LateEvent.done

    def synchronize(self) -> None:
        _LateEvent.done.add(self.id)

    def elapsed_time(self, end: _LateEvent) -> float:
        return float(end.id - self.id)


def test_a_gpu_span_reaches_the_controller_late_in_its_own_cycle(monkeypatch):
    """On a GPU the verify of step t is read after step t + 1 planned: it still closes cycle t, and the new
    cycle stays open. Spans are delivered in the order they stopped, only once the device passed them."""
    monkeypatch.setattr(torch.cuda, "Event", _LateEvent)
    policy = _auto(torch.device("cuda"))
    controller = policy.controller
    policy.plan_depth(["a"], 2, {}, None)
    first = controller.current_cycle
    policy.verify_started(policy.start(), VerifyShape(rows=3, masked_rows=0, requests=1, masked_requests=0))
    policy.verify_done()
    assert policy.clock.pending == 1 and first is controller.current_cycle  # not read yet: not closed
    policy.plan_depth(["a"], 2, {}, None)
    second = controller.current_cycle
    assert second is not first
    _LateEvent.done |= set(range(_LateEvent._next + 1))  # the device passes everything recorded so far
    policy.clock.poll()
    assert policy.clock.pending == 0 and controller.current_cycle is second


def test_a_fixed_tree_budget_times_nothing_and_keeps_each_trees_prefix():
    from vllm_easyspec.integration.node_policy import CandidateTree
    from vllm_easyspec.tree.building import ChildDrawMode

    policy = TreeBudget(TreeConfig.model_validate({"top_k": 2, "depth": 3, "budget": 6,
                                                   "budget_by_batch": {"4": 2}}))
    assert policy.start() is None and policy.budget(1).nodes == 6 and policy.budget(4).nodes == 2
    tree = CandidateTree("a", [5, 6, 7], [-1, 0, 0], ChildDrawMode.WITHOUT_REPLACEMENT)
    assert policy.choose([tree], node_limit=2, batch_size=4, logprobs=None)["a"].tokens == [5, 6]


def test_drafting_counters_hold_what_the_device_finished_and_settle_waits_for_the_rest(monkeypatch):
    """The one wait the clock has is for instruments: ``settle``."""
    monkeypatch.setattr(torch.cuda, "Event", _LateEvent)
    clock = DeviceClock(torch.device("cuda"))
    stats = DraftingStats(clock=clock)
    stats.count_step(clock.start(), 2)
    assert stats.steps == 1 and stats.drafting_seconds == 0 and clock.pending == 1
    stats.settled()
    assert clock.pending == 0 and stats.drafting_seconds > 0 and stats.timed_steps == 1


@pytest.mark.parametrize("device", ["cpu", None])
def test_a_host_clock_delivers_at_once(device):
    clock = DeviceClock(device)
    seconds = []
    clock.stop(clock.start(), seconds.append)
    assert len(seconds) == 1 and seconds[0] >= 0 and clock.pending == 0


@pytest.mark.parametrize(("policy", "reads"), [("every_round", 0), ("never", 0), ("on_mismatch", 1)])
def test_bonus_calibration_reads_acceptance_only_where_its_policy_decides_by_it(policy, reads):
    """EasySpec's first draft forward: ``every_round`` (the default) and ``never`` decide without the device;
    ``on_mismatch`` reads once whether every draft was accepted (here one was not: the forward runs exact)."""
    from vllm_easyspec.easyspec.calibration import CalibrationSchedule
    from vllm_easyspec.integration.proposers import EasySpecDraftProposer

    proposer = object.__new__(EasySpecDraftProposer)
    proposer.calibration, proposer.drafting_batch = CalibrationSchedule(policy), types.SimpleNamespace(
        has_prompt_tokens=lambda rows: False)
    with second_device() as device:
        rejected = torch.tensor([0, 2, 0], device=device)
        with counting_syncs() as waits:
            proposer.start_drafting_step({"num_rejected_tokens_gpu": rejected,
                                          "common_attn_metadata": types.SimpleNamespace(batch_size=lambda: 3)})
    assert len(waits) == reads, waits.describe()
    assert proposer.calibration.next_forward_exact() is (policy != "never")
