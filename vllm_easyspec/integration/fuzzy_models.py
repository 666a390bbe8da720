"""Fuzzy (layer-parallel) forwards for vLLM draft models (Llama and Qwen2 families; docs/design.md, "EasySpec").

:class:`FuzzyDraftController` replaces the forward of a loaded model's inner decoder with one that, per forward,
asks the calibration schedule whether to run exact (vLLM's own forward) or fuzzy (the paper's Algorithm 2 through
:func:`vllm_easyspec.easyspec.fuzzy_forward.decoder_forward`), its group attention ``fused`` (one GEMM over the
group's stacked QKV weights, one batched output projection) or ``tensor_parallel`` (rank r runs the group's r-th
layer; one all-gather returns every layer's output and new K/V, written into every rank's cache).

Invariants: an exact forward is vLLM's forward; a fuzzy forward's plan lists every layer once in order,
layers 0 and L-1 exact; every rank runs the same sequence of collectives.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_easyspec.easyspec.calibration import CalibrationSchedule
from vllm_easyspec.easyspec.config import EasySpecConfigError
from vllm_easyspec.easyspec.fuzzy_forward import decoder_forward, plan_for
from vllm_easyspec.easyspec.layer_grouping import LayerGrouping

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def check_fuzzy_architecture(architectures: Sequence[str] | None, hf_config: object | None = None) -> None:
    """Raise the "unsupported for fuzzy drafting" error unless the draft is a supported family."""
    names = list(architectures or [])
    supported = [name for name in names if name in SUPPORTED_ARCHITECTURES]
    problem = None
    if not supported:
        problem = f"draft architecture {'/'.join(names) or '<unknown>'} is unsupported for fuzzy drafting"
    elif hf_config is not None and getattr(hf_config, "qk_norm", False):
        problem = f"draft architecture {supported[0]} with qk_norm is unsupported for fuzzy drafting"
    if problem is not None:
        raise EasySpecConfigError(f"{problem} (supported: {', '.join(SUPPORTED_ARCHITECTURES)}); set "
                                  "easyspec.layer_parallel_size to 1 (and drop easyspec.layer_groups) for "
                                  "exact drafting, or use a Llama or Qwen2 draft")


@contextlib.contextmanager
def replicated_tensor_parallel() -> Iterator[None]:
    """Build layers as if tensor parallelism were 1 (replaces vllm.distributed.parallel_state._TP meanwhile): every
    linear, embedding and attention layer built inside holds full weights and all heads, and never communicates
    (vLLM layers read the TP size once, at construction)."""
    from vllm.distributed import parallel_state

    original = parallel_state._TP
    if original is None or original.world_size == 1:
        yield
        return
    single = copy.copy(original)
    single.world_size = 1
    single.rank_in_group = 0
    parallel_state._TP = single
    try:
        yield
    finally:
        parallel_state._TP = original


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without the weight (the weights are folded into the stacked projection)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


@contextlib.contextmanager
def keep_dense_weights(prefix_fragments: Sequence[str]) -> Iterator[None]:
    """While a model loads, keep a dense copy of the linear weights whose prefix contains one of
    ``prefix_fragments`` as ``layer.easyspec_dense_weight``.

    vLLM's CPU backend repacks linear weights for its GEMM library after loading and drops the dense
    tensor (``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(remove_weight=True)``); the
    fused group projection needs the dense weights once, to stack them.
    """
    from vllm.model_executor.layers import utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm

    # Replaces vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm while the draft loads:
    # same dispatch, after snapshotting the dense weight of the layers we stack.
    def dispatch_keeping_weight(layer: nn.Module, remove_weight: bool) -> None:
        prefix = getattr(layer, "prefix", "")
        weight = getattr(layer, "weight", None)
        if weight is not None and weight.ndim == 2 and any(f in prefix for f in prefix_fragments):
            layer.easyspec_dense_weight = weight.detach().clone()
        original(layer, remove_weight)

    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight
    try:
        yield
    finally:
        layer_utils.dispatch_cpu_unquantized_gemm = original


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """The dense weight of a vLLM linear layer (kept by :func:`keep_dense_weights` on CPU)."""
    weight = getattr(linear, "easyspec_dense_weight", None)
    if weight is None:
        weight = linear.weight
    if weight.numel() == 0:
        raise RuntimeError(f"the dense weight of {getattr(linear, 'prefix', linear)} was dropped by vLLM's "
                           "CPU GEMM dispatch; load the draft inside keep_dense_weights()")
    return weight


class StackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` through the same GEMM dispatch as vLLM's own linear layers."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.cpu_linear = None
        if weight.device.type == "cpu":
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(self, remove_weight=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_linear is not None:
            return self.cpu_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


@dataclass
class _FusedGroup:
    """One fuzzy group's stacked QKV projection, output laid out ``[q_1..q_N | k_1..k_N | v_1..v_N]``,
    with each layer's input-norm weight folded in (so it reads the un-weighted RMS norm of ``h``)."""

    layers: tuple[int, ...]
    qkv: StackedLinear
    eps: float
    q_size: int
    kv_size: int


