"""The step-trace checker: a consistent greedy tree step passes, and each way a device or build can break a step
(positions, input ids, output row, branch) is reported."""

import copy
import json

import pytest

from vllm_easyspec.instruments.step_trace import greedy_outcome, main, trace_violations

# A step the CPU engine traced (static tree [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]] shape): the root and
# nodes 0, 2 and 5 repeat token 620, so parent and child carry the same id, as in the GPU's 7/8 divergence.
STEP = {
    "req_id": "0-99bc7fe8",
    "prefix_len": 10,
    "tokens": [620, 38, 620, 38, 620, 620],
    "parents": [-1, -1, 0, 0, 1, 2],
    "input_ids": [620, 620, 38, 620, 38, 620, 620],
    "positions": [10, 11, 11, 12, 12, 12, 13],
    "argmax": [620, 620, 620, 620, 620, 620, 7],
    "output": [620, 620, 620, 7, -1, -1, -1],
    "accepted": [[1, 11, 620], [3, 12, 620], [6, 13, 620]],
}


def test_greedy_outcome_takes_the_deepest_matching_path():
    path, output = greedy_outcome(STEP["tokens"], STEP["parents"], STEP["argmax"])
    assert path == [0, 2, 5]
    assert output == [620, 620, 620, 7]
    # nothing matches: no node, the bonus is the root's argmax
    assert greedy_outcome([5, 6], [-1, -1], [9, 0, 0]) == ([], [9])
    # two equally deep matching nodes: the first
    assert greedy_outcome([5, 5], [-1, -1], [5, 1, 2]) == ([0], [5, 1])


def test_a_consistent_step_has_no_violations():
    assert trace_violations(STEP) == []


@pytest.mark.parametrize("field, value, expected", [
    ("positions", [10, 11, 12, 13, 14, 15, 16], "positions"),  # linear positions: RoPE not rewritten
    ("input_ids", [620, 620, 620, 38, 38, 620, 620], "input ids"),
    ("output", [620, 620, 7, 620, -1, -1, -1], "output"),  # the same tokens in another order
    ("accepted", [[1, 11, 620], [3, 12, 620], [6, 14, 620]], "branch"),  # moved to the wrong position
])
def test_each_broken_invariant_is_reported(field, value, expected):
    broken = copy.deepcopy(STEP)
    broken[field] = value
    problems = trace_violations(broken)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_the_command_fails_on_a_bad_trace(tmp_path, capsys):
    good, bad = copy.deepcopy(STEP), copy.deepcopy(STEP)
    bad["output"] = [620, 620, 7, 620, -1, -1, -1]
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"requests": [good]}) + "\n")
    assert main([str(path)]) == 0
    path.write_text(json.dumps({"requests": [good]}) + "\n" + json.dumps({"requests": [bad]}) + "\n")
    assert main([str(path)]) == 1
    assert "trace.jsonl:2 0-99bc7fe8 (P=10): output" in capsys.readouterr().out


def test_requests_sampled_at_t_above_0_are_recorded_as_such_and_not_checked(tmp_path, capsys):
    """A T > 0 request meets no greedy verdict: the writer marks it, the checker counts it apart (the H100's
    T = 0.8 run traced 77 steps that a greedy check reported as 554 violations)."""
    import types

    import torch

    from vllm_easyspec.instruments.step_trace import trace_tree_step
    from vllm_easyspec.tree.verify_step import TreeRequest, TreeVerifyStep

    path = tmp_path / "trace.jsonl"
    requests = [TreeRequest(batch_row=row, query_start=3 * row, prefix_len=10, tokens=[5, 6], parents=[-1, -1])
                for row in range(2)]
    metadata = types.SimpleNamespace(num_draft_tokens=[2, 2], cu_num_sampled_tokens=torch.tensor([3, 6]))
    branch = types.SimpleNamespace(**{name: torch.zeros(0, dtype=torch.long) for name in
                                      ("request_index", "source_column", "destination", "tokens")})
    verdict = types.SimpleNamespace(branch=branch, sampler_output=types.SimpleNamespace(
        sampled_token_ids=torch.tensor([[7, -1, -1], [8, -1, -1]])))
    logits = torch.zeros(6, 9)
    logits[[0, 3], [7, 4]] = 1.0  # request 0's root argmax is its output 7; request 1 sampled 8, argmax 4
    sampling = types.SimpleNamespace(all_greedy=False, temperature=torch.tensor([0.0, 0.8]))
    trace_tree_step(str(path), TreeVerifyStep(requests), metadata, logits, torch.tensor([0, 5, 6] * 2),
                    torch.tensor([10, 11, 11] * 2), verdict, sampling)
    traced = json.loads(path.read_text())["requests"]
    assert [request["greedy"] for request in traced] == [True, False]
    assert trace_violations(traced[1]) != []  # it would fail a greedy check
    assert main([str(path)]) == 0
    assert "0 violation(s) in 1 greedy tree request(s); 1 sampled at T > 0 not checked" in capsys.readouterr().out
