"""Where the tree reaches vLLM's GPU attention backends: ``TRITON_ATTN`` and ``FLASH_ATTN``.

``TreeTritonAttentionBackend`` and ``TreeFlashAttentionBackend`` replace vLLM's ``TritonAttentionBackend`` and
``FlashAttentionBackend`` (``vllm.v1.attention.backends.triton_attn`` / ``flash_attn``, overridden through vLLM's
``register_backend`` on CUDA / ROCm only). Each is vLLM's backend unchanged except for the two kinds of tree
forward (:mod:`~vllm_easyspec.integration.tree_attention`); both keep the same logical cache
(``[num_blocks, Hkv, block_size, 2 * D]``, FlashAttention's layout in memory), so one mixin serves both:

* **target verify** (:class:`TreeGPUVerifyMetadata`): the rows of the trees that are not paths go to
  :func:`vllm_easyspec.kernels.tree_attention.tree_attention_triton` over the layer's cache, where vLLM's
  ``do_kv_cache_update`` has already put the rows' own K/V at the linear slots ``P + j``; every other row (prefill,
  requests without a tree, paths) goes to the backend's own kernel (FlashAttention with ``FLASH_ATTN``). The rows'
  K/V are also kept for the runner's commit (the accepted branch, written with ``do_kv_cache_update``).
* **draft level** (``levels_in_cache``): vLLM writes a level's K/V to the drafter's lookahead slots, and its rows
  attend through the same kernel from the level's first tree column on (``first_column``); vLLM's scheduler
  reserves those slots (:func:`install` raises ``num_lookahead_tokens`` to the nodes a drafting step forwards).

Both pass the layer's attention features (``impl.tree_features``: windows, chunks, soft caps, ALiBi, sinks) and
each tree column's logical offset to the kernel, which computes every row as vLLM computes a causal row there. fp8
caches (``fp8``, ``fp8_e4m3``, ``fp8_e5m2``: one scale per tensor) go to it viewed as vLLM's backends view them, with
the layer's scales, and the query as vLLM's layer hands it over (quantized to fp8 on CUDA).

While ``easyspec.tree`` is configured, the builders report at most ``UNIFORM_SINGLE_TOKEN_DECODE`` CUDA
graph support (a full graph of a uniform ``1 + n``-token batch would replay captured chain metadata), and with
``tree.uniform`` at most ``UNIFORM_BATCH``: the target's builders then serve every uniform batch, tree or not,
through the tree kernel from persistent buffers (:class:`UniformTreeRows`), at capture as at replay.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

from vllm_easyspec.easyspec.config import EasySpecConfigError
from vllm_easyspec.integration.compat import is_quantized_kv_cache, plugin_logger
from vllm_easyspec.integration.options import tree_options
from vllm_easyspec.integration.tree_attention import (
    TreeAttentionImplMixin,
    TreeLevelMetadata,
    TreeVerifyBuilderMixin,
    active_forward,
    assign_layer_features,
)
from vllm_easyspec.integration.tree_step import TreeVerifyForward, VerifyKV
from vllm_easyspec.tree.attention import FP8_KV_CACHE_DTYPES

BACKEND_PATHS = {name: f"vllm_easyspec.integration.gpu.attention_backend.Tree{kind}AttentionBackend"
                 for name, kind in (("TRITON_ATTN", "Triton"), ("FLASH_ATTN", "Flash"))}

logger = plugin_logger(__name__)


def reduced_fp32_precision_warning(dtype: torch.dtype, device: torch.device | str) -> str | None:
    """The start-up warning for a float32 tree engine whose Triton attention multiplies in reduced precision.

    vLLM's ``unified_attention`` and the tree kernel both multiply in TF32 on NVIDIA GPUs, but tiled and accumulated
    differently they round differently, so a logit near-tie can fall two ways: greedy output then differs from a
    run without speculation, as bf16 output does. ``TRITON_F32_DEFAULT=ieee`` makes both exact. Returns None where
    that cannot happen (other dtypes, exact products)."""
    from vllm_easyspec.kernels.tree_attention import triton_default_fp32_precision

    precision = triton_default_fp32_precision(device)
    if dtype != torch.float32 or precision == "ieee":
        return None
    return (
        f"easyspec.tree with a float32 model: Triton multiplies float32 attention inputs in {precision} on this "
        f"GPU (vLLM's kernel and the tree kernel alike), and the two kernels round differently, so greedy output "
        f"can differ from a run without speculation where two logits tie within about 1e-3. For token-exact "
        f"float32, start vLLM with TRITON_F32_DEFAULT=ieee (slower attention)."
    )


@dataclass
class TreeGPUVerifyMetadata:
    """Per-forward metadata of a verify step that contains token trees (shared by all target layers).
    All tensors are on the builder's device; ``T`` is the number of tree rows (roots and nodes)."""

    num_actual_tokens: int
    chain: Any | None  # the backend's own metadata for the other requests (paths included), or None
    chain_rows: torch.Tensor | None  # their flattened rows
    forward: TreeVerifyForward
    tree_rows: torch.Tensor  # [T] flattened forward row of every tree query, request-major
    cu_query_lens: torch.Tensor  # [R + 1] int32: request r owns tree_rows[cu[r]:cu[r + 1]]
    tree_mask: torch.Tensor  # [T, W] bool: request-local ancestor-or-self (root = column 0)
    prefix_lens: torch.Tensor  # [R] int32 = P; query j of request r sits at position P + j of its cache
    block_table: torch.Tensor  # [R, max_blocks] int32 of the masked tree requests
    column_offsets: torch.Tensor  # [R, W] int32: column c at logical position P + column_offsets[r, c] (its depth)
    max_query_len: int  # 1 + the largest n
    query_rows: torch.Tensor  # [R, W] flattened row of each query (padding repeats the root), for kept K/V
    uniform: UniformTreeRows | None = None  # a uniform step: R is the batch, its K/V kept in these buffers


