"""Test-only: write an EAGLE / EAGLE-3 head in the SafeAILab reference layout, by hand.

No reference checkpoint can be downloaded here, so this script spells out the
reference names and shapes independently of ``vllm_easyspec_train.checkpoint``
(EAGLE-1/2: ``eagle/model/cnets1.py``; EAGLE-3: ``eagle/model/cnets.py`` and
``eagle/traineagle3/config.json``) and fills them with small random weights.

    python tests/eagle/reference_checkpoint.py TARGET_DIR OUT_DIR {eagle,eagle3}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def build_reference_checkpoint(target_dir, out_dir, fmt: str, draft_vocab_size: int | None = None,
                               seed: int = 0, aux_layer_ids=None) -> Path:
    t = json.loads((Path(target_dir) / "config.json").read_text())
    h, inter = t["hidden_size"], t["intermediate_size"]
    nh = t["num_attention_heads"]
    nkv = t.get("num_key_value_heads", nh)
    hd = t.get("head_dim") or h // nh
    vocab = t["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd: dict[str, torch.Tensor] = {}
    if fmt == "eagle":
        p, qkv_in = "layers.0.", h
        sd["fc.weight"] = w(h, 2 * h)
    else:
        p, qkv_in = "midlayer.", 2 * h
        sd["fc.weight"] = w(h, 3 * h)
        sd[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        sd[p + "hidden_norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        sd["norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        dv = draft_vocab_size or vocab
        sd["lm_head.weight"] = w(dv, h)
        ids = torch.sort(torch.randperm(vocab, generator=g)[:dv]).values
        sd["d2t"] = ids - torch.arange(dv)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        sd["t2d"] = t2d
    sd[p + "self_attn.q_proj.weight"] = w(nh * hd, qkv_in)
    sd[p + "self_attn.k_proj.weight"] = w(nkv * hd, qkv_in)
    sd[p + "self_attn.v_proj.weight"] = w(nkv * hd, qkv_in)
    sd[p + "self_attn.o_proj.weight"] = w(h, nh * hd)
    sd[p + "mlp.gate_proj.weight"] = w(inter, h)
    sd[p + "mlp.up_proj.weight"] = w(inter, h)
    sd[p + "mlp.down_proj.weight"] = w(h, inter)
    sd[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)

    rope_theta = (t.get("rope_parameters") or {}).get("rope_theta", t.get("rope_theta", 10000.0))
    cfg = {
        "architectures": ["LlamaForCausalLM"],  # vLLM maps this to Eagle/Eagle3LlamaForCausalLM
        "model_type": "llama", "bias": False,
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": 1,
        "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
        "hidden_act": "silu", "rms_norm_eps": t.get("rms_norm_eps", 1e-6), "rope_theta": rope_theta,
        "max_position_embeddings": t.get("max_position_embeddings", 2048), "vocab_size": vocab,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    if fmt == "eagle3":
        cfg["draft_vocab_size"] = sd["lm_head.weight"].shape[0]
        if aux_layer_ids:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
        if cfg["draft_vocab_size"] == vocab:
            del sd["d2t"], sd["t2d"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


if __name__ == "__main__":
    build_reference_checkpoint(sys.argv[1], sys.argv[2], sys.argv[3])
