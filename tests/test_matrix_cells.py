"""Matrix cells: ragged output lengths are one fixed draw per cell, and each request is served with its own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.harness.engine import _generate, side_by_side_memory_refusal
from benchmarks.harness.setups import Cell
from benchmarks.matrix.setups import cells, ragged_lengths


def test_ragged_lengths_are_the_same_draw_for_every_setup_and_span_half_to_one_and_a_half_the_mean():
    lengths = ragged_lengths("chat-b8", 64, 32)
    assert lengths == ragged_lengths("chat-b8", 64, 32)  # each setup's process draws the same
    assert lengths != ragged_lengths("chat-b16", 64, 32)
    assert min(lengths) >= 16 and max(lengths) <= 48 and len(set(lengths)) > 10


def test_ragged_cells_carry_one_length_per_prompt_and_plain_cells_none():
    ragged = cells(["chat"], [1, 8], 32, ragged=True)
    assert [len(cell.lengths) for cell in ragged] == [len(cell.prompts) for cell in ragged] == [4, 16]
    assert all(cell.lengths is None for cell in cells(["chat"], [1, 8], 32))
    with pytest.raises(ValueError, match="3 lengths for 4 prompts"):
        Cell("chat-b1", ["p"] * 4, 1, 32, [8, 8, 8])


class _FakeEngine:
    """Finishes, every step, the oldest running request; records what each request was added with."""

    def __init__(self) -> None:
        self.running: list[str] = []
        self.added: dict[str, tuple[object, object]] = {}
        self.most_in_flight = 0

    def add_request(self, request_id, prompt, params):
        self.added[request_id] = (prompt, params)
        self.running.append(request_id)
        self.most_in_flight = max(self.most_in_flight, len(self.running))
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self):
        request_id = self.running.pop(0)
        prompt, params = self.added[request_id]
        return [SimpleNamespace(request_id=request_id, finished=True, prompt=prompt, params=params)]


def test_each_request_is_served_with_its_own_sampling_params_and_at_most_the_batch_in_flight():
    engine = _FakeEngine()
    prompts = [f"prompt {i}" for i in range(6)]
    params = [f"params {i}" for i in range(6)]
    outputs = _generate(SimpleNamespace(llm_engine=engine), prompts, params, in_flight=2)
    assert [(o.prompt, o.params) for o in outputs] == list(zip(prompts, params, strict=True))
    assert engine.most_in_flight == 2


def test_a_cells_sampling_params_give_each_prompt_its_length():
    ragged = Cell("chat-b1", ["a", "b"], 1, 32, [10, 20]).sampling_params(temperature=0.0, seed=0)
    assert [params.max_tokens for params in ragged] == [10, 20]
    assert [params.max_tokens for params in Cell("chat-b1", ["a", "b"], 1, 32).sampling_params()] == [32, 32]


def test_min_prompts_lengthens_the_small_batch_cells_and_leaves_the_large_ones():
    default = cells(["chat"], [1, 2, 8], 32)
    longer = cells(["chat"], [1, 2, 8], 32, min_prompts=12)
    assert [len(cell.prompts) for cell in default] == [4, 4, 16]
    assert [len(cell.prompts) for cell in longer] == [12, 12, 16]
    assert longer[0].prompts[:4] == default[0].prompts  # the same prompts first, then the class's next ones


def test_a_side_by_side_round_stops_before_an_engine_that_would_not_fit_and_names_the_fix():
    gib = 2**30
    assert side_by_side_memory_refusal("vanilla", 20 * gib, [], "float32") is None  # the first engine always starts
    assert side_by_side_memory_refusal("eagle-auto", 9 * gib, [6 * gib, 5 * gib], "float32") is None
    refusal = side_by_side_memory_refusal("eagle-auto-4", 7 * gib, [6 * gib, 5 * gib, 6 * gib], "float32")
    assert refusal is not None and "engine 4 (eagle-auto-4)" in refusal
    assert "--only" in refusal and "without --side-by-side" in refusal
