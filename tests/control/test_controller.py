"""The speculation controller's pure parts (``vllm_easyspec.control``): cost curves, the acceptance model's
calibration, and the choice of depth and nodes."""

from __future__ import annotations

import math
import random

import pytest

from vllm_easyspec.control.acceptance import (
    LOOKUP_CONTINUATION_PRIOR,
    LOOKUP_PRIOR,
    AcceptanceModel,
    NodeFeatures,
)
from vllm_easyspec.control.controller import (
    FIRST_DEPTH_RATE,
    GUARD_MIN_CYCLES,
    OutcomeGuard,
    RequestTree,
    SpeculationController,
)
from vllm_easyspec.control.cost import (
    CALIBRATION_REPEATS,
    CALIBRATION_SECONDS_PER_POINT,
    RECHECK_ROWS,
    VERIFY_HISTORY,
    CostCurve,
    StepCostModel,
    time_forwards,
)
from vllm_easyspec.control.planning import (
    AveragedOffer,
    Candidates,
    OfferedTree,
    at_least,
    best_first_order,
    best_nodes,
    choose_depth,
    choose_nodes,
    path_length,
    running_minimum,
    with_top_path_first,
)


def test_a_cost_curve_goes_through_its_points_and_its_floor_bounds_it_at_every_larger_row_count():
    curve = CostCurve.from_measurements([4, 1, 2, 8], [0.012, 0.010, 0.009, 0.020])
    assert curve.rows == (1, 2, 4, 8) and curve.seconds == (0.010, 0.009, 0.012, 0.020)
    assert curve.floor_seconds == (0.009, 0.009, 0.012, 0.020)
    assert curve(3) == pytest.approx(0.0105) and curve(16) == pytest.approx(0.036) and curve(0) == 0.010
    assert curve.floor(0) == 0.009 and curve.per_extra_row(8) == pytest.approx(0.002)
    rng = random.Random(5)
    for _ in range(50):
        rows = sorted(rng.sample(range(1, 40), rng.randint(1, 8)))
        curve = CostCurve.from_measurements(rows, [rng.uniform(0.01, 0.05) for _ in rows])
        grid = [x / 4 for x in range(0, 200)]
        assert all(curve.floor(x) <= curve.floor(y) + 1e-15 for x, y in zip(grid, grid[1:]))
        assert all(curve.floor(x) <= curve(y) + 1e-15 for x in grid for y in grid if y >= x)


def test_a_slow_row_count_is_priced_as_measured_and_raises_no_other():
    # as measured on a 2-core CPU at batch 1: two rows slower than four to six, then about 2 ms per row
    curve = CostCurve.from_measurements([1, 2, 3, 4, 5, 6, 7, 8, 16],
                                        [0.046, 0.062, 0.046, 0.044, 0.044, 0.045, 0.050, 0.053, 0.069])
    assert curve(2) == 0.062 and curve(1) == 0.046 and curve(4) == 0.044
    assert curve.floor_seconds[:6] == (0.044,) * 4 + (0.044, 0.045)
    assert curve(8) - curve(5) == pytest.approx(0.009)  # the slope where it is, not flattened by the 2-row point
    # one node (two rows) costs 16 ms more, too much for a 30%-likely node; three nodes cost nothing more
    model = StepCostModel(curve, CostCurve.from_measurements([1], [0.002]))
    assert choose_nodes([Candidates([0.4, 0.3, 0.2], cap=3)], model.verify_seconds, 0.0, model.verify_floor) == [3]
    assert choose_nodes([Candidates([0.3], cap=3)], model.verify_seconds, 0.0, model.verify_floor) == [0]


def test_the_cost_model_follows_a_machine_that_slows_down_and_learns_what_calibration_missed():
    curve = CostCurve.from_measurements([1, 8, 64], [0.01, 0.02, 0.05])
    slower = StepCostModel(curve, CostCurve.from_measurements([1], [0.005]))
    for rows in [1, 4, 8, 16, 32] * 8:  # every step twice as slow as calibrated
        slower.observe_verify(rows, 2 * curve(rows))
    assert slower.verify_seconds(24) == pytest.approx(2 * curve(24), rel=0.05)
    per_row = StepCostModel(curve, CostCurve.from_measurements([1], [0.005]))
    for rows in [2, 6, 10, 20, 40] * 8:  # the bare forward as calibrated, plus 3 ms per row (attention, sampler)
        per_row.observe_verify(rows, curve(rows) + 0.003 * rows)
    for rows in (30, 64):  # rows it never saw: the bare forward's curve plus the cost per row it learnt
        assert per_row.verify_seconds(rows) == pytest.approx(curve(rows) + 0.003 * rows, rel=0.1)
    assert per_row.extra_per_row > 0.001
    assert per_row.draft_seconds(2, 1) == pytest.approx(0.01) and per_row.draft_seconds(0, 1) == 0.0
    for _ in range(64):  # steps of one size only: the prediction there is right, whatever the split
        per_row.observe_verify(17, 0.12)
    assert per_row.verify_seconds(17) == pytest.approx(0.12, rel=0.05)


def test_the_verify_fit_reads_the_last_steps_only_however_many_came_before():
    curve = CostCurve.from_measurements([1, 8, 64], [0.01, 0.02, 0.05])
    rng = random.Random(3)
    steps = []
    for index in range(VERIFY_HISTORY * 7 + 5):  # the machine's speed and the dear rows change as it goes
        requests = rng.randint(1, 16)
        rows = requests + rng.choice([0, rng.randint(1, 20)])
        masked = rng.choice([0, rows - requests + 1]) if rows > requests else 0
        slow = 1 + index // VERIFY_HISTORY * 0.3
        steps.append((rows, slow * curve(rows) + 0.002 * masked + rng.uniform(0, 0.004), masked, int(masked > 0),
                      requests))
    served, fresh = (StepCostModel(curve, CostCurve.from_measurements([1], [0.005])) for _ in range(2))
    for step in steps:
        served.observe_verify(*step)
    for step in steps[-VERIFY_HISTORY:]:
        fresh.observe_verify(*step)
    for name in ("verify_scale", "extra_per_row", "extra_per_masked_row", "extra_per_masked_request",
                 "extra_per_speculating_row"):
        assert getattr(served, name) == pytest.approx(getattr(fresh, name), rel=1e-9, abs=1e-12), name


def test_the_cost_model_learns_what_a_step_with_nodes_costs_beyond_its_rows():
    # batch 16: a plain step costs the curve; a step verifying any node also samples and attends dearer, 1 ms
    # per row of the whole batch (so one node costs 17 ms more, not the curve's 3 ms)
    curve = CostCurve.from_measurements([1, 16, 64], [0.06, 0.08, 0.22])
    model = StepCostModel(curve, CostCurve.from_measurements([1], [0.005]))
    rng = random.Random(2)
    for _ in range(64):
        requests = rng.randint(12, 16)
        rows = requests + rng.choice([0, 0, rng.randint(1, 4)])
        model.observe_verify(rows, curve(rows) + 0.001 * rows * (rows > requests), requests=requests)
    assert model.extra_per_speculating_row == pytest.approx(0.001, rel=0.15)
    assert model.verify_seconds(16) == pytest.approx(curve(16), rel=0.03)  # plain: no speculation's cost
    assert model.verify_seconds(17, requests=16) == pytest.approx(curve(17) + 0.017, rel=0.03)
    assert model.verify_seconds(16, requests=16) == pytest.approx(model.verify_seconds(16))
    assert "ms per row of a step with nodes" in model.describe()


def test_a_node_that_pays_for_its_row_but_not_for_speculating_at_all_is_not_verified():
    batch = [Candidates([0.9], cap=1)] + [Candidates([], cap=1)] * 15
    rows_only = _linear(0.004, fixed=0.1)  # 16 rows: 164 ms; one more row 4 ms for 0.9 tokens: pays
    assert choose_nodes(batch, rows_only, 0.0) == [1] + [0] * 15
    speculating = _linear(0.004, fixed=0.1, per_speculating_row=0.001)  # ... but any node costs 17 ms more
    assert choose_nodes(batch, speculating, 0.0) == [0] * 16
    assert choose_nodes([Candidates([0.9] * 4, cap=4)], speculating, 0.0) == [4]  # at batch 1 it still pays
    chains = _chains([[0.9]] + [[0.0]] * 15, 1)
    assert choose_depth(chains, rows_only, lambda depth: 0.001).depth == 1
    assert choose_depth(chains, speculating, lambda depth: 0.001).depth == 0


