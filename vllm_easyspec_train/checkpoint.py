"""Write and read EAGLE heads in the reference checkpoint formats.

``eagle`` (EAGLE-1/2, SafeAILab ``cnets1.py`` layout; vLLM ``EagleLlamaForCausalLM``)::

    config.json        LlamaForCausalLM config, num_hidden_layers = 1
    model.safetensors  fc.weight [h, 2h]
                       layers.0.self_attn.{q,k,v,o}_proj.weight
                       layers.0.mlp.{gate,up,down}_proj.weight
                       layers.0.post_attention_layernorm.weight

``eagle3`` (EAGLE-3, SafeAILab ``cnets.py`` layout; vLLM ``Eagle3LlamaForCausalLM``)::

    config.json        LlamaForCausalLMEagle3 config, num_hidden_layers = 1,
                       draft_vocab_size, target_hidden_size,
                       eagle_config.eagle_aux_hidden_state_layer_ids
    model.safetensors  fc.weight [h, 3h]
                       midlayer.self_attn.{q,k,v}_proj.weight [*, 2h], o_proj.weight
                       midlayer.mlp.{gate,up,down}_proj.weight
                       midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight
                       norm.weight, lm_head.weight [draft_vocab, h]
                       d2t [draft_vocab] int64 (target_id = draft_id + d2t[draft_id])
                       t2d [vocab] bool (token is in the draft vocabulary)

Neither layout stores ``embed_tokens`` (or, for ``eagle``, ``lm_head``): vLLM shares
them from the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .model import EagleHead, HeadConfig

WEIGHTS = "model.safetensors"


def _layer_prefix(fmt: str) -> str:
    return "midlayer." if fmt == "eagle3" else "layers.0."


def state_dict_reference(head: EagleHead, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The head's tensors under the reference names, as host tensors in ``dtype`` (wherever it trained)."""
    cfg = head.cfg
    pre = _layer_prefix(cfg.format)
    L = head.layer
    out: dict[str, torch.Tensor] = {"fc.weight": head.fc.weight}
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[f"{pre}self_attn.{n}.weight"] = getattr(L.self_attn, n).weight
    for n in ("gate_proj", "up_proj", "down_proj"):
        out[f"{pre}mlp.{n}.weight"] = getattr(L.mlp, n).weight
    out[f"{pre}post_attention_layernorm.weight"] = L.post_attention_layernorm.weight
    if cfg.format == "eagle3":
        out[f"{pre}input_layernorm.weight"] = L.input_layernorm.weight
        out[f"{pre}hidden_norm.weight"] = L.hidden_norm.weight
        out["norm.weight"] = head.norm.weight
        out["lm_head.weight"] = head.lm_head.weight
    res = {k: v.detach().to("cpu", dtype).contiguous() for k, v in out.items()}
    if cfg.format == "eagle3" and cfg.draft_vocab_size != cfg.vocab_size:
        # vLLM has no draft_id_to_target_id parameter when the vocabularies are equal
        res["d2t"] = head.d2t.detach().to("cpu", torch.long).contiguous()
        res["t2d"] = head.t2d.detach().to("cpu", torch.bool).contiguous()
    return res


def hf_config(cfg: HeadConfig, dtype: str = "bfloat16") -> dict:
    c = {
        "architectures": ["LlamaForCausalLMEagle3" if cfg.format == "eagle3" else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bias": False,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if cfg.format == "eagle3":
        c["draft_vocab_size"] = cfg.draft_vocab_size
        c["target_hidden_size"] = cfg.hidden_size
        c["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
        }
    c["easyspec_head_config"] = cfg.to_dict()
    return c


def save_head(head: EagleHead, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
              extra_files: dict[str, str] | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dname = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    save_file(state_dict_reference(head, dtype), str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(head.cfg, dname), indent=2) + "\n")
    for name, text in (extra_files or {}).items():
        (out / name).write_text(text)
    return out


def _cfg_from_hf(c: dict) -> HeadConfig:
    if "easyspec_head_config" in c:
        return HeadConfig(**c["easyspec_head_config"])
    fmt = "eagle3" if ("draft_vocab_size" in c or any("Eagle3" in a for a in c.get("architectures", []))) else "eagle"
    rope = c.get("rope_parameters") or {}
    ec = c.get("eagle_config") or {}
    return HeadConfig(
        format=fmt, hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
        vocab_size=c["vocab_size"], max_position_embeddings=c.get("max_position_embeddings", 4096),
        target_num_layers=-1, draft_vocab_size=c.get("draft_vocab_size", c["vocab_size"]) if fmt == "eagle3" else None,
        aux_layer_ids=list(ec.get("eagle_aux_hidden_state_layer_ids") or []),
    )


def load_head(head_dir: str | Path, dtype: torch.dtype = torch.float32) -> EagleHead:
    """Read a head written in either reference layout back into an :class:`EagleHead`."""
    d = Path(head_dir)
    cfg = _cfg_from_hf(json.loads((d / "config.json").read_text()))
    head = EagleHead(cfg)
    sd = load_file(str(d / WEIGHTS))
    pre = _layer_prefix(cfg.format)
    mapping = {k: v for k, v in state_dict_reference(head, torch.float32).items()}
    own = {}
    for name in mapping:
        if name in ("d2t", "t2d"):
            continue
        if name not in sd:
            raise KeyError(f"{d / WEIGHTS} lacks {name}")
        own[name] = sd[name]
    with torch.no_grad():
        head.fc.weight.copy_(own["fc.weight"].float())
        L = head.layer
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(L.self_attn, n).weight.copy_(own[f"{pre}self_attn.{n}.weight"].float())
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(L.mlp, n).weight.copy_(own[f"{pre}mlp.{n}.weight"].float())
        L.post_attention_layernorm.weight.copy_(own[f"{pre}post_attention_layernorm.weight"].float())
        if cfg.format == "eagle3":
            L.input_layernorm.weight.copy_(own[f"{pre}input_layernorm.weight"].float())
            L.hidden_norm.weight.copy_(own[f"{pre}hidden_norm.weight"].float())
            head.norm.weight.copy_(own["norm.weight"].float())
            head.lm_head.weight.copy_(own["lm_head.weight"].float())
            if "d2t" in sd:
                head.d2t.copy_(sd["d2t"])
                head.t2d.copy_(sd["t2d"] if "t2d" in sd else torch.zeros_like(head.t2d).index_fill_(0, head.draft_ids(), True))
            else:
                head.set_draft_vocab(torch.arange(cfg.draft_vocab_size))
    return head.to(dtype)
