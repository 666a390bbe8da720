"""Where the tree reaches vLLM's CPU attention backend.

``TreeCPUAttentionBackend`` replaces ``CPU_ATTN`` (``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend``,
overridden through vLLM's ``register_backend``). It is vLLM's backend unchanged except for two kinds of
forward:

* **target verify** (:class:`TreeVerifyMetadata`): while the runner builds attention metadata for a step
  with token trees (:func:`verifying`), the builder splits the batch. Requests without a tree (prefill
  chunks, plain decodes) go to vLLM's C++ kernel as a sub-batch; each tree request's ``1 + n`` rows attend,
  in one masked SDPA per layer, to its cached prefix (read with the layout probed at start-up,
  :mod:`vllm_easyspec.integration.cpu_kv_layout`) and to the forward's own K/V of its root and nodes under
  the ancestor mask. The rows' K/V still go to their linear slots as vLLM writes them, and are kept so the
  sampler can move the accepted branch into place afterwards.
* **draft level** (:class:`TreeLevelMetadata`): a drafter forward over one depth of the draft trees. Those
  rows write nothing to the cache; they attend to the draft prefix (through the root) and to the K/V of
  their ancestors from earlier levels of the same step, kept in :class:`DraftTreeAttention`.

The C++ kernel has no arbitrary mask and returns no log-sum-exp, so the tree rows cannot use it; they
never read a slot that the step itself wrote, so the cache is only ever read back for the prefix.

Invariant: with no active tree step every method is vLLM's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_easyspec.easyspec.config import EasySpecConfigError, parse_easyspec_config
from vllm_easyspec.integration.cpu_kv_layout import GatherPlan, PagedKVReader, probe_cpu_kv_layout
from vllm_easyspec.tree.attention import attention_over_prefix_and_tree, prefix_and_tree_bias
from vllm_easyspec.tree.verify_step import TreeVerifyStep

BACKEND_PATH = "vllm_easyspec.integration.tree_attention_backend.TreeCPUAttentionBackend"


@dataclass
class VerifyKV:
    """One target layer's K/V of the tree rows, kept for moving the accepted branch into place."""

    key: torch.Tensor  # [R, Hkv, W, D]
    value: torch.Tensor
    block_size: int
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # (keys, values [A, Hkv, D], slots [A])


@dataclass
class TreeVerifyForward:
    """What the runner knows about a verify forward: the trees, and the K/V the layers keep."""

    step: TreeVerifyStep
    kept_kv: dict[str, VerifyKV] = field(default_factory=dict)
    block_table: torch.Tensor | None = None  # [R, max_blocks] of the tree requests, set by the builder


_ACTIVE_VERIFY: contextvars.ContextVar[TreeVerifyForward | None] = contextvars.ContextVar(
    "easyspec_tree_verify", default=None
)


@contextlib.contextmanager
def verifying(forward: TreeVerifyForward) -> Iterator[None]:
    """Attention metadata built inside this context is tree-verify metadata for ``forward``."""
    token = _ACTIVE_VERIFY.set(forward)
    try:
        yield
    finally:
        _ACTIVE_VERIFY.reset(token)