def test_the_cost_model_learns_what_a_row_of_a_branching_tree_adds():
    curve = CostCurve.from_measurements([1, 8, 64], [0.01, 0.02, 0.05])
    model = StepCostModel(curve, CostCurve.from_measurements([1], [0.005]))
    rng = random.Random(1)
    for _ in range(64):  # steps of paths and of branching trees: 1 ms per row, and 4 ms more per masked row
        rows = rng.randint(4, 24)
        masked = rng.choice([0, 0, rng.randint(2, rows)])
        model.observe_verify(rows, curve(rows) + 0.001 * rows + 0.004 * masked, masked)
    assert model.extra_per_masked_row == pytest.approx(0.004, rel=0.15)
    # plain floats: the fit travels in the engine's outputs, which vLLM's encoder refuses numpy scalars in
    assert all(type(x) is float for x in (model.verify_scale, model.extra_per_row, model.extra_per_masked_row))
    assert model.verify_seconds(20, 10) == pytest.approx(curve(20) + 0.02 + 0.04, rel=0.05)
    assert model.verify_seconds(20) == pytest.approx(curve(20) + 0.02, rel=0.1)
    flat = StepCostModel(curve, CostCurve.from_measurements([1], [0.005]))
    for rows in [4, 8, 16] * 20:  # masked rows cost nothing extra (and cannot make the extra negative)
        flat.observe_verify(rows, curve(rows), rows // 2)
    assert flat.extra_per_masked_row >= 0 and flat.verify_seconds(16, 8) == pytest.approx(curve(16), rel=0.05)


def _features(depth: int, logprob: float | None = -0.1, lookup: bool = False) -> NodeFeatures:
    return NodeFeatures(from_lookup=lookup, depth=depth, draft_logprob=logprob)


def test_the_acceptance_model_learns_the_observed_rate_and_never_exceeds_a_parent():
    model = AcceptanceModel()
    chain = [_features(1), _features(2), _features(3)]
    parents = [-1, 0, 1]
    rng = random.Random(0)
    for _ in range(400):  # a draft that is sure of itself (q = 0.9) but right 40% of the time at each depth
        accepted = set()
        for node in range(3):
            if rng.random() >= 0.4:
                break
            accepted.add(node)
        model.observe("r", chain, parents, accepted)
    chances = model.path_chances("r", chain, parents)
    assert chances == sorted(chances, reverse=True)
    assert chances[0] == pytest.approx(0.4, abs=0.08) and chances[1] == pytest.approx(0.16, abs=0.06)
    table = model.conditional.table()  # calibrated: over every tested node, predicted agrees with observed
    tested = sum(row["nodes"] for row in table)
    predicted = sum(row["predicted"] * row["nodes"] for row in table) / tested
    observed = sum(row["observed"] * row["nodes"] for row in table) / tested
    assert predicted == pytest.approx(observed, abs=0.05)


def test_a_lookup_paths_chances_follow_every_observation():
    model = AcceptanceModel()
    lookup = [NodeFeatures(True, depth, None) for depth in (1, 2, 3)]
    rng = random.Random(3)
    for step in range(40):
        req_id = f"r{step % 3}"
        assert model.lookup_path_chances(req_id, 3) == model.path_chances(req_id, lookup, [-1, 0, 1])
        accepted = {0, 1} if rng.random() < 0.5 else set()
        model.observe(req_id, lookup, [-1, 0, 1], accepted)
        model.forget({"r0", "r1"} if step == 20 else {"r0", "r1", "r2"})


def test_before_any_observation_a_lookup_path_is_priced_as_one_copy_not_independent_guesses():
    chances = AcceptanceModel().lookup_path_chances("r", 4)
    # each node after the first is likely once its parent was right: the chance falls slower than the first step
    assert chances == pytest.approx([LOOKUP_PRIOR * LOOKUP_CONTINUATION_PRIOR**k for k in range(4)])
    assert chances[3] / chances[2] > chances[0]


def test_a_bin_verification_has_not_reached_predicts_what_nodes_like_it_have_shown():
    sure = math.log(0.98)  # a draft sure of itself, right 70% of the time
    model = AcceptanceModel()
    rng = random.Random(1)
    for step in range(300):  # each request's first step: all in the bin of requests without history
        model.observe(f"r{step}", [NodeFeatures(False, 1, sure)], [-1], {0} if rng.random() < 0.7 else set())
    model.recent["lucky"] = 0.9  # a request whose recent acceptance is in a bin no verification reached
    unseen = model.recent_bin("lucky")
    assert not any(key[3] == unseen for key in model.bins)
    assert model.conditional_chance(NodeFeatures(False, 1, sure), unseen) == pytest.approx(0.7, abs=0.06)
    deeper = NodeFeatures(False, 2, sure)  # depth is learnt apart: a deeper node keeps the draft's confidence
    assert model.conditional_chance(deeper, unseen) == pytest.approx(0.98)
    lookup = NodeFeatures(True, 1, None)  # and so is the source
    assert model.conditional_chance(lookup, unseen) == pytest.approx(LOOKUP_PRIOR)


def test_nodes_are_best_first_and_parents_come_first():
    chances = [0.5, 0.9, 0.45, 0.8, 0.8]
    parents = [-1, -1, 0, 1, 3]
    order = best_first_order(chances, parents)
    assert order == [1, 3, 4, 0, 2]
    assert all(parents[n] < 0 or order.index(parents[n]) < order.index(n) for n in order)
    assert running_minimum([0.5, 0.7, 0.2, 0.4]) == [0.5, 0.5, 0.2, 0.2]


def _linear(per_row: float, fixed: float = 0.05, per_masked_row: float = 0.0, per_masked_request: float = 0.0,
            per_speculating_row: float = 0.0):
    return lambda rows, masked_rows, masked_requests, requests: (
        fixed + per_row * rows + per_masked_row * masked_rows + per_masked_request * masked_requests
        + per_speculating_row * rows * (rows > requests))


def _chains(expected_by_depth: list[list[float]], cap: int = 8,
            lookup: list[list[float]] | None = None) -> list[list[Candidates]]:
    """Per depth, each request offering a chain of drafted nodes (``expected_by_depth[i][j]``: the chance of its
    node at depth ``j + 1``) as deep as drafted, and its lookup nodes (``lookup[i]``) at every depth."""
    return [[Candidates(sorted(rates[:depth] + (lookup[i] if lookup else []), reverse=True)[:cap], cap)
             for i, rates in enumerate(expected_by_depth)]
            for depth in range(1, max(len(rates) for rates in expected_by_depth) + 1)]


def _chain_tree(chances: list[float], lookup: list[float] = ()) -> OfferedTree:
    """An offered tree drafted ``len(chances)`` levels: a chain with these chances, and a lookup path from the
    root with those."""
    drafted, path = len(chances), len(lookup)
    chain_parents = [index - 1 for index in range(drafted)]
    path_parents = [-1 if index == drafted else index - 1 for index in range(drafted, drafted + path)]
    return OfferedTree(drafted, (*chances, *lookup), (*chain_parents, *path_parents),
                       (False,) * drafted + (True,) * path)


def _offer(controller: SpeculationController, req_id: str, tree: OfferedTree) -> None:
    """``req_id``'s average offer at every depth ``tree`` drafted becomes what it offered there (at steps with a
    lookup path where ``tree`` has lookup nodes)."""
    with_lookup = any(tree.from_lookup)
    controller.offered[req_id] = {(depth, with_lookup): AveragedOffer.of(offer)
                                  for depth, offer in enumerate(tree.by_depth(controller.max_nodes), start=1)}


def test_the_cost_model_learns_apart_what_a_branching_tree_costs_per_row_and_per_request():
    curve = CostCurve.from_measurements([1, 8, 64], [0.01, 0.02, 0.05])
    model = StepCostModel(curve, CostCurve.from_measurements([1], [0.005]))
    rng = random.Random(2)
    for _ in range(64):  # batches of 1-4 whose trees branch or not: 0.2 ms per masked row, 3 ms per masked tree
        batch = rng.randint(1, 4)
        sizes = [rng.randint(1, 8) for _ in range(batch)]
        branching = [size for size in sizes if size > 1 and rng.random() < 0.5]
        rows, masked_rows = batch + sum(sizes), sum(1 + size for size in branching)
        model.observe_verify(rows, curve(rows) + 0.0002 * masked_rows + 0.003 * len(branching), masked_rows,
                             len(branching))
    # what branching adds to a lone request's small tree and to its large one (the prior pulls the fit a little)
    assert model.verify_seconds(3, 3, 1) - model.verify_seconds(3) == pytest.approx(0.0036, rel=0.15)
    assert model.verify_seconds(9, 9, 1) - model.verify_seconds(9) == pytest.approx(0.0048, rel=0.15)
    assert model.extra_per_masked_request > 0.002 and type(model.extra_per_masked_request) is float


def test_a_fixed_cost_per_branching_tree_buys_a_branch_only_with_enough_chance_behind_it():
    parents = [-1, 0, -1, 1, 2, 0]  # the top path (0, 1), then a sibling of node 0 and more nodes
    tree = Candidates([0.9, 0.6, 0.4, 0.3, 0.3, 0.3], cap=6, path_length=path_length(parents))
    # 3 ms per branching tree, rows nearly free: the first branch (0.4) does not pay on its own, all four do
    assert choose_nodes([tree], _linear(0.0001, per_masked_request=0.003), 0.0) == [6]
    assert choose_nodes([Candidates([0.9, 0.6, 0.04, 0.01], cap=4, path_length=2)],
                        _linear(0.0001, per_masked_request=0.003), 0.0) == [2]


def test_a_branch_is_chosen_only_when_its_chance_pays_for_masked_attention_over_every_row_of_its_tree():
    # best first: the top path (nodes 0, 1), then a sibling of node 0 (its parent is the root), then node 1's child
    parents = [-1, 0, -1, 1]
    assert path_length(parents) == 2 and path_length([-1, 0, 1]) == 3 and path_length([]) == 0
    tree = Candidates([0.9, 0.6, 0.4, 0.3], cap=4, path_length=path_length(parents))
    assert [tree.masked_rows(n) for n in range(5)] == [0, 0, 0, 4, 5]
    # rows cost 1 ms, masked rows nothing more: the sibling pays (0.4 tokens for 1 ms on a ~55 ms step)
    assert choose_nodes([tree], _linear(0.001), 0.0) == [4]
    # a row of a branching tree costs 5 ms more: the sibling would make all 4 rows masked, so the path stays alone
    assert choose_nodes([tree], _linear(0.001, per_masked_row=0.005), 0.0) == [2]
    # the same chances as a path never pay the masked cost
    chain = Candidates([0.9, 0.6, 0.4, 0.3], cap=4, path_length=4)
    assert choose_nodes([chain], _linear(0.001, per_masked_row=0.005), 0.0) == [4]


def test_cheap_rows_buy_every_likely_node_and_expensive_rows_only_the_surest():
    requests = [Candidates([0.9, 0.6, 0.3, 0.1], cap=4) for _ in range(4)]
    # a row costs 1 ms on a 50 ms step: a node pays above a chance of about 0.17 (rate x cost per row)
    assert choose_nodes(requests, _linear(0.001), 0.0) == [3, 3, 3, 3]
    # a row costs as much as the step: only a node that nearly doubles its request's tokens pays
    assert choose_nodes(requests, _linear(0.05), 0.0) == [1, 1, 1, 1]
    assert choose_nodes([Candidates([0.3, 0.1], cap=2)] * 4, _linear(0.05), 0.0) == [0, 0, 0, 0]


def _rate_of_best(candidates: list[Candidates], total: int, verify, other_seconds: float) -> float:
    """The predicted rate of verifying the batch's ``total`` most likely nodes."""
    counts = best_nodes(candidates, total)
    gain = sum(sum(c.chances[:n]) for c, n in zip(candidates, counts, strict=True))
    masked = [c.masked_rows(n) for c, n in zip(candidates, counts, strict=True)]
    seconds = verify(len(candidates) + total, sum(masked), sum(m > 0 for m in masked)) + other_seconds
    return (len(candidates) + gain) / seconds


def test_the_choice_looks_at_every_count_that_could_still_win_and_stops_only_where_none_can():
    """Against a scan of every count: a verify curve flat past a steep step (a later count can beat an earlier
    best), branching trees, and caps."""
    rng = random.Random(7)
    steep_then_flat = StepCostModel(CostCurve.from_measurements([1, 2, 3, 8, 9, 40, 41, 400],
                                                                [0.05, 0.07, 0.05, 0.05, 0.08, 0.08, 0.2, 1.0]),
                                    CostCurve.from_measurements([1], [0.001]), extra_per_masked_row=0.0004,
                                    extra_per_masked_request=0.002)  # 2 rows dearer than 3 to 8, as measured
    for _ in range(300):
        batch = rng.randint(1, 12)
        candidates = []
        for _ in range(batch):
            chances = sorted((rng.random() ** rng.choice([0.3, 1, 3]) for _ in range(rng.randint(0, 12))),
                             reverse=True)
            candidates.append(Candidates(chances, rng.randint(1, 12), rng.choice([None, 0, 1, 3])))
        verify = steep_then_flat.verify_seconds
        other = rng.choice([0.0, 0.01])
        offered = sum(min(len(c.chances), c.cap) for c in candidates)
        rates = [_rate_of_best(candidates, total, verify, other) for total in range(offered + 1)]
        best = max(range(1, offered + 1), key=lambda total: (rates[total], -total), default=0)
        expected = best if best and rates[best] > rates[0] * (1 + 1e-9) else 0
        chosen = choose_nodes(candidates, verify, other, steep_then_flat.verify_floor)
        assert sum(chosen) == expected or math.isclose(rates[sum(chosen)], rates[expected], rel_tol=1e-9)
        assert chosen == best_nodes(candidates, sum(chosen))


def test_the_depth_plan_is_the_best_of_a_scan_of_every_depth_and_count():
    """Against a scan of every option: each depth's best count over a verify curve flat past a steep step,
    chances with ties across requests, lookup paths alone as depth 0; the plan stops pricing a depth's counts
    once none can beat the best option so far, and must still find the best one."""
    rng = random.Random(11)
    model = StepCostModel(CostCurve.from_measurements([1, 2, 3, 8, 9, 40, 41, 400],
                                                      [0.05, 0.07, 0.05, 0.05, 0.08, 0.08, 0.2, 1.0]),
                          CostCurve.from_measurements([1], [0.001]), extra_per_masked_row=0.0004,
                          extra_per_masked_request=0.002)
    verify = model.verify_seconds
    for _ in range(300):
        batch, depths = rng.randint(1, 16), rng.randint(1, 5)
        by_depth: list[list[Candidates]] = [[] for _ in range(depths)]
        for _ in range(batch):
            chances: list[float] = []
            for depth in range(depths):  # each depth offers what the shallower one did, and more
                chances = sorted(chances + [round(rng.random() ** rng.choice([0.5, 1, 3]), 1)
                                            for _ in range(rng.randint(0, 4))], reverse=True)
                by_depth[depth].append(Candidates(chances, rng.randint(4, 12), rng.choice([None, 1, 3])))
        lookup = [Candidates([0.6] * rng.choice([0, 0, 3]), 4) for _ in range(batch)]
        draft_seconds = rng.choice([0.0, 0.004, 0.02]) * rng.random()

        def drafting(depth: int, per_level: float = draft_seconds) -> float:
            return 0.003 + per_level * depth

        options = [(batch / verify(batch, 0, 0, batch), 0)]
        for depth, candidates in [(0, lookup)] + list(enumerate(by_depth, start=1)):
            other = drafting(depth) if depth else 0.0
            offered = sum(min(len(c.chances), c.cap) for c in candidates)
            options += [(_rate_of_best(candidates, total, verify, other), depth) for total in range(1, offered + 1)]
        best_rate = max(rate for rate, _ in options)
        plan = choose_depth(by_depth, verify, drafting, lookup, verify_floor=model.verify_floor)
        planned = max((rate for rate, depth in options if depth == plan.depth and (depth or plan.nodes)),
                      default=options[0][0])
        assert planned == pytest.approx(best_rate, rel=1e-6)


def test_a_request_whose_drafts_keep_failing_stops_paying_while_its_neighbours_keep_theirs():
    good, failing = Candidates([0.9, 0.8, 0.7], cap=3), Candidates([0.05, 0.01, 0.0], cap=3)
    assert choose_nodes([good, failing, good], _linear(0.004), 0.0) == [3, 0, 3]
    assert choose_nodes([good], _linear(0.004), 0.0) == [3]
    assert choose_nodes([good, good], _linear(0.0), 0.0) == [3, 3]
    assert choose_nodes([Candidates([0.9, 0.8], cap=1)], _linear(0.0), 0.0) == [1]  # the cap holds


def test_deeper_drafting_pays_only_when_acceptance_is_high_and_levels_cheap():
    def levels(level_seconds: float):
        return lambda depth: (depth - 1) * level_seconds

    verify = _linear(0.001, 0.05)
    sure, unsure = [[0.9, 0.85, 0.8, 0.75]], [[0.3, 0.1, 0.03, 0.01]]
    assert choose_depth(_chains(sure, 8), verify, levels(0.01)).depth == 4
    assert choose_depth(_chains(unsure, 8), verify, levels(0.01)).depth == 1
    assert choose_depth(_chains(sure, 8), verify, levels(0.2)).depth == 1
    assert choose_depth(_chains(sure, 2), verify, levels(0.01)).depth == 2  # a node cap of 2 never verifies depth 3


def test_a_level_is_drafted_when_the_nodes_that_pay_need_it():
    verify = _linear(0.004, 0.05)  # batch 16: 114 ms, 4 ms per extra row
    cheap_levels = lambda depth: (depth - 1) * 0.001  # noqa: E731
    # half the batch accepts nearly everything, half nearly nothing: the good half's deep nodes pay, and the bad
    # half's nodes are not verified, so they must not count against drafting deeper
    mixed = [[0.95, 0.9, 0.85]] * 8 + [[0.2, 0.05, 0.01]] * 8
    assert choose_depth(_chains(mixed, 8), verify, cheap_levels).depth == 3
    # every request's depth-2 node is a coin flip: at 4 ms a row it never pays, so depth 2 is not drafted
    assert choose_depth(_chains([[0.97, 0.5, 0.4]] * 16, 8), verify, cheap_levels).depth == 1
    # one request alone (rows nearly free): the same chances pay to depth 3
    assert choose_depth(_chains([[0.97, 0.5, 0.4]], 8), _linear(0.0005, 0.05), cheap_levels).depth == 3


def test_the_first_pass_is_paid_only_by_steps_that_draft():
    verify = _linear(0.004, 0.05)  # batch 16: 114 ms, 4 ms per extra row
    batch = [[0.6, 0.3]] * 16
    free = choose_depth(_chains(batch, 8), verify, lambda depth: 0.0)
    assert free.nodes > 0  # a 60% node for a 4 ms row pays when drafting is free
    # a first pass of 30 ms is repaid only by nodes worth more than it: these are not, so the step drafts nothing
    assert choose_depth(_chains(batch, 8), verify, lambda depth: 0.03 + (depth - 1) * 0.001).nodes == 0
    # a lone request's nodes repay the same first pass (its rows are nearly free)
    assert choose_depth(_chains([[0.9, 0.8]], 8), _linear(0.0005, 0.05), lambda depth: 0.003).nodes == 2


def test_the_first_pass_cost_follows_what_it_took():
    cost = StepCostModel(CostCurve.from_measurements([1, 8], [0.01, 0.02]),
                         CostCurve.from_measurements([1, 64], [0.002, 0.008]))
    assert cost.first_pass_seconds(0) == 0.0
    assert cost.first_pass_seconds(32) == pytest.approx(cost.draft_level(32))
    for _ in range(60):  # the first pass takes three times what one draft forward over its rows took at start-up
        cost.observe_first_pass(32, 3 * cost.draft_level(32))
    assert cost.first_pass_seconds(16) == pytest.approx(3 * cost.draft_level(16), rel=0.02)
    assert cost.draft_seconds(1, 16) == pytest.approx(cost.draft_level(16))  # the levels keep their own scale
    assert cost.observations["first_pass"] == 60


def test_a_first_pass_costs_the_forward_over_its_rows_and_the_logits_of_its_roots():
    level = CostCurve.from_measurements([1, 64], [0.002, 0.010])  # forward and logits of every row
    forward = CostCurve.from_measurements([1, 64], [0.001, 0.004])  # the forward alone
    cost = StepCostModel(CostCurve.from_measurements([1, 8], [0.01, 0.02]), level, draft_forward=forward)
    # 200 rows (a prompt) with 4 roots: the forward over 200 rows, the logits over 4 (level less forward at 4)
    assert cost.first_pass_seconds(200, 4) == pytest.approx(forward(200) + level(4) - forward(4))
    assert cost.first_pass_seconds(200, 4) < level(200) / 2
    for _ in range(60):  # the scale follows what first passes take, whatever their rows and roots
        cost.observe_first_pass(16, 2 * (forward(16) + level(8) - forward(8)), 8)
    assert cost.first_pass_seconds(300, 8) == pytest.approx(2 * (forward(300) + level(8) - forward(8)), rel=0.01)
    assert cost.draft_seconds(1, 16) == pytest.approx(level(16))


def test_start_up_timing_keeps_the_fastest_and_stops_at_the_first_slow_row_count():
    calls: list[int] = []
    slowdown = iter([3.0] + [1.0] * 100)  # the very first forward is slow (one-off costs): it is never timed

    def forward(rows: int) -> tuple[float, float]:  # 0.1 s per 8 rows, a quarter of it the logits
        calls.append(rows)
        seconds = next(slowdown) * 0.1 * rows / 8
        return seconds, 0.75 * seconds

    assert CALIBRATION_SECONDS_PER_POINT == 0.5 and CALIBRATION_REPEATS == 3
    timings = time_forwards([1, 2, 4, 8, 16, 32, 64, 128, 256], forward)
    # 64 rows took 0.8 s: the last row count timed; the curve extrapolates past it
    assert timings.rows == [1, 2, 4, 8, 16, 32, 64] and 128 not in calls
    assert timings.with_logits == pytest.approx([0.1 * rows / 8 for rows in timings.rows])
    assert timings.without_logits == pytest.approx([0.075 * rows / 8 for rows in timings.rows])
    # an untimed forward, then 3 timed ones, fewer once they add up to 0.5 s: 0.4 s twice, 0.8 s once; then one
    # more each up to RECHECK_ROWS, largest first
    assert RECHECK_ROWS == 8
    assert [calls.count(rows) for rows in timings.rows] == [5, 5, 5, 5, 4, 3, 2]
    assert calls[-4:] == [8, 4, 2, 1]


def test_start_up_timing_is_not_fooled_by_a_machine_that_settles_while_it_times():
    calls: list[int] = []

    def forward(rows: int) -> tuple[float, float]:  # 50 ms, 2 ms more per row past 4; the first 15 calls slower
        calls.append(rows)
        seconds = (0.05 + 0.002 * max(rows - 4, 0)) * (1.4 if len(calls) <= 15 else 1.0)
        return seconds, seconds

    timings = time_forwards([1, 2, 3, 4, 5, 6, 7, 8], forward)
    assert timings.with_logits == pytest.approx([0.05 + 0.002 * max(rows - 4, 0) for rows in timings.rows])


def test_the_cost_model_records_what_it_predicted_before_each_observation():
    cost = StepCostModel(CostCurve.from_measurements([1, 8], [0.01, 0.02]),
                         CostCurve.from_measurements([1, 64], [0.002, 0.008]))
    cost.observe_verify(4, 0.03)  # the start-up curve said 0.01 + 3/7 * 0.01 at 4 rows
    assert cost.predicted_seconds["verify"] == pytest.approx(0.01 + 3 / 7 * 0.01)
    assert cost.observed_seconds["verify"] == 0.03
    cost.observe_draft(2, 1, 0.008)  # two levels of 0.002 predicted; the scale then learns 0.9 + 0.1 * 2
    cost.observe_draft(2, 1, 0.008)
    assert cost.predicted_seconds["draft"] == pytest.approx(0.004 + 1.1 * 0.004)
    assert cost.observed_seconds["draft"] == pytest.approx(0.016)
    for _ in range(200):  # a model that has learnt a steady cost predicts it
        cost.observe_first_pass(8, 0.006)
    before = dict(cost.predicted_seconds), dict(cost.observed_seconds)
    cost.observe_first_pass(8, 0.006)
    assert cost.predicted_seconds["first_pass"] - before[0]["first_pass"] == pytest.approx(0.006, rel=1e-3)
    assert cost.observations == {"verify": 1, "draft": 2, "first_pass": 201, "overhead": 0}


def test_the_controller_reorders_a_tree_and_learns_from_what_was_accepted():
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 0.0005]),
                         CostCurve.from_measurements([1, 64], [0.01, 0.02]))
    controller = SpeculationController(cost, max_depth=2, max_nodes=3, level_width=2)
    tree = RequestTree("a", tokens=[7, 8, 9], parents=[-1, -1, 1],
                       features=[_features(1, -3.0), _features(1, -0.05), _features(2, -0.1)], keeps_order=False)
    (choice,) = controller.choose([tree])
    assert choice.tokens == [8, 9, 7] and choice.parents == [-1, 0, -1]  # the likely branch first
    assert choice.count >= 2 and choice.chances == sorted(choice.chances, reverse=True)
    sampled = RequestTree("b", tokens=[7, 8, 9], parents=[-1, -1, 1],
                          features=[_features(1, None), _features(1, None), _features(2, None)], keeps_order=True)
    (kept,) = controller.choose([sampled])
    assert kept.tokens == [7, 8, 9]  # i.i.d. children keep their order
    offered = sorted(controller.acceptance.path_chances("a", tree.features, tree.parents), reverse=True)
    first = [FIRST_DEPTH_RATE, FIRST_DEPTH_RATE**2, 0.0]  # the average every request starts from, at depth 2
    assert controller.offered["a"][2, False].chances == pytest.approx(  # moved a quarter of the way to what it offered
        [0.75 * before + 0.25 * now for before, now in zip(first, offered, strict=True)])
    controller.observe("a", choice.features, choice.parents, accepted={0, 1})
    assert controller.stats.realised_accepted == 2
    controller.forget({"b"})
    assert "a" not in controller.offered and "b" in controller.offered