class UniformTreeRows:
    """Step 2 of docs/design.md, "Tree steps under CUDA graphs": the metadata of a uniform verify step (every request
    ``width`` rows, ``tree.uniform``; all of them through the tree kernel, a request without a branching tree under
    a causal mask) in device buffers for ``max_requests`` requests, refilled in place by each build, and each
    layer's kept K/V copied into buffers of its own by the forward, indexed by batch row: the tensors a captured
    graph reads and writes stay the same from step to step."""

    def __init__(self, max_requests: int, width: int, device: torch.device) -> None:
        self.max_requests, self.width, self.device = max_requests, width, device
        self.rows = torch.arange(max_requests * width, device=device)
        self.cu_query_lens = torch.arange(0, (max_requests + 1) * width, width, dtype=torch.int32, device=device)
        self.tree_mask = torch.zeros(max_requests * width, width, dtype=torch.bool, device=device)
        self.prefix_lens = torch.zeros(max_requests, dtype=torch.int32, device=device)
        self.column_offsets = torch.zeros(max_requests, width, dtype=torch.int32, device=device)
        self.kept_rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # the target's layers (allocate_kept)
        self.kept: dict[str, tuple[torch.Tensor, torch.Tensor, int, Any]] = {}  # layer -> (keys, values, block, write)
        self._causal = torch.ones(width, width, dtype=torch.bool).tril()

    def allocate_kept(self, layer_names, kv_cache_spec, dtype: torch.dtype) -> None:
        """K/V buffers for the target's ``layer_names`` (before any capture), in ``dtype``, the model's (the rows as
        they come, before any fp8 cache write quantizes them); a drafter's layers keep none."""
        shape = (self.max_requests, kv_cache_spec.num_kv_heads, self.width, kv_cache_spec.head_size)
        for name in layer_names:
            self.kept_rows[name] = (torch.empty(shape, dtype=dtype, device=self.device),
                                    torch.empty(shape, dtype=dtype, device=self.device))

    def serves(self, cm, step) -> bool:
        """Whether ``cm``'s batch is uniform (and ``step``'s trees, if any, ``width`` rows wide)."""
        return (cm.max_query_len == self.width and cm.num_actual_tokens == cm.num_reqs * self.width
                and cm.num_reqs <= self.max_requests and (step is None or step.width == self.width))

    def fill(self, cm, step) -> int:
        """Refill the buffers for ``cm``'s requests (``step``'s trees under their ancestor masks, their columns at
        their depths; a causal row at its column); returns how many."""
        count, rows = cm.num_reqs, cm.num_reqs * self.width
        mask = self._causal.repeat(count, 1)
        offsets = torch.arange(self.width).repeat(count, 1)
        if step is not None:
            mask[step.attention_rows()[step.valid_rows]] = step.attention_mask[step.valid_rows]
            offsets[step.batch_rows] = step.column_positions() - step.prefix_lens[:, None]
        self.tree_mask[:rows].copy_(mask, non_blocking=True)
        self.column_offsets[:count].copy_(offsets, non_blocking=True)
        self.prefix_lens[:count].copy_((cm.seq_lens[:count] - self.width).clamp(min=0))
        return count

    def keep(self, layer_name: str, key: torch.Tensor, value: torch.Tensor, count: int, block_size: int,
             write, block_table: torch.Tensor) -> VerifyKV | None:
        """Copy a target layer's rows ``[count * width, Hkv, D]`` into its buffers, and remember how the layer
        writes its cache (None for a drafter's layer)."""
        if layer_name not in self.kept_rows:
            return None
        keys, values = self.kept_rows[layer_name]
        self.kept.setdefault(layer_name, (keys, values, block_size, write))
        rows = count * self.width
        keys[:count].copy_(key[:rows].view(count, self.width, *key.shape[1:]).transpose(1, 2))
        values[:count].copy_(value[:rows].view(count, self.width, *value.shape[1:]).transpose(1, 2))
        return VerifyKV(keys[:count], values[:count], block_size, write, block_table, by_batch_row=True)

    def kept_kv(self, count: int, block_table: torch.Tensor) -> dict[str, VerifyKV]:
        """The layers' kept K/V of a step's ``count`` requests, as the runner's commit reads them (``block_table``:
        this builder's KV cache group's)."""
        return {name: VerifyKV(keys[:count], values[:count], block_size, write, block_table, by_batch_row=True)
                for name, (keys, values, block_size, write) in self.kept.items()}


