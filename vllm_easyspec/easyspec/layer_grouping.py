"""Layer grouping for fuzzy (layer-parallel) drafting, as in EasySpec section 3.1.1.

Invariants of a resolved grouping:
- layers 0 and L-1 are never in a group of two or more (they always run exact);
- groups are disjoint runs of consecutive layer indices inside 1..L-2, in ascending order;
- every layer 1..L-2 belongs to exactly one group (a group of one runs exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from vllm_easyspec.easyspec.config import EasySpecConfig, EasySpecConfigError


@dataclass(frozen=True)
class LayerGrouping:
    """The resolved grouping of a draft model's layers and how a group's attention runs."""

    num_layers: int
    groups: tuple[tuple[int, ...], ...]
    """Groups covering layers 1..L-2 in order; groups of one layer run exact."""
    mode: Literal["fused", "tensor_parallel"]

    @property
    def fuzzy_groups(self) -> tuple[tuple[int, ...], ...]:
        return tuple(group for group in self.groups if len(group) > 1)

    def describe(self) -> str:
        def span(group: tuple[int, ...]) -> str:
            return f"{group[0]}-{group[-1]}" if len(group) > 1 else str(group[0])

        fuzzy = ", ".join(span(g) for g in self.fuzzy_groups) or "none"
        return (
            f"{self.num_layers} layers, exact: 0, {self.num_layers - 1} and singletons; "
            f"fuzzy groups: {fuzzy}; mode: {self.mode}"
        )


def default_layer_groups(num_layers: int, layer_parallel_size: int) -> tuple[tuple[int, ...], ...]:
    """The paper's grouping: layer i in 1..L-2 joins group floor(i / N) (aligned blocks clipped to 1..L-2).

    For 32 layers and N = 4 this is 1-3, 4-7, ..., 24-27, 28-30.
    """
    if num_layers < 1:
        raise EasySpecConfigError(f"the draft model has {num_layers} layers; it needs at least one")
    if layer_parallel_size < 1:
        raise EasySpecConfigError(f"easyspec.layer_parallel_size must be >= 1, got {layer_parallel_size}")
    blocks: dict[int, list[int]] = {}
    for layer in range(1, num_layers - 1):
        blocks.setdefault(layer // layer_parallel_size, []).append(layer)
    return tuple(tuple(block) for _, block in sorted(blocks.items()))


def _validate_explicit_groups(groups: tuple[tuple[int, ...], ...], num_layers: int) -> None:
    seen: dict[int, int] = {}
    for index, group in enumerate(groups):
        if not group:
            raise EasySpecConfigError(f"easyspec.layer_groups[{index}] is empty; remove it")
        for layer in group:
            if layer in (0, num_layers - 1):
                raise EasySpecConfigError(f"easyspec.layer_groups[{index}] = {list(group)} contains layer "
                                          f"{layer}, the {'first' if layer == 0 else 'last'} layer of the "
                                          f"{num_layers}-layer draft; the first and last layers always run "
                                          f"exact, so use indices 1..{num_layers - 2} only")
            if not 0 <= layer < num_layers:
                raise EasySpecConfigError(f"easyspec.layer_groups[{index}] names layer {layer}, but the "
                                          f"draft has layers 0..{num_layers - 1}; use indices "
                                          f"1..{num_layers - 2}")
            if layer in seen:
                raise EasySpecConfigError(f"easyspec.layer_groups[{seen[layer]}] and "
                                          f"easyspec.layer_groups[{index}] overlap at layer {layer}; each "
                                          "layer may belong to one group only")
            seen[layer] = index
        if list(group) != list(range(group[0], group[0] + len(group))):
            raise EasySpecConfigError(f"easyspec.layer_groups[{index}] = {list(group)} is not a run of "
                                      "consecutive ascending layers; write it as "
                                      f"{list(range(min(group), min(group) + len(group)))}-style runs")


def resolve_layer_groups(
    config: EasySpecConfig, num_layers: int, tensor_parallel_size: int = 1
) -> LayerGrouping:
    """Validate ``config`` against a draft with ``num_layers`` layers and return the full grouping."""
    groupable = max(num_layers - 2, 0)
    if config.layer_groups:
        explicit = tuple(tuple(int(layer) for layer in group) for group in config.layer_groups)
        _validate_explicit_groups(explicit, num_layers)
        covered = {layer for group in explicit for layer in group}
        singletons = tuple((layer,) for layer in range(1, num_layers - 1) if layer not in covered)
        groups = tuple(sorted(explicit + singletons))
    else:
        if config.layer_parallel_size > max(groupable, 1):
            raise EasySpecConfigError(f"easyspec.layer_parallel_size = {config.layer_parallel_size} is "
                                      f"larger than the {groupable} groupable layers of the "
                                      f"{num_layers}-layer draft (its first and last layers run exact); "
                                      f"choose a size from 1 to {max(groupable, 1)}")
        groups = default_layer_groups(num_layers, config.layer_parallel_size)
    widest = max((len(group) for group in groups), default=1)
    mode: Literal["fused", "tensor_parallel"]
    if config.mode == "tensor_parallel":
        if tensor_parallel_size < widest:
            raise EasySpecConfigError("easyspec.mode = 'tensor_parallel' runs one layer of a group per "
                                      f"rank, so it needs tensor_parallel_size >= {widest} (the widest "
                                      f"group), but tensor_parallel_size = {tensor_parallel_size}; raise "
                                      f"--tensor-parallel-size to {widest} or use mode 'fused'")
        mode = "tensor_parallel"
    elif config.mode == "fused":
        mode = "fused"
    else:
        mode = "tensor_parallel" if tensor_parallel_size > 1 and tensor_parallel_size >= widest else "fused"
    return LayerGrouping(num_layers=num_layers, groups=groups, mode=mode)