# ---- the outcome guard ----


def _cheap_drafting_controller() -> SpeculationController:
    """Costs that make drafting look nearly free: the models alone always draft."""
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 0.0001]),
                         CostCurve.from_measurements([1, 64], [1e-5, 2e-5]))
    return SpeculationController(cost, max_depth=3, max_nodes=4, level_width=2)


def _cycle(controller: SpeculationController, req_ids: list[str], accepted: int, draft_seconds: float,
           verify_seconds: float) -> int:
    """One decode cycle as the runner drives it: plan, drafting, the verify's outcomes, the verify's timing."""
    depth = controller.plan_depth(req_ids, first_pass_rows=len(req_ids))
    controller.observe_drafting(draft_seconds if depth else 1e-4)
    if depth:
        controller.observe(req_ids[0], [NodeFeatures(False, 1, -0.1)] * accepted, list(range(-1, accepted - 1)),
                           set(range(accepted)))
    controller.observe_verify(len(req_ids) * 2, verify_seconds, requests=len(req_ids))
    return depth


def test_the_guard_holds_drafting_back_where_drafted_cycles_measurably_produce_less():
    controller = _cheap_drafting_controller()
    batch = [f"r{i}" for i in range(16)]
    # drafted cycles: 16 + 2 tokens in 0.09 s (200 tok/s) against the verify model's 16 in 0.0515 s (310 tok/s)
    depths = [_cycle(controller, batch, accepted=2, draft_seconds=0.02, verify_seconds=0.07) for _ in range(200)]
    assert all(depths[:8])  # the models alone draft until the guard has seen enough drafted cycles
    held = controller.stats.steps_held_back
    assert held > 150 and depths[8:].count(0) == held  # then it drafts only to explore
    assert controller.guard.holds_back(16, controller.cost.verify_seconds(16))
    # a lone request, a bucket of its own, whose drafts pay: never held back
    lone = [_cycle(controller, ["solo"], accepted=3, draft_seconds=0.005, verify_seconds=0.05) for _ in range(40)]
    assert all(lone) and controller.guard.table()[0]["drafted_cycles"] == 40