class _PrefixIndexCache:
    """Gather indices of the requests' cached prefixes, built once per layout and shared by every layer."""

    def __init__(self, block_table: torch.Tensor, lengths: torch.Tensor) -> None:
        self.block_table = block_table
        self.lengths = lengths
        self._plans: dict[tuple, tuple[PagedKVReader, GatherPlan]] = {}

    def gather(self, layer: Any, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[R, heads, max(lengths), dim]`` of one layer."""
        num_blocks, kv_heads, block_size, fused = kv_cache.shape
        key = (layer.isa, kv_cache.dtype, kv_heads, block_size, fused // 2)
        if key not in self._plans:
            reader = _reader(*key)
            self._plans[key] = (reader, reader.index(self.block_table, self.lengths))
        reader, plan = self._plans[key]
        return reader.gather(kv_cache, plan)


@functools.lru_cache(maxsize=16)
def _reader(isa: str, dtype: torch.dtype, kv_heads: int, block_size: int, head_size: int) -> PagedKVReader:
    return PagedKVReader(probe_cpu_kv_layout(isa, dtype, kv_heads, block_size, head_size))


@dataclass
class TreeVerifyMetadata:
    """Per-forward metadata of a verify step that contains token trees (shared by all target layers)."""

    num_actual_tokens: int
    chain: Any | None  # vLLM's CPUAttentionMetadata for the requests without trees, or None
    chain_rows: torch.Tensor | None  # their flattened rows
    forward: TreeVerifyForward
    query_rows: torch.Tensor  # [R, W] flattened row of each query (padding repeats the root)
    valid_rows: torch.Tensor  # [R, W]
    valid_flat_rows: torch.Tensor  # forward rows of the real (non-padding) queries
    valid_flat_index: torch.Tensor  # their places in the [R * W] query layout
    single: tuple[int, int] | None  # (first, end) forward rows when the step has one tree request
    tree_mask: torch.Tensor  # [R, W, W]
    prefix_lens: torch.Tensor  # [R] = P, the cached prefix is positions < P
    prefix: _PrefixIndexCache
    biases: dict[tuple, torch.Tensor] = field(default_factory=dict)  # built once, shared by the layers


def _attention(meta: TreeVerifyMetadata | TreeLevelMetadata, prefix_lens: torch.Tensor, query: torch.Tensor,
               prefix_key: torch.Tensor, prefix_value: torch.Tensor, tree_key: torch.Tensor,
               tree_value: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`attention_over_prefix_and_tree` with the forward's additive mask built by its first layer."""
    group = query.shape[2] // prefix_key.shape[1]
    shape = (prefix_key.shape[2], tree_key.shape[2], group, query.dtype)
    bias = meta.biases.get(shape)
    if bias is None:
        bias = meta.biases[shape] = prefix_and_tree_bias(prefix_lens, shape[0], meta.tree_mask, group, query.dtype)
    return attention_over_prefix_and_tree(query, prefix_key, prefix_value, prefix_lens, tree_key, tree_value,
                                          meta.tree_mask, scale, bias=bias)


@dataclass
class DraftTreeAttention:
    """Shared by the level forwards of one drafting step: the cached draft prefix (through the root) of
    every request and, per draft layer, the K/V of the nodes forwarded so far."""

    prefix_lens: torch.Tensor  # [B] = root position + 1
    block_table: torch.Tensor  # [B, max_blocks]
    stash: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # [B, Hkv, S, D]
    prefix_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    prefix: _PrefixIndexCache | None = None

    def __post_init__(self) -> None:
        self.prefix = _PrefixIndexCache(self.block_table, self.prefix_lens)

    def append(self, layer_name: str, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add a level's K/V ``[B, Hkv, F, D]`` to a layer's stash; return the layer's whole stash."""
        if layer_name in self.stash:
            old_key, old_value = self.stash[layer_name]
            key, value = torch.cat([old_key, key], dim=2), torch.cat([old_value, value], dim=2)
        self.stash[layer_name] = (key, value)
        return key, value


@dataclass
class TreeLevelMetadata:
    """Per-forward metadata of one drafter level (shared by all draft layers)."""

    state: DraftTreeAttention
    width: int  # F frontier nodes per request
    tree_mask: torch.Tensor  # [B, F, S + F]
    biases: dict[tuple, torch.Tensor] = field(default_factory=dict)  # built once, shared by the layers

    @property
    def num_actual_tokens(self) -> int:
        return int(self.state.prefix_lens.shape[0]) * self.width


def record_level_kv(layer_name: str, key: torch.Tensor, value: torch.Tensor) -> None:
    """Keep the K/V that another rank computed for ``layer_name`` in a level forward (EasySpec's
    tensor_parallel mode, where rank r runs the attention of one layer of a group and all-gathers K/V)."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    if isinstance(metadata, dict):
        metadata = metadata.get(layer_name)
    if isinstance(metadata, TreeLevelMetadata):
        batch = int(metadata.state.prefix_lens.shape[0])
        metadata.state.append(layer_name, *_per_request(key, value, batch, metadata.width))


def _per_request(key: torch.Tensor, value: torch.Tensor, batch: int, width: int):
    """Level rows ``[B * F, Hkv, D]`` (request-major) as ``[B, Hkv, F, D]``."""

    def split(x: torch.Tensor) -> torch.Tensor:
        return x[: batch * width].reshape(batch, width, *x.shape[1:]).transpose(1, 2)

    return split(key), split(value)


def split_verify_batch(cm, step: TreeVerifyStep):
    """The requests of ``cm`` (vLLM's ``CommonAttentionMetadata``) that have no tree in ``step``, as their own
    ``CommonAttentionMetadata`` with their flattened rows in the full batch; ``(None, None)`` if none has a row.

    Every per-request field is sliced (the Triton builder also reads ``causal``, ``mm_req_doc_ranges`` and
    ``rswa_prefix_lens``), cached derived tensors are dropped, ``max_seq_len`` uses the CPU upper bound when
    the runner gives one (no device sync), and requests with no rows (CUDA-graph padding) never make a
    sub-batch on their own. Shared by the CPU and GPU tree backends.
    """
    num_reqs = cm.num_reqs
    query_start = cm.query_start_loc_cpu[: num_reqs + 1].long()
    is_tree = torch.zeros(num_reqs, dtype=torch.bool)
    is_tree[step.batch_rows] = True
    chain_requests = (~is_tree).nonzero().flatten()
    lengths = query_start[1:] - query_start[:-1]
    if not chain_requests.numel() or not int(lengths[chain_requests].sum()):
        return None, None
    chain_lengths = lengths[chain_requests]
    chain_rows = torch.cat([
        torch.arange(int(query_start[r]), int(query_start[r + 1])) for r in chain_requests.tolist()
    ])
    sub_query_start = torch.zeros(len(chain_requests) + 1, dtype=cm.query_start_loc_cpu.dtype)
    sub_query_start[1:] = chain_lengths.cumsum(0)

    def per_request(x):
        if x is None:
            return None
        if isinstance(x, torch.Tensor):
            return x[chain_requests.to(x.device)]
        return x[chain_requests.numpy()]  # numpy arrays (encoder_seq_lens_cpu, req_idx)

    seq_lens = per_request(cm.seq_lens)
    upper = per_request(cm.seq_lens_cpu_upper_bound)
    rows = chain_rows.to(cm.slot_mapping.device)
    ranges = cm.mm_req_doc_ranges
    if ranges is not None:
        ranges = {new: ranges[old] for new, old in enumerate(chain_requests.tolist()) if old in ranges}
    sub = dataclasses.replace(
        cm,
        query_start_loc=sub_query_start.to(cm.query_start_loc.device),
        query_start_loc_cpu=sub_query_start,
        seq_lens=seq_lens,
        num_reqs=len(chain_requests),
        num_actual_tokens=int(chain_rows.numel()),
        max_query_len=int(chain_lengths.max()),
        max_seq_len=int((upper if upper is not None else seq_lens).max()),
        block_table_tensor=per_request(cm.block_table_tensor),
        slot_mapping=cm.slot_mapping[rows],
        positions=None if cm.positions is None else cm.positions[rows],
        causal=per_request(cm.causal) if isinstance(cm.causal, torch.Tensor) else cm.causal,
        seq_lens_cpu_upper_bound=upper,
        is_prefilling=per_request(cm.is_prefilling),
        encoder_seq_lens=per_request(cm.encoder_seq_lens),
        encoder_seq_lens_cpu=per_request(cm.encoder_seq_lens_cpu),
        dcp_local_seq_lens=per_request(cm.dcp_local_seq_lens),
        dcp_local_seq_lens_cpu_upper_bound=per_request(cm.dcp_local_seq_lens_cpu_upper_bound),
        req_idx=per_request(cm.req_idx),
        mm_req_doc_ranges=ranges,
        rswa_prefix_lens=per_request(cm.rswa_prefix_lens),
        replayssm_decode_base_cpu=per_request(cm.replayssm_decode_base_cpu),
        logits_indices_padded=None,  # kv-sharing fast prefill indexes the full batch
        num_logits_indices=None,
        max_logits_per_req=None,
        _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None,
    )
    return sub, chain_rows


def refuse_unsupported_layers(vllm_config, layer_names, no_window: Any) -> None:
    """Start-up self-check shared by the tree backends: refuse tree mode for attention layers whose features
    tree attention does not implement (``no_window`` is the backend's value for "no sliding window")."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    for name, layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).items():
        impl = layer.impl
        window = getattr(impl, "sliding_window", no_window)
        unsupported = [
            what for what, present in (
                ("a sliding window", (tuple(window) if isinstance(window, list | tuple) else window)
                 not in (no_window, None)),
                ("ALiBi", getattr(impl, "alibi_slopes", None) is not None),
                ("a logits soft cap", bool(getattr(impl, "logits_soft_cap", 0))),
                ("attention sinks", getattr(impl, "sinks", None) is not None),
                ("chunked local attention", getattr(impl, "chunk_lookback", -1) != -1),
            ) if present
        ]
        if unsupported:
            raise EasySpecConfigError(
                f"easyspec.tree: attention layer {name} uses {' and '.join(unsupported)}, which tree "
                "attention does not implement; remove easyspec.tree to use chain speculation with this model"
            )


class TreeVerifyBuilderMixin:
    """``build`` of a tree backend's metadata builder: vLLM's own, except while the runner builds a verify
    step's metadata (:func:`verifying`), when the backend's ``_build_verify`` builds tree metadata."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        forward = _ACTIVE_VERIFY.get()
        if forward is None:
            return self.build_without_trees(common_prefix_len, common_attn_metadata, fast_build)
        return self._build_verify(common_prefix_len, common_attn_metadata, forward)

    def build_without_trees(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        """vLLM's builder (the next class in the MRO); used for the requests without a tree too."""
        return super().build(common_prefix_len, common_attn_metadata, fast_build)


class TreeCPUAttentionMetadataBuilder(TreeVerifyBuilderMixin, CPUAttentionMetadataBuilder):
    """vLLM's builder; inside :func:`verifying` it builds :class:`TreeVerifyMetadata` instead."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        easyspec = parse_easyspec_config(vllm_config.additional_config)
        if easyspec is not None and easyspec.tree is not None:
            self._check_tree_support(layer_names, vllm_config)

    def _check_tree_support(self, layer_names, vllm_config) -> None:
        """Start-up self-check: refuse tree mode where tree attention would not be exact."""
        dtype = vllm_config.model_config.dtype if self.kv_cache_dtype in ("auto", None) else None
        if dtype is None:
            raise EasySpecConfigError(
                f"easyspec.tree supports only unquantized KV caches, got kv_cache_dtype {self.kv_cache_dtype!r}"
            )
        probe_cpu_kv_layout(self.isa, dtype, self.num_kv_heads, self.block_size, self.head_dim)
        refuse_unsupported_layers(vllm_config, layer_names, no_window=-1)

    def _build_verify(self, common_prefix_len, cm, forward: TreeVerifyForward) -> TreeVerifyMetadata:
        step = forward.step
        sub, chain_rows = split_verify_batch(cm, step)
        chain = None if sub is None else self.build_without_trees(common_prefix_len, sub)
        block_table = cm.block_table_tensor[step.batch_rows]
        forward.block_table = block_table
        return TreeVerifyMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            chain=chain,
            chain_rows=chain_rows,
            forward=forward,
            query_rows=step.attention_rows(),
            valid_rows=step.valid_rows,
            valid_flat_rows=step.attention_rows()[step.valid_rows],
            valid_flat_index=step.valid_rows.flatten().nonzero().flatten(),
            single=None if len(step) > 1 else (int(step.query_starts[0]), int(step.query_starts[0]) + step.width),
            tree_mask=step.attention_mask,
            prefix_lens=step.prefix_lens,
            prefix=_PrefixIndexCache(block_table, step.prefix_lens),
        )


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention, plus the tree-verify and draft-level forwards (module docstring)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if isinstance(attn_metadata, TreeVerifyMetadata):
            return self._verify(layer, query, key, value, kv_cache, attn_metadata, output)
        if isinstance(attn_metadata, TreeLevelMetadata):
            return self._level(layer, query, key, value, kv_cache, attn_metadata, output)
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                               output_scale=output_scale, output_block_scale=output_block_scale)

    def _verify(self, layer, query, key, value, kv_cache, meta: TreeVerifyMetadata, output):
        if meta.chain is not None:
            rows = meta.chain_rows
            chain_out = torch.empty((rows.numel(), *output.shape[1:]), dtype=output.dtype)
            super().forward(layer, query[rows], key[rows], value[rows], kv_cache, meta.chain, chain_out)
            output[rows] = chain_out
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
        prefix_key, prefix_value = meta.prefix.gather(layer, kv_cache)
        out = _attention(meta, meta.prefix_lens, tree_query, prefix_key, prefix_value, tree_key, tree_value,
                         self.scale)
        if meta.single is not None:
            output[first:end] = out[0]
        else:
            output.index_copy_(0, meta.valid_flat_rows, out.reshape(-1, *out.shape[2:]).index_select(
                0, meta.valid_flat_index).to(output.dtype))
        meta.forward.kept_kv[layer.layer_name] = VerifyKV(
            tree_key, tree_value, kv_cache.shape[2], functools.partial(_write_cpu_cache, layer, kv_cache)
        )
        return output

    def _level(self, layer, query, key, value, kv_cache, meta: TreeLevelMetadata, output):
        state = meta.state
        batch = int(state.prefix_lens.shape[0])
        count = batch * meta.width
        level_key, level_value = _per_request(key, value, batch, meta.width)
        tree_key, tree_value = state.append(layer.layer_name, level_key, level_value)
        if layer.layer_name not in state.prefix_kv:
            state.prefix_kv[layer.layer_name] = state.prefix.gather(layer, kv_cache)
        prefix_key, prefix_value = state.prefix_kv[layer.layer_name]
        query = query[:count].reshape(batch, meta.width, *query.shape[1:])
        out = _attention(meta, state.prefix_lens, query, prefix_key, prefix_value, tree_key, tree_value, self.scale)
        output[:count] = out.reshape(count, *out.shape[2:]).to(output.dtype)
        return output


def _write_cpu_cache(layer, kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     slots: torch.Tensor) -> None:
    """Write K/V rows to ``slots`` of one layer's cache through vLLM's own op (whatever its layout)."""
    from vllm import _custom_ops as ops

    num_blocks, kv_heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, layer.isa,
                                   k_scale=layer._k_scale_float, v_scale=layer._v_scale_float)


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