class TreeGPUBuilderMixin(TreeVerifyBuilderMixin):
    """A vLLM GPU backend's builder; inside :func:`~vllm_easyspec.integration.tree_attention.verifying` it builds
    :class:`TreeGPUVerifyMetadata` instead."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        tree = tree_options(vllm_config)
        # as many requests as the largest captured batch holds (none without graphs: eager steps need no buffers)
        requests = 0 if tree is None or not tree.uniform else min(
            vllm_config.scheduler_config.max_num_seqs,
            (vllm_config.compilation_config.max_cudagraph_capture_size or 0) // (1 + tree.num_nodes))
        self.uniform_rows = UniformTreeRows(requests, 1 + tree.num_nodes, torch.device(device)) if requests else None
        self.model_dtype = vllm_config.model_config.dtype
        if tree is not None:
            # a verify step's metadata is per group: never copied to another group with only its table replaced
            self.supports_update_block_table = False
            self._check_tree_support(layer_names, vllm_config)
            warning = reduced_fp32_precision_warning(vllm_config.model_config.dtype, device)
            if warning is not None:
                logger.warning_once(warning)

    target_layers: frozenset[str] = frozenset()  # the target's layers among this builder's (mark_target)

    def mark_target(self, layer_names) -> None:
        """The runner, before any capture: this builder serves the target's ``layer_names`` (its uniform batches
        then use the buffers, the drafter's too where the two share a builder: causal rows, kept K/V for these)."""
        self.target_layers = frozenset(layer_names)
        if self.uniform_rows is not None:
            self.uniform_rows.allocate_kept(self.target_layers, self.kv_cache_spec, self.model_dtype)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        support, tree = super().get_cudagraph_support(vllm_config, kv_cache_spec), tree_options(vllm_config)
        if tree is None:
            return support
        limit = AttentionCGSupport.UNIFORM_BATCH if tree.uniform else AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return limit if support.value > limit.value else support  # else verify steps run eagerly through build()

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        forward = active_forward()
        if self._serves_uniform(common_attn_metadata, forward):
            return self.build_uniform(common_attn_metadata, forward)
        return super().build(common_prefix_len, common_attn_metadata, fast_build)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        if not self._serves_uniform(common_attn_metadata, None):
            return super().build_for_cudagraph_capture(common_attn_metadata)
        meta = self.build_uniform(common_attn_metadata, None)
        meta.prefix_lens.zero_()  # a short capture (vLLM's Triton builder captures seq_lens 1); replays read lengths
        return meta

    def _serves_uniform(self, cm, forward: TreeVerifyForward | None) -> bool:
        uniform = self.uniform_rows
        return uniform is not None and bool(self.target_layers) and uniform.serves(cm, None if forward is None else
                                                                                   forward.step)

    def _check_tree_support(self, layer_names, vllm_config) -> None:
        """Start-up self-check: refuse tree mode where the tree kernel would not be exact."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        if getattr(vllm_config.model_config, "rswa_window", None) is not None:
            raise EasySpecConfigError("easyspec.tree: this model uses reference sliding-window attention, "
                                      "which tree attention does not implement; remove easyspec.tree to use "
                                      "chain speculation with this model")
        for name, layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).items():
            dtype = layer.impl.kv_cache_dtype
            if is_quantized_kv_cache(dtype) and dtype not in FP8_KV_CACHE_DTYPES:
                raise EasySpecConfigError(f"easyspec.tree reads unquantized and {', '.join(FP8_KV_CACHE_DTYPES)} KV "
                                          f"caches, got kv_cache_dtype {dtype!r}; remove --kv-cache-dtype or "
                                          "easyspec.tree")
            if getattr(layer, "use_alibi_sqrt", False) or getattr(layer.impl, "chunk_lookback", -1) > -1:
                raise EasySpecConfigError(f"easyspec.tree: attention layer {name} uses square-root ALiBi or chunk "
                                          "look-back, which the tree kernel does not implement; remove "
                                          "easyspec.tree to use chain speculation")
        assign_layer_features(vllm_config, layer_names)

    def build_verify(self, common_prefix_len, cm, forward: TreeVerifyForward) -> TreeGPUVerifyMetadata:
        step = forward.masked
        chain, chain_rows = self.build_requests_without_tree(common_prefix_len, cm, step)
        device = self.device
        rows = step.attention_rows()
        cu_query_lens = torch.zeros(len(step) + 1, dtype=torch.int32)
        cu_query_lens[1:] = step.num_queries.cpu().cumsum(0)
        block_table = cm.block_table_tensor[step.batch_rows.to(cm.block_table_tensor.device, non_blocking=True)]
        column_offsets = step.column_positions() - step.prefix_lens[:, None]  # depths: shared by the layers
        return TreeGPUVerifyMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            chain=chain,
            chain_rows=None if chain_rows is None else chain_rows.to(device, non_blocking=True),
            forward=forward,
            tree_rows=rows[step.valid_rows].to(device, non_blocking=True),
            cu_query_lens=cu_query_lens.to(device, non_blocking=True),
            # [T, W]: each row's own request
            tree_mask=step.attention_mask[step.valid_rows].to(device, non_blocking=True),
            prefix_lens=step.prefix_lens.to(device, torch.int32, non_blocking=True),
            block_table=block_table.to(device, torch.int32, non_blocking=True),
            column_offsets=column_offsets.to(device, torch.int32, non_blocking=True),
            max_query_len=step.width,
            query_rows=rows.to(device, non_blocking=True),
        )

    def build_uniform(self, cm, forward: TreeVerifyForward | None) -> TreeGPUVerifyMetadata:
        """A uniform step's metadata in :class:`UniformTreeRows`' buffers (``forward`` None: every request a
        chain). The forward's kept K/V are the buffers', by batch row."""
        uniform = self.uniform_rows
        count = uniform.fill(cm, None if forward is None else forward.step)
        rows = uniform.rows[: count * uniform.width]
        block_table = cm.block_table_tensor[:count]
        if forward is not None:
            forward.kept_kv.update(uniform.kept_kv(count, block_table))  # filled by the forward (or a graph replay)
        return TreeGPUVerifyMetadata(
            num_actual_tokens=cm.num_actual_tokens, chain=None, chain_rows=None, forward=forward, tree_rows=rows,
            cu_query_lens=uniform.cu_query_lens[: count + 1], tree_mask=uniform.tree_mask[: count * uniform.width],
            prefix_lens=uniform.prefix_lens[:count], block_table=block_table,
            column_offsets=uniform.column_offsets[:count], max_query_len=uniform.width,
            query_rows=rows.view(count, uniform.width), uniform=uniform)


class TreeGPUImplMixin(TreeAttentionImplMixin):
    """A vLLM GPU backend's attention, plus the tree-verify and draft-level forwards (module docstring)."""

    verify_metadata = TreeGPUVerifyMetadata
    levels_in_cache = True

    def _fa_caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_blocks, block_size, Hkv, D]`` key and value views of the layer's logical
        ``[num_blocks, Hkv, block_size, 2 * D]`` cache, split as ``TritonAttentionImpl.forward`` does (an fp8
        cache's bytes as the platform's fp8 dtype, as both backends read it)."""
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        if is_quantized_kv_cache(self.kv_cache_dtype):
            from vllm.platforms import current_platform

            return key_cache.view(current_platform.fp8_dtype()), value_cache.view(current_platform.fp8_dtype())
        return key_cache, value_cache

    def _scales(self, layer, query: torch.Tensor) -> dict:
        """The tree kernel's scale arguments: an fp8 cache's ``k_scale`` / ``v_scale`` and, where vLLM's layer
        quantized the query (CUDA), ``q_scale``: the layer's device tensors, read by the kernel (no host sync)."""
        if not is_quantized_kv_cache(self.kv_cache_dtype):
            return {}
        quantized_query = query.dtype.itemsize == 1
        return dict(k_scale=layer._k_scale, v_scale=layer._v_scale, q_scale=layer._q_scale if quantized_query else None)

    def verify_trees(self, layer, query, key, value, kv_cache, meta: TreeGPUVerifyMetadata, output):
        from vllm_easyspec.kernels.tree_attention import tree_attention_triton, triton_default_fp32_precision

        key_cache, value_cache = self._fa_caches(kv_cache)
        rows = meta.tree_rows
        out = tree_attention_triton(
            query[rows], key_cache, value_cache, meta.block_table, meta.prefix_lens, meta.cu_query_lens,
            meta.tree_mask, self.scale, output.new_empty((rows.shape[0], *output.shape[1:])),
            max_query_len=meta.max_query_len, features=self.tree_features, **self._scales(layer, query),
            column_offsets=meta.column_offsets,
            # the precision vLLM's unified_attention computes the other rows in (TF32 for float32 on NVIDIA
            # by default; exact with TRITON_F32_DEFAULT=ieee, see reduced_fp32_precision_warning)
            fp32_precision=triton_default_fp32_precision(query.device),
        )
        output[rows] = out
        write = functools.partial(self._write_rows, layer, kv_cache)
        if meta.uniform is not None:
            kept = meta.uniform.keep(layer.layer_name, key, value, meta.query_rows.shape[0], key_cache.shape[1], write,
                                     meta.block_table)
        else:
            kept = VerifyKV(key[meta.query_rows].transpose(1, 2), value[meta.query_rows].transpose(1, 2),  # [R, Hkv, W, D]
                            key_cache.shape[1], write, meta.block_table)
        if meta.forward is not None and kept is not None:
            meta.forward.kept_kv[layer.layer_name] = kept
        return output

    def _write_rows(self, layer, kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    slots: torch.Tensor) -> None:
        """Write K/V rows ``[A, Hkv, D]`` to ``slots`` of one layer's cache, as every forward of this
        backend writes its K/V (vLLM's Triton reshape-and-cache, through the impl's own method)."""
        self.do_kv_cache_update(layer, keys.contiguous(), values.contiguous(), kv_cache,
                                slots.to(kv_cache.device, torch.int64, non_blocking=True))

    def _level(self, layer, query, key, value, kv_cache, meta: TreeLevelMetadata, output):
        """A draft level through the paged cache: vLLM has written the frontier's K/V at columns
        ``meta.first_column ..`` (the slot mapping ``TreeDrafting`` gives it), where the earlier levels' nodes
        precede them; the rows attend as a verify's do, from that column on."""
        from vllm_easyspec.kernels.tree_attention import tree_attention_triton, triton_default_fp32_precision

        count, state, features = meta.num_actual_tokens, meta.state, self.tree_features
        tree_attention_triton(
            query[:count], *self._fa_caches(kv_cache), state.block_table, state.prefix_lens, meta.query_starts,
            meta.tree_mask.flatten(0, 1), self.scale, output[:count], max_query_len=meta.width,
            first_column=meta.first_column, features=features, **self._scales(layer, query),
            column_offsets=meta.batch_column_offsets if features.uses_positions else None,
            fp32_precision=triton_default_fp32_precision(query.device))
        return output