def test_the_guard_is_charged_a_catch_up_first_pass_in_full_spread_over_the_drafted_cycles_after_it():
    controller = _cheap_drafting_controller()
    charged: list[float] = []
    controller.guard.add = lambda drafted, requests, tokens, seconds, **_: charged.append(seconds)
    batch = ["a", "b"]
    assert controller.plan_depth(batch, first_pass_rows=2000, horizon_steps=10)  # a prompt's first pass
    controller.observe_first_pass(2000, 1.0, len(batch))
    controller.observe_drafting(1.01)
    controller.observe_verify(4, 0.05, requests=len(batch))
    assert 0.05 < charged[0] < 0.3  # its own share; the rest is left to the cycles after it
    for _ in range(200):
        assert controller.plan_depth(batch, first_pass_rows=len(batch), horizon_steps=10)
        controller.observe_drafting(0.01)
        controller.observe_verify(4, 0.05, requests=len(batch))
    assert charged[1] > charged[2] > charged[-1] == pytest.approx(0.06)
    assert sum(charged) == pytest.approx(1.01 + 0.05 + 200 * 0.06)  # every second of drafting, once


def test_a_request_offering_nodes_is_priced_in_its_whole_batch_not_alone():
    # 3 ms a row on a 50 ms step: a lookup path pays for a lone request, not among 15 others that verify a row each
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 0.003]),
                         CostCurve.from_measurements([1, 64], [0.01, 0.02]))
    never_explores = random.Random(0)
    never_explores.random = lambda: 1.0
    controller = SpeculationController(cost, max_depth=2, max_nodes=4, level_width=2, explore_draws=never_explores)
    features = [NodeFeatures(True, depth, None) for depth in (1, 2, 3)]
    path = RequestTree("edit", [5, 6, 7], [-1, 0, 1], features, keeps_order=False)
    (alone,) = controller.choose([path])
    (in_batch,) = controller.choose([path], batch_size=16)
    assert alone.count > 0 and in_batch.count == 0
    stats = controller.stats  # every request of both batches counted, those that offered nothing with no node
    assert stats.requests == 17 and stats.nodes_per_request[0] == 16 == stats.requests_without_nodes


