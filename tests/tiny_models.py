"""Tiny random models built at test time: a Llama, a Qwen2 and an MoE target sharing one tokenizer.

Invariants:
- Every model of one family shares its embedding and LM head (drawn from ``FAMILY_SEED``), so a draft with
  its own random layers still agrees with the target often enough for speculation to accept some drafts.
- Head size is 32 (the CPU attention kernel's smallest), weights are float32, and logits are spread
  enough (LM-head scale) that sampling at temperature 1 is neither uniform nor one-hot.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB_SIZE = 64
FAMILY_SEED = 1234
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def build_tiny_tokenizer(out: Path) -> Path:
    """A word-level tokenizer over ``<unk> <s> </s> w3 .. w63``; words are split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{index}": index for index in range(len(SPECIAL_TOKENS), VOCAB_SIZE)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return out


def _config(arch: str, num_layers: int, vocab_size: int = VOCAB_SIZE, **sizes):
    """``sizes``: overrides of ``hidden_size``, ``intermediate_size`` or (Mixtral) ``num_local_experts``."""
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config

    experts = sizes.pop("num_local_experts", 4)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rms_norm_eps=1e-5,
    ) | sizes
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        common.pop("head_dim")  # Qwen2 derives head_dim = hidden_size / heads
        return Qwen2Config(**common, use_sliding_window=False)
    if arch == "mixtral":
        return MixtralConfig(**common, num_local_experts=experts, num_experts_per_tok=2)
    raise ValueError(f"unknown tiny architecture {arch!r}")


def build_tiny_model(
    out: Path,
    tokenizer_dir: Path,
    arch: str = "llama",
    num_layers: int = 4,
    seed: int = 0,
    layer_scale: float = 1.0,
    logit_scale: float = 6.0,
    vocab_size: int = VOCAB_SIZE,
    **sizes: int,
) -> Path:
    """Write a random float32 model to ``out`` (HF safetensors + the shared tokenizer files).

    ``layer_scale`` scales each layer's output projections (attention o_proj and MLP down_proj): small
    values make the model close to the family's shared bigram map, so drafts agree with targets more.
    """
    from transformers import AutoModelForCausalLM

    config = _config(arch, num_layers, vocab_size, **sizes)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    family = torch.Generator().manual_seed(FAMILY_SEED)
    hidden = config.hidden_size
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(torch.randn(vocab_size, hidden, generator=family))
        lm_head = torch.randn(vocab_size, hidden, generator=family) * (logit_scale / hidden**0.5)
        model.get_output_embeddings().weight.copy_(lm_head)
        for name, parameter in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight")):
                parameter.mul_(layer_scale)
    model.save_pretrained(out, safe_serialization=True)
    for path in Path(tokenizer_dir).iterdir():
        if path.is_file():
            (out / path.name).write_bytes(path.read_bytes())
    (out / "tiny_model.json").write_text(
        json.dumps({"arch": arch, "num_layers": num_layers, "seed": seed, "layer_scale": layer_scale}) + "\n"
    )
    return out



def build_tiny_lora(out: Path, model_dir: Path, rank: int = 4, seed: int = 5, scale: float = 0.5) -> Path:
    """Write a random PEFT LoRA adapter for the Llama or Qwen2 at ``model_dir`` to ``out``: rank ``rank`` on
    every layer's q_proj and v_proj, large enough (``scale``) that greedy output with it differs from the base's."""
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_size = hidden // heads
    widths = {"q_proj": heads * head_size, "v_proj": config["num_key_value_heads"] * head_size}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for projection, width in widths.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{projection}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * scale
            tensors[f"{name}.lora_B.weight"] = torch.randn(width, rank, generator=generator) * scale
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
               "target_modules": list(widths), "fan_in_fan_out": False, "base_model_name_or_path": str(model_dir)}
    (out / "adapter_config.json").write_text(json.dumps(adapter) + "\n")
    return out

BYTE_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for item in items:\n    print(item)\n",
    "class Stack:\n    def push(self, value):\n        self.items.append(value)\n",
    "if value is None:\n    raise ValueError('value is missing')\n",
]


def build_byte_level_pair(out: Path, target_vocab: int = 320, draft_vocab: int = 290) -> tuple[Path, Path]:
    """A tiny Llama target with a ``target_vocab``-token byte-level BPE vocabulary, and its draft: the same
    weights over the vocabulary's first ``draft_vocab`` tokens (the BPE's later merges removed), so the draft
    agrees with the target wherever it can spell the target's token, and lacks the other tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=target_vocab, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(BYTE_CORPUS * 50, trainer)
    assert backend.get_vocab_size() == target_vocab
    state = json.loads(backend.to_str())
    state["model"]["vocab"] = {piece: index for piece, index in state["model"]["vocab"].items() if index < draft_vocab}
    kept = set(state["model"]["vocab"])
    state["model"]["merges"] = [merge for merge in state["model"]["merges"]
                                if "".join(merge if isinstance(merge, list) else merge.split(" ")) in kept]
    tokenizers = {"target": backend, "draft": Tokenizer.from_str(json.dumps(state))}
    dirs = {name: out / f"byte_{name}" for name in tokenizers}
    for name, tokenizer in tokenizers.items():
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")
        fast.save_pretrained(dirs[name] / "tokenizer")
    target = build_tiny_model(dirs["target"], dirs["target"] / "tokenizer", "llama", num_layers=4, seed=21,
                              layer_scale=4.0, vocab_size=target_vocab)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    model.resize_token_embeddings(draft_vocab)
    model.save_pretrained(dirs["draft"], safe_serialization=True)
    for path in (dirs["draft"] / "tokenizer").iterdir():
        (dirs["draft"] / path.name).write_bytes(path.read_bytes())
    return target, dirs["draft"]
