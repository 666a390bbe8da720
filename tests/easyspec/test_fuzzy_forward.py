"""The pure fuzzy forward (Algorithm 2) and the calibration schedule."""

from __future__ import annotations

import pytest
import torch

from vllm_easyspec.easyspec.calibration import CalibrationSchedule, first_forward_is_exact
from vllm_easyspec.easyspec.config import EasySpecConfig
from vllm_easyspec.easyspec.fuzzy_forward import decoder_forward, plan_for
from vllm_easyspec.easyspec.layer_grouping import resolve_layer_groups

HIDDEN = 16


class ToyOps:
    """A toy pre-norm decoder on a plain residual-stream tensor; records the order of MLP calls."""

    def __init__(self, num_layers: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.attn = [torch.randn(HIDDEN, HIDDEN, generator=g, dtype=torch.float64) / 4 for _ in range(num_layers)]
        self.mlp = [torch.randn(HIDDEN, HIDDEN, generator=g, dtype=torch.float64) / 4 for _ in range(num_layers)]
        self.mlp_order: list[int] = []

    def attention(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.nn.functional.normalize(h, dim=-1) @ self.attn[layer])

    def mlp_out(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        self.mlp_order.append(layer)
        return torch.relu(torch.nn.functional.normalize(h, dim=-1) @ self.mlp[layer])

    def exact_layer(self, layer, h):
        h = h + self.attention(layer, h)
        return h + self.mlp_out(layer, h)

    def group_input(self, h):
        return h

    def group_attention(self, group, h):
        return [self.attention(layer, h) for layer in group]

    def add_attention_and_mlp(self, layer, h, attention_output):
        h = h + attention_output
        return h + self.mlp_out(layer, h)


def _sequential(ops: ToyOps, h: torch.Tensor, num_layers: int) -> torch.Tensor:
    for layer in range(num_layers):
        h = h + ops.attention(layer, h)
        h = h + ops.mlp_out(layer, h)
    return h


def _algorithm2(ops: ToyOps, h: torch.Tensor, plan) -> torch.Tensor:
    """Algorithm 2 of the paper written out literally for every group."""
    for group in plan:
        h1 = h
        outs = [ops.attention(layer, h1) for layer in group]
        for layer, out in zip(group, outs):
            h_prime = h + out
            h = h_prime + ops.mlp_out(layer, h_prime)
    return h


def test_exact_plan_is_the_sequential_model():
    grouping = resolve_layer_groups(EasySpecConfig(layer_parallel_size=3), num_layers=9)
    ops = ToyOps(9)
    h = torch.randn(5, HIDDEN, dtype=torch.float64)
    out = decoder_forward(h, plan_for(grouping, fuzzy=False), ops)
    torch.testing.assert_close(out, _sequential(ops, h, 9), rtol=0, atol=0)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_fuzzy_plan_is_algorithm_2_and_differs_from_exact(n):
    grouping = resolve_layer_groups(EasySpecConfig(layer_parallel_size=n), num_layers=10)
    plan = plan_for(grouping, fuzzy=True)
    assert plan[0] == (0,) and plan[-1] == (9,)
    assert [layer for group in plan for layer in group] == list(range(10))
    ops = ToyOps(10)
    h = torch.randn(5, HIDDEN, dtype=torch.float64)
    ops.mlp_order.clear()
    out = decoder_forward(h, plan, ops)
    assert ops.mlp_order == list(range(10))  # residual adds and MLPs in layer order
    torch.testing.assert_close(out, _algorithm2(ToyOps(10), h, plan), rtol=0, atol=0)
    exact = _sequential(ToyOps(10), h, 10)
    assert (out - exact).abs().max() > 1e-3  # the fuzzy approximation is not the exact model
    cosine = torch.nn.functional.cosine_similarity(out, exact, dim=-1)
    assert cosine.min() > 0.5  # ...but it approximates it


def test_calibration_truth_table():
    for policy in ("every_round", "on_mismatch", "never"):
        assert first_forward_is_exact(policy, has_prompt_tokens=True, all_drafts_accepted=True)
    assert first_forward_is_exact("every_round", has_prompt_tokens=False, all_drafts_accepted=True)
    assert first_forward_is_exact("on_mismatch", has_prompt_tokens=False, all_drafts_accepted=False)
    assert not first_forward_is_exact("on_mismatch", has_prompt_tokens=False, all_drafts_accepted=True)
    assert not first_forward_is_exact("never", has_prompt_tokens=False, all_drafts_accepted=False)
    with pytest.raises(ValueError, match="unknown calibration policy"):
        first_forward_is_exact("sometimes", has_prompt_tokens=False, all_drafts_accepted=False)  # type: ignore[arg-type]


def test_schedule_only_the_first_forward_of_a_step_can_be_exact():
    schedule = CalibrationSchedule("every_round")
    assert not schedule.next_forward_exact()  # warm-up forwards outside a step are fuzzy
    schedule.start_step(has_prompt_tokens=False, all_drafts_accepted=True)
    assert [schedule.next_forward_exact() for _ in range(4)] == [True, False, False, False]
    never = CalibrationSchedule("never")
    never.start_step(has_prompt_tokens=False, all_drafts_accepted=False)
    assert [never.next_forward_exact() for _ in range(3)] == [False, False, False]
    assert (never.exact_first_forwards, never.fuzzy_first_forwards) == (0, 1)