def test_cycles_that_verified_lookup_paths_alone_are_not_the_plain_cycles_drafting_is_held_against():
    controller = _cheap_drafting_controller()
    cheap = controller.cost
    # drafting dear for a while: the plan verifies an edit's prompt-lookup path alone, which accepts every node
    controller.cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 0.0001]),
                                    CostCurve.from_measurements([1, 64], [1.0, 1.0]))
    features = [NodeFeatures(True, depth, None) for depth in (1, 2, 3)]
    for _ in range(30):
        assert controller.plan_depth(["edit"], first_pass_rows=1, lookup_lengths=[3]) == 0
        (choice,) = controller.choose([RequestTree("edit", [5, 6, 7], [-1, 0, 1], features, keeps_order=False)])
        controller.observe_drafting(1e-4)
        controller.observe("edit", choice.features, choice.parents, set(range(choice.count)))
        controller.observe_verify(1 + choice.count, 0.05, requests=1)
    assert controller.stats.lookup_only_steps > 20
    controller.forget({"chat"})  # the edit finished; a chat request, whose drafts pay, runs alone
    controller.cost = cheap
    # 2 tokens in 80 ms against a plain cycle's 1 in 50 ms: drafting pays, and the edit's paths are no baseline
    # (held to them, the chat request would draft only on the steps that explore)
    depths = [_cycle(controller, ["chat"], accepted=1, draft_seconds=0.03, verify_seconds=0.05) for _ in range(40)]
    assert all(depths) and controller.stats.steps_held_back == controller.stats.exploring_drafts == 0
    assert controller.guard.table()[0]["plain_cycles"] == 0


def _lookup_cycles(controller: SpeculationController, steps: int, lookup_seconds: float) -> list[int]:
    """Steps of 16 requests that draft nothing (drafting is dear), each offering a 3-node prompt-lookup path whose
    first node is accepted; the verify takes ``lookup_seconds`` when it checks any node, 0.05 s when none.
    Returns the nodes each step verified."""
    batch = [f"r{i}" for i in range(16)]
    features = [NodeFeatures(True, depth, None) for depth in (1, 2, 3)]
    verified = []
    for _ in range(steps):
        assert controller.plan_depth(batch, first_pass_rows=16, lookup_lengths=[3] * 16) == 0
        choices = controller.choose([RequestTree(r, [5, 6, 7], [-1, 0, 1], features, keeps_order=False)
                                     for r in batch])
        controller.observe_drafting(1e-4)
        for req_id, choice in zip(batch, choices, strict=True):
            if choice.count:
                controller.observe(req_id, choice.features[: choice.count], choice.parents[: choice.count], {0})
        nodes = sum(choice.count for choice in choices)
        controller.observe_verify(16 + nodes, lookup_seconds if nodes else 0.05, requests=16)
        verified.append(nodes)
    return verified


