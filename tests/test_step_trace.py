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
