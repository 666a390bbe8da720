"""The pure algorithm of EasySpec's fuzzy speculation (the paper's Algorithm 2), independent of vLLM.

A decoder is a sequence of layers ``h_{i+1} = h'_i + MLP_i(h'_i)`` with ``h'_i = h_i + Attn_i(h_i)``
(norms live inside ``Attn_i`` and ``MLP_i``). A *plan* lists every layer once, in order, as groups:

- a group of one layer runs exactly as above;
- a group ``(j, ..., j+N-1)`` of N layers is fuzzy: every attention layer of the group reads the group's
  input ``h_j`` (so the N attentions have no data dependency and may run together, fused or one per
  device), then the residual adds and MLPs run in layer order: ``h'_i = h_i + Attn_i(h_j)``,
  ``h_{i+1} = h'_i + MLP_i(h'_i)``.

Invariants:
- a plan whose groups all have one layer computes exactly the sequential model;
- the order in which residual adds and MLPs run is always the layer order;
- :func:`decoder_forward` never looks inside a layer: how a state is represented (vLLM's
  ``(hidden, residual)`` pair, a plain tensor for transformers) is the :class:`DecoderOps`'s business.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import torch

from vllm_easyspec.easyspec.layer_grouping import LayerGrouping

State = TypeVar("State")


class DecoderOps(Protocol, Generic[State]):
    """The per-layer pieces a model offers to :func:`decoder_forward`."""

    def exact_layer(self, layer: int, state: State) -> State:
        """Run layer ``layer`` exactly: attention on the current state, then residual add and MLP."""
        ...

    def group_input(self, state: State) -> torch.Tensor:
        """The full residual stream ``h_j`` that every attention layer of a fuzzy group reads."""
        ...

    def group_attention(self, group: Sequence[int], h: torch.Tensor) -> Sequence[torch.Tensor]:
        """``[Attn_i(h) for i in group]`` (each with its own input norm); may run them all at once."""
        ...

    def add_attention_and_mlp(self, layer: int, state: State, attention_output: torch.Tensor) -> State:
        """``h'_i = h_i + attention_output``; return the state holding ``h'_i + MLP_i(h'_i)``."""
        ...


def plan_for(grouping: LayerGrouping, fuzzy: bool) -> tuple[tuple[int, ...], ...]:
    """Every layer of the draft in order: the grouping's groups when ``fuzzy``, else all singletons.

    Layers 0 and L-1 are always singletons (the grouping never puts them in a group).
    """
    num_layers = grouping.num_layers
    if not fuzzy:
        return tuple((layer,) for layer in range(num_layers))
    middle = tuple(grouping.groups)
    head: tuple[tuple[int, ...], ...] = ((0,),) if num_layers >= 1 else ()
    tail: tuple[tuple[int, ...], ...] = ((num_layers - 1,),) if num_layers >= 2 else ()
    plan = head + middle + tail
    flat = [layer for group in plan for layer in group]
    if flat != list(range(num_layers)):
        raise ValueError(f"layer plan {plan} does not list layers 0..{num_layers - 1} once each, in order")
    return plan


def decoder_forward(state: State, plan: Sequence[Sequence[int]], ops: DecoderOps[State]) -> State:
    """Run the decoder layers of ``plan`` on ``state`` (Algorithm 2 for groups of two or more)."""
    for group in plan:
        if len(group) == 1:
            state = ops.exact_layer(group[0], state)
            continue
        h = ops.group_input(state)
        outputs = ops.group_attention(group, h)
        if len(outputs) != len(group):
            raise ValueError(f"group {tuple(group)} produced {len(outputs)} attention outputs")
        for layer, attention_output in zip(group, outputs, strict=True):
            state = ops.add_attention_and_mlp(layer, state, attention_output)
    return state