def test_the_guard_holds_back_lookup_paths_alone_where_their_cycles_measurably_produce_less():
    def controller_whose_models_say_lookup_pays() -> SpeculationController:
        controller = SpeculationController(
            StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 0.0001]),
                          CostCurve.from_measurements([1, 64], [1.0, 1.0])), max_depth=3, max_nodes=4, level_width=2)
        controller.cost.observe_verify = lambda *arguments, **keywords: None  # the cost model stays wrong
        return controller

    # 32 tokens in 0.2 s against 16 in 0.05 s without nodes: the guard stops the paths but to explore
    held = controller_whose_models_say_lookup_pays()
    verified = _lookup_cycles(held, 200, lookup_seconds=0.2)
    assert all(verified[:GUARD_MIN_CYCLES]) and sum(map(bool, verified[100:])) < 10
    assert held.guard.holds_back_lookup(16, held.cost.verify_seconds(16))
    assert held.guard.table()[0]["lookup_cycles"] >= GUARD_MIN_CYCLES
    # in 0.06 s they pay: every step verifies them
    paying = controller_whose_models_say_lookup_pays()
    assert all(_lookup_cycles(paying, 200, lookup_seconds=0.06))


def test_the_guard_trusts_measured_cycles_without_drafts_over_the_model():
    from vllm_easyspec.control.controller import GUARD_MIN_CYCLES, OutcomeGuard

    guard = OutcomeGuard()
    for _ in range(GUARD_MIN_CYCLES):
        guard.add(True, 8, tokens=12, seconds=0.1)  # 120 tok/s
    assert guard.holds_back(8, plain_seconds=0.05)  # the model's cycle without drafts: 160 tok/s
    assert not guard.holds_back(8, plain_seconds=0.08)  # ... 100 tok/s
    for _ in range(GUARD_MIN_CYCLES):
        guard.add(False, 9, tokens=8, seconds=0.08)  # the same bucket (8-15 requests), measured: 100 tok/s
    assert not guard.holds_back(8, plain_seconds=0.05)  # measured cycles win over the model
    assert not OutcomeGuard().holds_back(8, plain_seconds=0.05)  # nothing measured: the models decide


def _held_back_share(batch: int, accept_chance: float, tokens_when_accepted: int, drafted_seconds: float,
                     plain_seconds: float, cycles: int = 2000, guard: OutcomeGuard | None = None) -> float:
    """Share of cycles after which the guard holds back, for drafted cycles whose requests each accept
    ``tokens_when_accepted`` drafts with ``accept_chance`` (else none)."""
    rng, held = random.Random(1), 0
    guard = OutcomeGuard() if guard is None else guard
    for _ in range(cycles):
        accepted = sum(tokens_when_accepted for _ in range(batch) if rng.random() < accept_chance)
        guard.add(True, batch, batch + accepted, drafted_seconds)
        held += guard.holds_back(batch, plain_seconds)
    return held / cycles


def test_the_guard_weighs_a_lone_requests_all_or_nothing_cycles_by_their_spread():
    # a lone request: 1 + 3 tokens one cycle in 5, else 1, in 61.6 ms: 30% more tokens a second than plain
    # 50 ms cycles; a batch of 16: 5% fewer. Only the second should be held back.
    lone, batch = (1, 0.2, 3, 0.0616, 0.05), (16, 0.3, 1, 0.0897, 0.0655)
    assert _held_back_share(*lone) < 0.05 and _held_back_share(*batch) > 0.9
    assert _held_back_share(*lone, guard=OutcomeGuard(standard_errors=0.0)) > 0.08  # no allowance for the spread


def test_the_guard_forgets_the_cycles_of_requests_that_finished():
    controller = _cheap_drafting_controller()
    for _ in range(40):  # request a's drafts never pay: held back
        _cycle(controller, ["a"], accepted=0, draft_seconds=0.05, verify_seconds=0.05)
    assert controller.guard.holds_back(1, controller.cost.verify_seconds(1))
    controller.forget({"b"})  # a finished; b, alone, starts afresh
    assert not controller.guard.holds_back(1, controller.cost.verify_seconds(1))
    assert _cycle(controller, ["b"], accepted=2, draft_seconds=0.005, verify_seconds=0.05)
    # a batch of 4 kept full: a request finishing and another joining keeps what was seen (forgetting a share each
    # time would keep the guard below its minimum of cycles, and drafting would switch on and off)
    controller.forget({"c", "d", "e", "f"})
    for _ in range(40):
        _cycle(controller, ["c", "d", "e", "f"], accepted=0, draft_seconds=0.05, verify_seconds=0.05)
    bucket = controller.guard.drafted[OutcomeGuard.bucket(4)]
    before = (bucket.tokens, bucket.cycles)
    controller.forget({"c", "d", "e", "g"})
    assert (bucket.tokens, bucket.cycles) == before
    assert controller.guard.holds_back(4, controller.cost.verify_seconds(4))
    controller.forget({"h", "i", "j", "k"})  # every request it weighed has finished
    assert not controller.guard.drafted


# ---- exploring where drafting does not pay ----


def _explore(draft_level_seconds: tuple[float, float], steps: int = 800) -> SpeculationController:
    """A batch of 16 whose drafts do not pay (8 ms a verify row) and are never accepted, its first passes deferred while it drafts nothing: a step
    that explores catches up 16 rows per step since the last one that drafted (at most 32 per request: requests
    of 32 tokens come and go). Checks that each exploring step verifies every request's best node, and that
    exploring is predicted to cost at most its share of the verify time."""
    from vllm_easyspec.control.controller import EXPLORE_SHARE

    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 0.008]),
                         CostCurve.from_measurements([1, 4096], list(draft_level_seconds)))
    controller = SpeculationController(cost, max_depth=2, max_nodes=3, level_width=1)
    batch = [f"r{i}" for i in range(16)]
    kept, verify_seconds, exploring_seconds = 0, 0.0, 0.0
    for _ in range(steps):
        budget, explored = controller.explore_budget, controller.stats.exploring_drafts
        depth = controller.plan_depth(batch, first_pass_rows=kept + 16)
        controller.observe_drafting(1e-4)
        rows = 16
        if depth:
            kept = 0
            trees = [RequestTree(req_id, [5, 6, 7], [-1, -1, 0], [_features(1, -2.0), _features(1, -3.0), _features(2, -2.0)],
                                 keeps_order=False)
                     for req_id in batch]
            choices = controller.choose(trees)
            if controller.stats.exploring_drafts > explored:
                exploring_seconds += budget - controller.explore_budget
                assert [choice.count for choice in choices] == [1] * 16  # every request's best level_width nodes
            rows += sum(choice.count for choice in choices)
            for req_id, choice in zip(batch, choices, strict=True):
                controller.observe(req_id, choice.features[: choice.count], choice.parents[: choice.count], set())
        else:
            kept = min(kept + 16, 16 * 32)
        seconds = cost.verify_seconds(rows)
        verify_seconds += seconds
        controller.observe_verify(rows, seconds, requests=16)
    assert exploring_seconds <= EXPLORE_SHARE * verify_seconds
    return controller


def test_exploring_costs_at_most_its_share_and_a_dear_catch_up_makes_it_rare():
    cheap = _explore((0.001, 0.01))  # a catch-up of 512 rows costs 2 ms
    dear = _explore((0.02, 2.0))  # ... 250 ms (a 30-layer draft model on a CPU, deferred prompts included)
    assert cheap.stats.exploring_drafts > 2 * dear.stats.exploring_drafts > 0
    # an exploring step dearer than the budget can hold (4 steps of 170 ms) is never taken
    assert _explore((0.02, 8.0)).stats.exploring_drafts == 0
    assert cheap.stats.exploring_drafts + cheap.stats.steps_without_drafting == 800  # the models never draft


def test_a_buckets_realised_over_predicted_rests_on_its_recent_steps_whatever_the_batch():
    # one request verifies one node per step, accepted on every third step; at batch 16 fifteen neighbours
    # verify nothing. Their empty verifications must not wear the memory down 16 times faster.
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 1e-5]),
                         CostCurve.from_measurements([1, 64], [0.001, 0.002]))
    ratios = []
    for batch in (1, 16):
        controller = SpeculationController(cost, max_depth=1, max_nodes=1, level_width=1)
        idle = [f"idle{i}" for i in range(batch - 1)]
        for step in range(60):
            trees = [RequestTree("r0", [5], [-1], [_features(1, -0.1)], keeps_order=False)]
            trees += [RequestTree(req_id, [], [], [], keeps_order=False) for req_id in idle]
            for tree, choice in zip(trees, controller.choose(trees), strict=True):
                accepted = {0} if choice.count and step % 3 == 0 else set()
                controller.observe(tree.req_id, choice.features[: choice.count], choice.parents[: choice.count],
                                   accepted)
        ratios.append(controller.ratio_at(batch))
    assert ratios[0] < 0.9 and ratios[1] == pytest.approx(ratios[0])


