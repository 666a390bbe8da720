"""EAGLE draft heads in plain torch, computing exactly what vLLM 0.32 computes.

Two formats:

* ``eagle`` (EAGLE-1/2): ``fc(cat(embed(tok), h)) -> one Llama decoder layer
  without input_layernorm``; output = mlp_out + residual (no final norm); logits
  come from the *target's* lm_head.  ``h`` is the target's final (post-norm)
  hidden state at step 1 and the head's own output at later steps.
  Mirrors ``vllm/model_executor/models/llama_eagle.py``.
* ``eagle3`` (EAGLE-3): ``fc`` fuses three target layers (3h -> h) at step 1;
  the midlayer's attention takes ``cat(input_layernorm(embed), hidden_norm(h))``
  (2h wide); output ``norm(mlp_out + residual)`` goes through the head's own
  lm_head over a reduced draft vocabulary; the pre-norm residual is the hidden
  state for the next step.  Mirrors ``llama_eagle3.py``.

Training-time test: ``forward_steps`` unrolls ``k`` draft steps for every anchor
position in parallel.  At step ``s`` the query for anchor ``p`` sits at position
``p+s-1`` and attends to the step-1 keys at positions ``<= p`` (which vLLM fills
from the target's features) plus the keys its own chain wrote at steps
``2..s`` -- the same KV layout vLLM's chain drafter sees.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FORMATS = ("eagle", "eagle3")
SUPPORTED_TARGET_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM")


@dataclass
class HeadConfig:
    format: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # target vocabulary
    max_position_embeddings: int
    target_num_layers: int
    draft_vocab_size: int | None = None  # eagle3 only
    aux_layer_ids: list[int] = field(default_factory=list)  # eagle3 only
    hidden_act: str = "silu"

    def to_dict(self) -> dict:
        return asdict(self)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 layers (2, n // 2, n - 3) -- id i is the residual stream
    entering layer i -- or, for targets too shallow for that, (1, n // 2, n - 1)."""
    n = num_layers
    for ids in ([2, n // 2, n - 3], [1, max(2, n // 2), n - 1]):
        if ids[0] < ids[1] < ids[2]:
            return ids
    raise ValueError(f"a {n}-layer target is too shallow for EAGLE-3's three feature layers")


def head_config_from_target(target_cfg: dict, fmt: str, draft_vocab_size: int | None = None,
                            aux_layer_ids: list[int] | None = None,
                            intermediate_size: int | None = None) -> HeadConfig:
    """Build the head's config from the target's HF ``config.json`` dict."""
    from .errors import UnsupportedTargetError

    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    archs = target_cfg.get("architectures") or []
    if not any(a in SUPPORTED_TARGET_ARCHS for a in archs):
        raise UnsupportedTargetError(
            f"target architecture {archs} is not supported; the EAGLE trainer supports "
            f"{', '.join(SUPPORTED_TARGET_ARCHS)}")
    if target_cfg.get("use_sliding_window"):
        raise UnsupportedTargetError("targets with sliding-window attention are not supported")
    h = int(target_cfg["hidden_size"])
    nh = int(target_cfg["num_attention_heads"])
    head_dim = int(target_cfg.get("head_dim") or h // nh)
    rope = target_cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") not in ("default",):
        raise UnsupportedTargetError(f"rope type {rope.get('rope_type')!r} is not supported")
    theta = float(rope.get("rope_theta", target_cfg.get("rope_theta", 10000.0)))
    if target_cfg.get("rope_scaling"):
        raise UnsupportedTargetError("rope scaling is not supported")
    n_layers = int(target_cfg["num_hidden_layers"])
    vocab = int(target_cfg["vocab_size"])
    if fmt == "eagle3":
        aux = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(n_layers)
        # vLLM collects aux hidden states in layer order, once per layer id
        if len(aux) != 3 or any(not (0 <= a <= n_layers) for a in aux) or not (aux[0] < aux[1] < aux[2]):
            raise ValueError(f"aux layer ids {aux} invalid for a {n_layers}-layer target "
                             "(need three strictly increasing ids in 0..num_layers)")
        dv = int(draft_vocab_size or min(vocab, 32000))
    else:
        aux, dv = [], None
    return HeadConfig(
        format=fmt, hidden_size=h, intermediate_size=int(intermediate_size or target_cfg["intermediate_size"]),
        num_attention_heads=nh, num_key_value_heads=int(target_cfg.get("num_key_value_heads", nh)),
        head_dim=head_dim, rms_norm_eps=float(target_cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, vocab_size=vocab,
        max_position_embeddings=int(target_cfg.get("max_position_embeddings", 4096)),
        target_num_layers=n_layers, draft_vocab_size=dv, aux_layer_ids=aux,
        hidden_act=target_cfg.get("hidden_act", "silu"),
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(dt)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding. x: [B, n, T, d]; pos: [T] (long)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    ang = pos.float()[:, None] * inv[None, :]  # [T, d/2]
    cos, sin = ang.cos(), ang.sin()
    cos = torch.cat([cos, cos], -1).to(x.dtype)
    sin = torch.cat([sin, sin], -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rot = torch.cat([-x2, x1], -1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, cfg: HeadConfig, in_dim: int):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(in_dim, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_dim, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, pos: torch.Tensor):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        return _rope(q, pos, self.theta), _rope(k, pos, self.theta), v

    def attend(self, q, k0, v0, diag_k: list, diag_v: list) -> torch.Tensor:
        """q: [B,nh,T,d]; k0/v0: step-1 keys (causal over anchors); diag_*: later steps'
        keys, one per anchor ([B,nkv,T,d] each)."""
        B, nh, T, d = q.shape
        rep = nh // self.nkv
        k0 = k0.repeat_interleave(rep, 1)
        v0 = v0.repeat_interleave(rep, 1)
        scale = 1.0 / math.sqrt(d)
        s0 = torch.matmul(q, k0.transpose(-1, -2)) * scale  # [B,nh,T,T]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        s0 = s0.masked_fill(~causal, float("-inf"))
        extra_s, extra_v = [], []
        for dk, dv in zip(diag_k, diag_v):
            dk = dk.repeat_interleave(rep, 1)
            extra_s.append((q * dk).sum(-1, keepdim=True) * scale)
            extra_v.append(dv.repeat_interleave(rep, 1))
        s = torch.cat([s0] + extra_s, -1) if extra_s else s0
        p = torch.softmax(s.float(), -1).to(q.dtype)
        out = torch.matmul(p[..., :T], v0)
        for i, dv in enumerate(extra_v):
            out = out + p[..., T + i: T + i + 1] * dv
        B_, _, _, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B_, T, nh * d))


class MLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        h = cfg.hidden_size
        self.is3 = cfg.format == "eagle3"
        self.self_attn = Attention(cfg, 2 * h if self.is3 else h)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        if self.is3:
            self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)


class EagleHead(nn.Module):
    """Trainable part of an EAGLE head.  The target's ``embed_tokens`` (and, for
    ``eagle``, its ``lm_head``) are passed in, frozen, and never saved."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.is3 = cfg.format == "eagle3"
        self.fc = nn.Linear((3 if self.is3 else 2) * h, h, bias=False)
        self.layer = DecoderLayer(cfg)
        if self.is3:
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    def set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        """``draft_ids``: sorted target ids forming the draft vocabulary."""
        assert self.is3 and draft_ids.numel() == self.cfg.draft_vocab_size
        draft_ids = draft_ids.to(device=self.d2t.device, dtype=torch.long)
        self.d2t.copy_(draft_ids - torch.arange(draft_ids.numel(), device=draft_ids.device))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    def draft_ids(self) -> torch.Tensor:
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    # -- one draft step over all anchors -------------------------------------
    def step(self, emb, hidden, pos, kv0, diag_k, diag_v, first: bool):
        """emb/hidden: [B,T,h] (hidden already fused by fc for eagle3 step 1 or the
        previous step's output).  Returns (logit_input, next_hidden, k, v)."""
        L = self.layer
        if self.is3:
            residual = hidden
            x = torch.cat([L.input_layernorm(emb), L.hidden_norm(hidden)], -1)
        else:
            x = self.fc(torch.cat([emb, hidden], -1))
            residual = x
        q, k, v = L.self_attn.qkv(x, pos)
        if first:
            kv0 = (k, v)
            a = L.self_attn.attend(q, k, v, [], [])
        else:
            a = L.self_attn.attend(q, kv0[0], kv0[1], diag_k + [k], diag_v + [v])
        residual = a + residual
        m = L.mlp(L.post_attention_layernorm(residual))
        out = m + residual
        if self.is3:
            return self.norm(out), out, kv0, k, v
        return out, out, kv0, k, v

    def forward_steps(self, embed: nn.Embedding, input_ids: torch.Tensor,
                      target_hidden: torch.Tensor, steps: int,
                      noise: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Unroll ``steps`` draft steps (training-time test).

        input_ids: [B,T] the sequence tokens t_0..t_{T-1}.  target_hidden: [B,T,h]
        (eagle: final hidden) or [B,T,3h] (eagle3: the three aux layers).  Anchor p
        consumes (feature_p, t_{p+1}) at step 1 and t_{p+s} at step s.  Returns,
        per step s, the pre-logit hidden [B, T-s, h] for anchors p = 0..T-1-s.
        """
        B, T = input_ids.shape
        if noise is not None:
            target_hidden = target_hidden + noise
        hidden = self.fc(target_hidden) if self.is3 else target_hidden
        kv0 = None
        diag_k, diag_v, outs = [], [], []
        for s in range(1, steps + 1):
            n = T - s  # anchors with a known input token t_{p+s}
            if n <= 0:
                break
            emb = embed(input_ids[:, s:s + n])
            pos = torch.arange(n, device=input_ids.device) + (s - 1)
            hid = hidden[:, :n]
            if kv0 is not None:
                kv0 = (kv0[0][:, :, :n], kv0[1][:, :, :n])
            logit_in, hidden, kv0_new, k, v = self.step(
                emb, hid, pos, kv0, [d[:, :, :n] for d in diag_k],
                [d[:, :, :n] for d in diag_v], first=(s == 1))
            if s == 1:
                kv0 = kv0_new
            diag_k = [d[:, :, :n] for d in diag_k] + [k]
            diag_v = [d[:, :, :n] for d in diag_v] + [v]
            outs.append(logit_in)
        return outs

    def logits(self, logit_in: torch.Tensor, target_lm_head: torch.Tensor | None) -> torch.Tensor:
        """Draft-vocab logits (eagle3) or full-vocab logits via the target's lm_head."""
        if self.is3:
            return self.lm_head(logit_in)
        return F.linear(logit_in, target_lm_head)
