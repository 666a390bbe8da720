"""Offline replay of vLLM's greedy chain speculation with an :class:`EagleHead`.

Given the target's greedy continuation of a prompt, every verify round starts at
an anchor ``c`` (the last position whose target feature exists); the head drafts
k tokens from (features <= c, token c+1) and vLLM accepts the longest prefix equal
to the target's tokens; the next anchor is ``c + accepted + 1``.  Because greedy
acceptance only continues while drafts equal the target's own tokens, the
teacher-forced unroll of ``forward_steps`` gives exactly the drafts vLLM makes.
Used by the tests to check that vLLM runs our heads the way we train them.
"""

from __future__ import annotations

import torch

from .features import load_target_embed_and_head
from .model import EagleHead


@torch.no_grad()
def replay_acceptance(head: EagleHead, target: str, prompt: list[int], output: list[int], k: int,
                      dtype: torch.dtype = torch.float32, model: torch.nn.Module | None = None) -> dict:
    """``model``: the target already loaded from ``target`` (loaded here when None)."""
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval()
    seq = torch.tensor([prompt + output])
    o = model.model(input_ids=seq, output_hidden_states=head.is3)
    if head.is3:
        feats = torch.cat([o.hidden_states[a] for a in head.cfg.aux_layer_ids], -1).float()
    else:
        feats = o.last_hidden_state.float()
    embed_w, lm_w = load_target_embed_and_head(target)
    embed = torch.nn.Embedding.from_pretrained(embed_w, freeze=True)
    head = head.float().eval()
    outs = head.forward_steps(embed, seq, feats, k)
    preds = []
    for out in outs:
        lg = head.logits(out, lm_w)
        p = lg.argmax(-1)[0]
        if head.is3:
            p = head.draft_ids()[p]
        preds.append(p)
    toks = seq[0]
    T = toks.numel()
    c = len(prompt) - 1
    per_pos = [0] * k
    rounds = 0
    while True:
        # target emits t_{c+1}; drafts for c+2..c+1+k; stop once the output is exhausted
        if c + 2 > T - 1:
            break
        rounds += 1
        acc = 0
        for s in range(1, k + 1):
            q = c + s + 1
            if q > T - 1 or c >= preds[s - 1].numel() or int(preds[s - 1][c]) != int(toks[q]):
                break
            acc += 1
            per_pos[s - 1] += 1
        c = c + acc + 1
    return {"rounds": rounds, "accepted_per_pos": per_pos, "accepted": sum(per_pos)}