def test_realised_over_predicted_is_kept_per_batch_size():
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 0.0005]),
                         CostCurve.from_measurements([1, 64], [0.001, 0.002]))
    controller = SpeculationController(cost, max_depth=1, max_nodes=1, level_width=1)
    batch = [f"r{i}" for i in range(16)]
    for _ in range(50):  # at batch 16 the chosen nodes are accepted far less often than predicted
        trees = [RequestTree(req_id, [5], [-1], [_features(1, -0.1)], keeps_order=False) for req_id in batch]
        for req_id, choice in zip(batch, controller.choose(trees), strict=True):
            controller.observe(req_id, choice.features[: choice.count], choice.parents[: choice.count], set())
    assert controller.ratio_at(16) < 0.5 and controller.ratio_at(31) == controller.ratio_at(16)
    assert controller.ratio_at(1) == 1.0  # a lone request's chances are not scaled by what batch 16 saw
    (alone,) = controller.choose([RequestTree("solo", [5], [-1], [_features(1, -0.1)], keeps_order=False)])
    assert alone.chances[0] == pytest.approx(controller.acceptance.path_chances("solo", alone.features, [-1])[0])


def test_a_tree_the_scheduler_cut_short_is_predicted_over_the_nodes_it_verified():
    # every chosen node is accepted; the scheduler verifies the first of a chain of three only. Had the two it
    # never verified counted as predicted, the realised / predicted ratio would fall below 1 and drag the chances
    # of later steps down.
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.0501]),
                         CostCurve.from_measurements([1, 64], [0.0001, 0.0002]))
    controller = SpeculationController(cost, max_depth=3, max_nodes=3, level_width=1)
    predicted_scheduled = 0.0
    for _ in range(30):
        tree = RequestTree("r0", [5, 6, 7], [-1, 0, 1], [_features(d, -0.05) for d in (1, 2, 3)], keeps_order=True)
        (choice,) = controller.choose([tree])
        assert choice.count == 3
        predicted_scheduled += choice.chances[0]
        controller.observe("r0", choice.features[:1], choice.parents[:1], {0})
    assert controller.stats.predicted_accepted == pytest.approx(predicted_scheduled)
    assert controller.stats.realised_accepted == 30 and controller.ratio_at(1) > 1.0


def test_prompt_lookup_nodes_count_at_every_depth_without_paying_for_levels():
    verify = _linear(0.001, 0.05)
    draft = lambda depth: 0.02 + (depth - 1) * 0.002  # noqa: E731  # a 20 ms first pass, 2 ms a level
    # a lone request whose drafted nodes are weak and whose lookup path is accepted deep: one drafted level offers
    # the path's nodes too, which repay the first pass; without the path one level's node alone does not
    weak = [[0.35, 0.02, 0.01, 0.01]]
    assert choose_depth(_chains(weak), verify, draft).nodes == 0
    with_lookup = choose_depth(_chains(weak, lookup=[[0.6, 0.55, 0.5, 0.45]]), verify, draft)
    assert with_lookup.depth == 1 and with_lookup.nodes == 5
    # where the drafted nodes are good deep, the lookup path does not make the drafted levels look worthless
    assert choose_depth(_chains([[0.9, 0.8, 0.7, 0.6]], lookup=[[0.3, 0.3, 0.28, 0.25]]), verify, draft).depth == 4


def test_an_offered_tree_cut_to_a_depth_keeps_its_lookup_nodes_and_orders_them_as_the_choice_does():
    # drafted: 0 (depth 1) -> 1 (depth 2), 2 (depth 1); lookup: 3 -> 4 (depths 1-2); chances as predicted
    tree = OfferedTree(2, (0.5, 0.4, 0.2, 0.6, 0.45), (-1, 0, -1, -1, 3), (False, False, False, True, True))
    shallow, deep = tree.by_depth(cap=8)
    assert shallow.chances == [0.6, 0.5, 0.45, 0.2]  # node 1 (depth 2) is not drafted at one level
    assert shallow.path_length == 1  # best first: 3, then 0 (another root child) branches
    assert deep.chances == [0.6, 0.5, 0.45, 0.4, 0.2] and tree.by_depth(cap=3)[1].chances == [0.6, 0.5, 0.45]
    assert AveragedOffer.of(deep).candidates(ratio=0.5, cap=3).chances == [0.3, 0.25, 0.225]  # scaled, capped
    assert AveragedOffer.of(deep).candidates(ratio=4.0, cap=2).chances == [1.0, 1.0]  # never above 1
    iid = OfferedTree(1, (0.3, 0.5), (-1, -1), (False, False), keeps_order=True)
    assert iid.by_depth(8)[0].chances == [0.3, 0.3]  # i.i.d. children keep their order


def test_an_average_offer_moves_by_its_weight_and_stays_best_first():
    average = AveragedOffer.of(Candidates([0.9, 0.5], 4))
    average.add(Candidates([0.4, 0.3, 0.2], 4, path_length=1), 0.5)
    assert average.chances == pytest.approx([0.65, 0.4, 0.1]) and average.path_length == 1
    average.add(Candidates([], 4), 0.9999)  # nodes that became negligible are dropped
    assert average.chances == []


def test_a_depth_costs_the_rows_its_acceptance_needs():
    # a lone request, verify rows dear (10 ms each), a 10 ms first pass. One node accepted 88% of the time pays;
    # four root children accepted 22% each also reach depth 1 about 88% of the time, but need four rows to.
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 0.01]),
                         CostCurve.from_measurements([1, 64], [0.01, 0.01]))
    controller = SpeculationController(cost, max_depth=1, max_nodes=4, level_width=4)
    for req_id, logprobs in (("sure", [math.log(0.88)]), ("wide", [math.log(0.22)] * 4)):
        for step in range(20):
            controller.plan_depth([req_id], first_pass_rows=2)
            tree = RequestTree(req_id, list(range(len(logprobs))), [-1] * len(logprobs),
                               [_features(1, logprob) for logprob in logprobs], keeps_order=False)
            (choice,) = controller.choose([tree])
            accepted = {step % len(logprobs)} if step % 8 else set()  # depth 1 reached 7 steps in 8
            controller.observe(req_id, tree.features, tree.parents, accepted)
    assert controller.plan_depth(["sure"], first_pass_rows=2) == 1
    assert controller.plan_depth(["wide"], first_pass_rows=2) == 0


def _offer_steps(controller: SpeculationController, req_id: str, logprobs: list[float], steps: int,
                 accepted: set[int]) -> None:
    """``steps`` drafting steps of ``req_id`` offering a chain with these draft log-probabilities, each verified
    with the ``accepted`` nodes accepted."""
    for _ in range(steps):
        tree = RequestTree(req_id, list(range(len(logprobs))), list(range(-1, len(logprobs) - 1)),
                           [_features(depth, logprob) for depth, logprob in enumerate(logprobs, start=1)],
                           keeps_order=False)
        (choice,) = controller.choose([tree])
        controller.observe(req_id, tree.features, tree.parents, accepted)


def test_one_unsure_tree_does_not_stop_the_drafting_that_a_requests_usual_trees_pay_for():
    # a lone request, verify rows dear (10 ms each), a 10 ms first pass: a sure chain pays, an unsure one does not
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 0.01]),
                         CostCurve.from_measurements([1, 64], [0.01, 0.01]))
    controller = SpeculationController(cost, max_depth=2, max_nodes=2, level_width=1)
    _offer_steps(controller, "a", [math.log(0.9), math.log(0.9)], steps=12, accepted={0, 1})
    _offer_steps(controller, "a", [math.log(0.02), math.log(0.02)], steps=1, accepted=set())  # one unsure moment
    assert controller.plan_depth(["a"], first_pass_rows=2) > 0
    # a newcomer starts from what every request offered, not from the last tree anyone offered
    assert controller.plan_depth(["newcomer"], first_pass_rows=2) > 0
    # a request whose trees stay unsure stops paying for them
    _offer_steps(controller, "a", [math.log(0.02), math.log(0.02)], steps=12, accepted=set())
    assert controller.plan_depth(["a"], first_pass_rows=2) == 0