@dataclass
class FuzzyForwardCounts:
    """Per-worker counters: exact/fuzzy draft forwards and group-attention calls of each kind."""

    exact: int = 0
    fuzzy: int = 0
    fused_groups: int = 0
    parallel_groups: int = 0


class FuzzyDraftController:
    """Owns the fuzzy forward of one loaded vLLM draft model (see the module docstring)."""

    def __init__(self, causal_lm: nn.Module, grouping: LayerGrouping, schedule: CalibrationSchedule) -> None:
        inner = getattr(causal_lm, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or layers is None or len(layers) != grouping.num_layers:
            raise EasySpecConfigError(f"{type(causal_lm).__name__} is unsupported for fuzzy drafting (no "
                                      f"decoder stack of {grouping.num_layers} layers); set "
                                      "easyspec.layer_parallel_size to 1 for exact drafting")
        for index, layer in enumerate(layers):
            _check_layer(type(causal_lm).__name__, index, layer)
        self.causal_lm = causal_lm
        self.inner = inner
        self.grouping = grouping
        self.schedule = schedule
        self.counts = FuzzyForwardCounts()
        self.plan = plan_for(grouping, fuzzy=True)
        self._exact_forward = inner.forward
        from vllm.distributed import get_tp_group

        tp = get_tp_group()
        self.tp_group = tp
        self.tp_rank = tp.rank_in_group
        self.tp_size = tp.world_size
        if grouping.mode == "tensor_parallel":
            widest = max((len(g) for g in grouping.fuzzy_groups), default=1)
            if self.tp_size < widest:
                raise EasySpecConfigError("easyspec.mode 'tensor_parallel' needs tensor_parallel_size >= "
                                          f"{widest}, got {self.tp_size}")
            self._fused: dict[tuple[int, ...], _FusedGroup] = {}
        else:
            self._fused = {group: self._stack_group(group) for group in grouping.fuzzy_groups}
        # The fuzzy forward is eager: a traced graph (DYNAMO_TRACE_ONCE drops guards) could not switch
        # between the exact and the fuzzy path.
        inner.do_not_compile = True
        # Replaces, on this draft instance only, vllm.model_executor.models.llama.LlamaModel.forward
        # (Qwen2: vllm.model_executor.models.qwen2.Qwen2Model.forward); exact forwards call the original.
        inner.forward = self.forward

    # ----------------------------------------------------------------------------------------------
    def _stack_group(self, group: tuple[int, ...]) -> _FusedGroup:
        attn_modules = [self.inner.layers[i].self_attn for i in group]
        norms = [self.inner.layers[i].input_layernorm for i in group]
        q_size, kv_size = attn_modules[0].q_size, attn_modules[0].kv_size
        q_parts, k_parts, v_parts, qb, kb, vb = [], [], [], [], [], []
        with torch.no_grad():
            for attn, norm in zip(attn_modules, norms, strict=True):
                weight = dense_weight(attn.qkv_proj).float() * norm.weight.float()[None, :]
                q, k, v = weight.split([q_size, kv_size, kv_size], dim=0)
                q_parts.append(q)
                k_parts.append(k)
                v_parts.append(v)
                bias = getattr(attn.qkv_proj, "bias", None)
                if bias is not None:
                    bq, bk, bv = bias.float().split([q_size, kv_size, kv_size])
                    qb.append(bq)
                    kb.append(bk)
                    vb.append(bv)
            dtype = norms[0].weight.dtype
            qkv_weight = torch.cat(q_parts + k_parts + v_parts, dim=0).to(dtype).contiguous()
            qkv_bias = torch.cat(qb + kb + vb).to(dtype) if qb else None
        for attn in attn_modules:
            attn.qkv_proj.__dict__.pop("easyspec_dense_weight", None)
        return _FusedGroup(
            layers=group,
            qkv=StackedLinear(qkv_weight, qkv_bias, prefix=f"easyspec.fused_qkv.{group[0]}-{group[-1]}"),
            eps=float(norms[0].variance_epsilon),
            q_size=q_size,
            kv_size=kv_size,
        )

    # ----------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors: object | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
        if self.schedule.next_forward_exact():
            self.counts.exact += 1
            return self._exact_forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        self.counts.fuzzy += 1
        hidden = inputs_embeds if inputs_embeds is not None else self.inner.embed_input_ids(input_ids)
        ops = _VllmDecoderOps(self, positions)
        hidden, residual = decoder_forward((hidden, None), self.plan, ops)
        hidden, _ = self.inner.norm(hidden, residual)
        return hidden

    # ----------------------------------------------------------------------------------------------
    def fused_group_attention(
        self, group: tuple[int, ...], h: torch.Tensor, positions: torch.Tensor
    ) -> list[torch.Tensor]:
        """One stacked QKV GEMM, one rotary call, N paged attentions (each writing its own KV), N output
        projections without reduction and, under head-sharded TP, one all-reduce for the whole group."""
        self.counts.fused_groups += 1
        fused = self._fused[group]
        n = len(group)
        qkv = fused.qkv(_rms(h, fused.eps))
        q_all, k_all, v_all = qkv.split([n * fused.q_size, n * fused.kv_size, n * fused.kv_size], dim=-1)
        rotary = self.inner.layers[group[0]].self_attn.rotary_emb
        q_all, k_all = rotary(positions, q_all, k_all)
        outputs = []
        for i, layer in enumerate(group):
            self_attn = self.inner.layers[layer].self_attn
            q = q_all[:, i * fused.q_size : (i + 1) * fused.q_size]
            k = k_all[:, i * fused.kv_size : (i + 1) * fused.kv_size]
            v = v_all[:, i * fused.kv_size : (i + 1) * fused.kv_size]
            o_proj = self_attn.o_proj
            # o_proj without its all-reduce and bias: RowParallelLinear adds the bias after reducing.
            outputs.append(o_proj.quant_method.apply(o_proj, self_attn.attn(q, k, v)))
        if self.tp_size > 1:
            stacked = self.tp_group.all_reduce(torch.stack(outputs))  # one all-reduce for N layers
            outputs = list(stacked.unbind(0))
        for i, layer in enumerate(group):
            bias = getattr(self.inner.layers[layer].self_attn.o_proj, "bias", None)
            if bias is not None:
                outputs[i] = outputs[i] + bias
        return outputs

    def parallel_group_attention(
        self, group: tuple[int, ...], h: torch.Tensor, positions: torch.Tensor
    ) -> list[torch.Tensor]:
        """Rank r runs the whole attention of layer ``group[r]``; one all-gather shares outputs and K/V."""
        from vllm.model_executor.layers.attention.attention import unified_kv_cache_update

        self.counts.parallel_groups += 1
        first = self.inner.layers[group[0]].self_attn
        hidden_size = h.shape[-1]
        q_size, kv_size = first.q_size, first.kv_size
        width = hidden_size + 2 * kv_size
        if self.tp_rank < len(group):
            layer = self.inner.layers[group[self.tp_rank]]
            attn = layer.self_attn
            qkv, _ = attn.qkv_proj(layer.input_layernorm(h))
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q, k = attn.rotary_emb(positions, q, k)
            out, _ = attn.o_proj(attn.attn(q, k, v))
            packed = torch.cat([out, k, v], dim=-1)
        else:
            packed = h.new_zeros(h.shape[0], width)
        gathered = self.tp_group.all_gather(packed.unsqueeze(0).contiguous(), dim=0)
        outputs = []
        for i, layer_index in enumerate(group):
            row = gathered[i]
            outputs.append(row[:, :hidden_size])
            if i == self.tp_rank:
                continue
            attn_layer = self.inner.layers[layer_index].self_attn.attn
            key = row[:, hidden_size : hidden_size + kv_size].contiguous()
            value = row[:, hidden_size + kv_size :].contiguous()
            unified_kv_cache_update(
                key.view(-1, attn_layer.num_kv_heads, attn_layer.head_size),
                value.view(-1, attn_layer.num_kv_heads, attn_layer.head_size_v),
                attn_layer.layer_name,
            )
        return outputs


def _check_layer(arch: str, index: int, layer: nn.Module) -> None:
    attn = getattr(layer, "self_attn", None)
    needed = ("qkv_proj", "o_proj", "rotary_emb", "attn", "q_size", "kv_size")
    if (
        attn is None
        or not all(hasattr(attn, name) for name in needed)
        or not hasattr(layer, "input_layernorm")
        or not hasattr(layer, "post_attention_layernorm")
        or not hasattr(layer, "mlp")
        or getattr(attn, "qk_norm", False)
    ):
        raise EasySpecConfigError(f"{arch} layer {index} ({type(layer).__name__}) is unsupported for fuzzy "
                                  f"drafting (supported: {', '.join(SUPPORTED_ARCHITECTURES)}); set "
                                  "easyspec.layer_parallel_size to 1 for exact drafting")


class _VllmDecoderOps:
    """:class:`~vllm_easyspec.easyspec.fuzzy_forward.DecoderOps` over vLLM's ``(hidden, residual)`` state, where
    the residual stream is ``hidden + residual`` (``residual`` is None before layer 0)."""

    def __init__(self, controller: FuzzyDraftController, positions: torch.Tensor) -> None:
        self.controller = controller
        self.layers = controller.inner.layers
        self.positions = positions

    def exact_layer(
        self, layer: int, state: tuple[torch.Tensor, torch.Tensor | None]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, residual = state
        return self.layers[layer](self.positions, hidden, residual)

    def group_input(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        hidden, residual = state
        return hidden if residual is None else hidden + residual

    def group_attention(self, group: Sequence[int], h: torch.Tensor) -> Sequence[torch.Tensor]:
        group = tuple(group)
        if self.controller.grouping.mode == "tensor_parallel":
            return self.controller.parallel_group_attention(group, h, self.positions)
        return self.controller.fused_group_attention(group, h, self.positions)

    def add_attention_and_mlp(
        self, layer: int, state: tuple[torch.Tensor, torch.Tensor | None], attention_output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, residual = state
        decoder_layer = self.layers[layer]
        if residual is None:
            residual = attention_output + hidden
            normed = decoder_layer.post_attention_layernorm(residual)
        else:
            normed, residual = decoder_layer.post_attention_layernorm(attention_output + hidden, residual)
        return decoder_layer.mlp(normed), residual