class TreeTritonAttentionMetadataBuilder(TreeGPUBuilderMixin, TritonAttentionMetadataBuilder):
    pass


class TreeTritonAttentionImpl(TreeGPUImplMixin, TritonAttentionImpl):
    pass


class TreeFlashAttentionMetadataBuilder(TreeGPUBuilderMixin, FlashAttentionMetadataBuilder):
    pass


class TreeFlashAttentionImpl(TreeGPUImplMixin, FlashAttentionImpl):
    pass


class TreeTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeTritonAttentionImpl]:
        return TreeTritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TreeTritonAttentionMetadataBuilder]:
        return TreeTritonAttentionMetadataBuilder


class TreeFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeFlashAttentionImpl]:
        return TreeFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TreeFlashAttentionMetadataBuilder]:
        return TreeFlashAttentionMetadataBuilder


def reserve_level_slots(num_lookahead_tokens):
    """``VllmConfig.num_lookahead_tokens`` (its getter given) with a tree: at least one slot more than the nodes a
    drafting step forwards, so that the slots ``P + 1 .. P + forwarded`` a level writes (``_level``) are allocated
    (vLLM's chain writes ``num_speculative_tokens - 1`` past its root, inside ``num_speculative_tokens``)."""

    @functools.wraps(num_lookahead_tokens)
    def with_level_slots(vllm_config) -> int:
        slots = num_lookahead_tokens(vllm_config)
        tree = tree_options(vllm_config) if slots else None  # no drafter writes past the target: nothing to add
        return slots if tree is None else max(slots, tree.forwarded_nodes + 1)

    return with_level_slots


def install() -> None:
    from vllm.config import VllmConfig
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    # Replaces vllm.config.vllm.VllmConfig.num_lookahead_tokens (which vLLM's scheduler and warm-up read).
    if not hasattr(VllmConfig.num_lookahead_tokens.fget, "__wrapped__"):
        VllmConfig.num_lookahead_tokens = property(reserve_level_slots(VllmConfig.num_lookahead_tokens.fget))

    # Replaces the classes behind AttentionBackendEnum.TRITON_ATTN and FLASH_ATTN
    # (vllm.v1.attention.backends.triton_attn.TritonAttentionBackend, vllm.v1.attention.backends.flash_attn.
    # FlashAttentionBackend) with the subclasses above.
    for name, path in BACKEND_PATHS.items():
        register_backend(AttentionBackendEnum[name], path)