def test_the_plan_charges_the_drafting_stages_host_work_it_measured():
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 0.001]),
                         CostCurve.from_measurements([1, 64], [0.01, 0.01]))
    controller = SpeculationController(cost, max_depth=1, max_nodes=1, level_width=1)
    _offer(controller, "a", _chain_tree([0.3]))  # 1.3 tokens in 61 ms: drafting pays (20 tok/s plain)
    assert controller.plan_depth(["a"], first_pass_rows=2) == 1
    drafted = 0
    while controller.plan_depth(["a"], first_pass_rows=2) and drafted < 50:
        controller.observe_first_pass(2, 0.01, 1)
        controller.observe_drafting(0.03)  # the drafting stage took 20 ms beyond its 10 ms first pass
        controller.observe_verify(2, 0.051)
        drafted += 1
    # it stops drafting once the host work it has learnt exceeds the 4 ms that 1.3 tokens a step can repay
    assert 1 < drafted < 50 and cost.observations["overhead"] == drafted
    assert 0.004 < cost.overhead_seconds(1) < 0.02 and cost.overhead_seconds(3) == 3 * cost.overhead_seconds(1)


def test_a_catch_up_first_pass_is_spread_over_the_steps_the_requests_can_still_run():
    # a lone request: verify 50 ms (+1 ms a row); its first pass 20 ms a row-pair, 0.7 ms a row beyond
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 0.001]),
                         CostCurve.from_measurements([1, 2, 512], [0.02, 0.02, 0.02 + 510 * 0.0007]))
    controller = SpeculationController(cost, max_depth=1, max_nodes=4, level_width=4)
    _offer(controller, "a", _chain_tree([0.8], lookup=[0.6, 0.5, 0.4, 0.3]))
    path = [4]  # a step with a lookup path, as the offer's
    assert controller.plan_depth(["a"], first_pass_rows=2, lookup_lengths=path) == 1  # drafting every step pays
    # its 500-row prompt still to catch up: 350 ms at once never pays in one step, spread over 40 steps it does
    assert controller.plan_depth(["a"], first_pass_rows=500, lookup_lengths=path) == 0
    assert controller.plan_depth(["a"], first_pass_rows=500, horizon_steps=40, lookup_lengths=path) == 1


def test_the_guard_charges_a_catch_up_first_pass_at_the_share_the_plan_charges_it():
    # first pass: 20 ms up to 2 rows, 0.7 ms a row beyond; verify rows cheap, acceptance high: the plan drafts
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 0.0001]),
                         CostCurve.from_measurements([1, 2, 512], [0.02, 0.02, 0.02 + 510 * 0.0007]))
    controller = SpeculationController(cost, max_depth=2, max_nodes=4, level_width=2)
    batch = ["a", "b"]
    for req_id in batch:
        _offer(controller, req_id, _chain_tree([0.95, 0.9]))
    # a 400-row catch-up that took 1 s, spread over 50 steps: the cycle pays the steady rows' share of it
    # (4 of 400 rows, 21.4 of 298.6 ms predicted) and 1/50 of the rest, as the plan charged it
    assert controller.plan_depth(batch, first_pass_rows=400, horizon_steps=50) == 2
    controller.observe_first_pass(400, 1.0)
    controller.observe_drafting(1.01)
    for req_id in batch:
        controller.observe(req_id, [_features(1), _features(2)], [-1, 0], {0, 1})
    controller.observe_verify(6, 0.05, requests=2)
    steady, whole = 0.02 + 2 * 0.0007, 0.02 + 398 * 0.0007
    share = (steady + (whole - steady) / 50) / whole
    assert share < 0.1
    assert controller.guard.drafted[OutcomeGuard.bucket(2)].seconds == pytest.approx(0.01 + share + 0.05)


def test_where_the_plan_drafts_shallow_some_steps_draft_the_whole_depth_within_the_budget():
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 0.001]),
                         CostCurve.from_measurements([1, 64], [0.002, 0.004]))
    controller = SpeculationController(cost, max_depth=3, max_nodes=4, level_width=4)
    _offer(controller, "a", _chain_tree([0.9, 0.05, 0.01]))  # depth 1 pays, deeper looks worthless
    depths = []
    for _ in range(640):
        depths.append(controller.plan_depth(["a"], first_pass_rows=2))
        controller.observe_verify(3, 0.053)  # no requests: the outcome guard is not fed
    assert set(depths) == {1, 3}
    assert 10 <= depths.count(3) <= 640 // 16 * 2 and controller.stats.exploring_drafts == depths.count(3)


def test_a_step_that_drafts_deeper_to_explore_verifies_each_requests_top_path_to_its_end():
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 0.001]),
                         CostCurve.from_measurements([1, 64], [0.002, 0.004]))
    controller = SpeculationController(cost, max_depth=3, max_nodes=4, level_width=2)
    _offer(controller, "a", _chain_tree([0.9, 0.05, 0.01]))  # depth 1 pays, deeper looks worthless
    # the root's likeliest child, a sibling, and a path below the likeliest child whose draft is unsure
    tree = RequestTree("a", tokens=[10, 11, 12, 13, 14], parents=[-1, -1, 0, 0, 2],
                       features=[_features(1, -0.05), _features(1, -2.5), _features(2, -3.0), _features(2, -4.0),
                                 _features(3, -3.5)], keeps_order=False)
    seen = set()
    for _ in range(640):
        depth = controller.plan_depth(["a"], first_pass_rows=2)
        (choice,) = controller.choose([tree])
        chosen = choice.tokens[: choice.count]
        if depth == 3:  # exploring: the top path 10 -> 12 -> 14 is verified, parents first
            assert chosen[:3] == [10, 12, 14] and choice.parents[:3] == [-1, 0, 1]
        else:
            assert 14 not in chosen  # not exploring: the unsure path stays unverified
        seen.add(depth)
        controller.observe_verify(2, 0.051)
    assert seen == {1, 3} and controller.stats.exploring_drafts > 0


def test_the_top_path_goes_first_and_the_order_stays_parents_first():
    chances = [0.9, 0.5, 0.4, 0.3, 0.2, 0.1]
    parents = [-1, -1, 0, 1, 2, 0]  # best first; the top path is 0 -> 2 -> 4
    order, count = with_top_path_first(chances, parents, count=2, cap=8)
    assert order == [0, 2, 4, 1, 3, 5] and count == 4
    assert all(parents[n] < 0 or order.index(parents[n]) < order.index(n) for n in order)
    assert with_top_path_first(chances, parents, count=2, cap=3)[1] == 3


def test_a_step_with_a_lookup_path_and_one_without_are_each_planned_from_steps_like_them():
    # an edit: where the prompt repeats, the lookup path carries the step and one level pays best; where it does
    # not, the drafted chain must carry it, three levels deep
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05 + 63 * 0.0002]),
                         CostCurve.from_measurements([1, 64], [0.004, 0.004]))
    controller = SpeculationController(cost, max_depth=3, max_nodes=6, level_width=1)
    for _ in range(20):
        controller.remember_offer("edit", _chain_tree([0.5, 0.02, 0.01], lookup=[0.95, 0.9, 0.85]), with_lookup=True)
        controller.remember_offer("edit", _chain_tree([0.9, 0.85, 0.8]), with_lookup=False)
    assert controller.plan_depth(["edit"], first_pass_rows=2, lookup_lengths=[3]) == 1
    assert controller.plan_depth(["edit"], first_pass_rows=2, lookup_lengths=[0]) == 3


def test_a_deeper_depth_is_never_planned_as_offering_less_than_a_shallower_one():
    # verify flat at 50 ms, first pass 10 ms, a level 2 ms: a second node of chance 0.1 repays its level
    cost = StepCostModel(CostCurve.from_measurements([1, 64], [0.05, 0.05]),
                         CostCurve.from_measurements([1, 64], [0.002, 0.002]),
                         CostCurve.from_measurements([1, 64], [0.01, 0.01]))
    controller = SpeculationController(cost, max_depth=2, max_nodes=2, level_width=1)
    _offer(controller, "a", _chain_tree([0.9, 0.1]))
    # drafting one level has lately offered 0.9; the two-level average is older, from when the request did worse
    controller.offered["a"][2, False] = AveragedOffer([0.2, 0.1], None)
    assert controller.plan_depth(["a"], first_pass_rows=2) == 2
    assert at_least(Candidates([0.2, 0.1], 2, None), Candidates([0.9], 2, None)).chances == [0.9, 0.1]
    assert at_least(Candidates([0.3], 3, 1), Candidates([0.2, 0.1], 3, None)) == Candidates([0.3, 0.1], 3, 1)
