"""Table-4 analysis: how well fuzzy speculation approximates the exact draft, on a transformers model.

For every fuzzy group ``(j, ..., j+N-1)`` of :func:`vllm_easyspec.easyspec.layer_grouping.resolve_layer_groups`
(the same grouping the vLLM drafter uses), and every member ``i > j`` of it, the exact forward is compared
with the fuzzy one, which feeds layer ``i``'s attention the group input ``h_j`` instead of ``h_i``:

- ``h``: the attention input (the residual stream entering layer ``i``): ``h_j`` vs ``h_i``;
- ``q``, ``k``, ``v``: the projections of ``norm_i(h_j)`` vs ``norm_i(h_i)`` (before RoPE, which is a
  rotation per position and leaves cosines unchanged; before Gemma's q/k norms);
- ``attn_out``: layer ``i``'s attention output (after ``o_proj``) with every position's query, key and
  value fuzzy, vs exact. (In calibrated decoding only the newest token's K/V are fuzzy, so this is a
  conservative figure.)

Each value is the mean over tokens, layers and prompts of the per-token cosine similarity. The first
member ``j`` of a group reads its exact input and is not counted (its cosines are 1 by construction).
Invariant: the model is only read (hooks are removed, weights untouched), float32 throughout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vllm_easyspec.easyspec.config import EasySpecConfig
from vllm_easyspec.easyspec.layer_grouping import LayerGrouping, resolve_layer_groups

QUANTITIES = ("h", "attn_out", "q", "k", "v")


@dataclass
class CosineAccumulator:
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(QUANTITIES, 0.0))
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(QUANTITIES, 0))
    compared_layers: int = 0

    def add(self, name: str, exact: torch.Tensor, fuzzy: torch.Tensor) -> None:
        cos = F.cosine_similarity(exact.double().flatten(0, -2), fuzzy.double().flatten(0, -2), dim=-1)
        self.sums[name] += float(cos.sum())
        self.counts[name] += int(cos.numel())

    def means(self) -> dict[str, float]:
        return {name: self.sums[name] / self.counts[name] for name in QUANTITIES if self.counts[name]}


def grouping_for(model: torch.nn.Module, layer_parallel_size: int) -> LayerGrouping:
    num_layers = len(model.model.layers)
    return resolve_layer_groups(EasySpecConfig(layer_parallel_size=layer_parallel_size), num_layers)


@torch.no_grad()
def accumulate_cosines(
    model: torch.nn.Module, input_ids: torch.Tensor, grouping: LayerGrouping, acc: CosineAccumulator
) -> None:
    """Add one sequence's (``input_ids`` of shape [1, T]) exact-vs-fuzzy cosines to ``acc``."""
    layers = model.model.layers
    layer_inputs: dict[int, torch.Tensor] = {}
    attn_kwargs: dict[int, dict] = {}
    attn_outputs: dict[int, torch.Tensor] = {}
    projections: dict[tuple[int, str], torch.Tensor] = {}
    handles = []
    wanted = {i for group in grouping.fuzzy_groups for i in group}

    def layer_pre_hook(index):
        def hook(module, args, kwargs):
            layer_inputs[index] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        return hook

    def attn_pre_hook(index):
        def hook(module, args, kwargs):
            attn_kwargs[index] = {k: v for k, v in kwargs.items() if k != "hidden_states"}

        return hook

    def attn_hook(index):
        def hook(module, args, kwargs, output):
            attn_outputs[index] = (output[0] if isinstance(output, tuple) else output).detach().clone()

        return hook

    def proj_hook(index, name):
        def hook(module, args, output):
            projections[(index, name)] = output.detach().clone()

        return hook

    try:
        for index in wanted:
            layer = layers[index]
            handles.append(layer.register_forward_pre_hook(layer_pre_hook(index), with_kwargs=True))
            handles.append(layer.self_attn.register_forward_pre_hook(attn_pre_hook(index), with_kwargs=True))
            handles.append(layer.self_attn.register_forward_hook(attn_hook(index), with_kwargs=True))
            for name in ("q", "k", "v"):
                proj = getattr(layer.self_attn, f"{name}_proj")
                handles.append(proj.register_forward_hook(proj_hook(index, name)))
        model(input_ids=input_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()

    for group in grouping.fuzzy_groups:
        group_input = layer_inputs[group[0]]
        for index in group[1:]:
            layer = layers[index]
            normed = layer.input_layernorm(group_input)
            acc.add("h", layer_inputs[index], group_input)
            for name in ("q", "k", "v"):
                fuzzy = getattr(layer.self_attn, f"{name}_proj")(normed)
                acc.add(name, projections[(index, name)], fuzzy)
            fuzzy_out = layer.self_attn(hidden_states=normed, **attn_kwargs[index])
            fuzzy_out = fuzzy_out[0] if isinstance(fuzzy_out, tuple) else fuzzy_out
            acc.add("attn_out", attn_outputs[index], fuzzy_out)
            acc.compared_layers += 1


def table4_for_model(
    model: torch.nn.Module, sequences: Sequence[torch.Tensor], sizes: Sequence[int] = (2, 3, 4)
) -> dict[int, dict[str, float]]:
    """``{N: {quantity: mean cosine}}`` over ``sequences`` (each [1, T] token ids)."""
    result: dict[int, dict[str, float]] = {}
    for n in sizes:
        grouping = grouping_for(model, n)
        acc = CosineAccumulator()
        for ids in sequences:
            accumulate_cosines(model, ids, grouping, acc)
        result[n] = acc.means() | {"compared_layer_instances": acc.compared_layers}
    return result
