"""Synthetic target / draft "models" over a tiny vocabulary and helpers shared by the tree tests.

A model is a table of logits for every context (the token sequence generated after a fixed prompt)
up to ``max_len`` tokens, so the exact sequential distribution of any prefix is known in closed form.
A context of length ``L`` with base-``V`` value ``n`` lives in table row ``offset[L] + n``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

from tests.tree.tree_views import StaticTreeBuilder, ancestor_mask_from_parents, root_to_leaf_paths
from vllm_easyspec.tree.building import (
    ChildDrawMode,
    DynamicTopKTreeBuilder,
    TokenTreeBatch,
)
from vllm_easyspec.tree.sampling import apply_sampling_constraints, tree_rejection_sample


class ContextTable:
    """Random logits for every context up to ``max_len`` tokens."""

    def __init__(self, vocab: int, max_len: int, seed: int, scale: float = 1.5,
                 base: ContextTable | None = None, mix: float = 0.0) -> None:
        self.vocab = vocab
        self.offsets = [sum(vocab**k for k in range(length)) for length in range(max_len + 2)]
        rows = self.offsets[max_len + 1]
        gen = torch.Generator().manual_seed(seed)
        fresh = torch.randn(rows, vocab, generator=gen) * scale
        # a draft correlated with the target: mix * target + (1 - mix) * fresh
        self.logits = fresh if base is None else mix * base.logits + (1 - mix) * fresh

    def row(self, length: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        offsets = torch.tensor(self.offsets, dtype=torch.long)
        return offsets[length] + value

    def lookup(self, length: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return self.logits[self.row(length, value)]


@dataclass
class Ctx:
    """Per-request context (length, base-V value) of some token position."""

    length: torch.Tensor
    value: torch.Tensor

    def child(self, token: torch.Tensor, vocab: int) -> Ctx:
        return Ctx(self.length + 1, self.value * vocab + token.clamp(min=0))


def node_contexts(parents: Sequence[int] | torch.Tensor, tokens: torch.Tensor, root: Ctx, vocab: int) -> Ctx:
    """Context after every node, as ``[B, N]`` tensors (tokens may be -1 for nodes not drawn yet;
    their context is junk and must not be used)."""
    batch, width = tokens.shape
    tokens_t = tokens.t().clamp(min=0)
    length = torch.empty(width, batch, dtype=torch.long)  # node-major: columns are contiguous rows
    value = torch.empty(width, batch, dtype=torch.long)
    for i in range(width):
        if isinstance(parents, torch.Tensor):
            p = parents[:, i]
            has = p >= 0
            col = p.clamp(min=0)[None, :]
            parent_len = torch.where(has, length.gather(0, col)[0], root.length)
            parent_val = torch.where(has, value.gather(0, col)[0], root.value)
        elif parents[i] >= 0:
            parent_len, parent_val = length[parents[i]], value[parents[i]]
        else:
            parent_len, parent_val = root.length, root.value
        torch.add(parent_len, 1, out=length[i])
        torch.add(parent_val * vocab, tokens_t[i], out=value[i])
    length, value = length.t(), value.t()
    return Ctx(length, value)


def build_tree(recipe: dict, draft: ContextTable, root: Ctx, gen: torch.Generator,
               draft_temperature: float = 1.0) -> TokenTreeBatch:
    """Drive a builder with the synthetic draft. ``recipe``: ``{"choices": [...], "mode": ...}`` for
    static trees or ``{"eagle": (top_k, depth, budget)}`` for EAGLE-2."""
    batch, vocab = root.length.shape[0], draft.vocab

    def logprobs(ctx: Ctx) -> torch.Tensor:
        return (draft.lookup(ctx.length, ctx.value) / draft_temperature).log_softmax(-1)

    if "eagle" in recipe:
        top_k, depth, budget = recipe["eagle"]
        builder = DynamicTopKTreeBuilder(logprobs(root), top_k=top_k, max_depth=depth, budget=budget)
        while not builder.done:
            ctxs = node_contexts(builder.candidate_parents, builder.candidate_tokens, root, vocab)
            frontier = Ctx(ctxs.length.gather(1, builder.frontier), ctxs.value.gather(1, builder.frontier))
            builder.expand(logprobs(frontier))
        return builder.build()
    builder = StaticTreeBuilder(recipe["choices"], batch, recipe["mode"], generator=gen)
    while not builder.done:
        ctxs = node_contexts(builder.template.parents, builder.partial_tokens, root, vocab)
        rows = [root if n < 0 else Ctx(ctxs.length[:, n], ctxs.value[:, n]) for n in builder.nodes_to_expand()]
        builder.expand(torch.stack([logprobs(c) for c in rows], 1))
    return builder.build()


def target_rows(tree: TokenTreeBatch, target: ContextTable, root: Ctx) -> torch.Tensor:
    """Target logits ``[B, N + 1, V]`` in query order for ``tree`` rooted at ``root``."""
    ctxs = node_contexts(tree.parents, tree.tokens, root, target.vocab)
    return torch.cat([target.lookup(root.length, root.value)[:, None], target.lookup(ctxs.length, ctxs.value)], 1)


def biased_per_path_verify(tree: TokenTreeBatch, logits: torch.Tensor, temperature: torch.Tensor,
                           top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                           gen: torch.Generator) -> torch.Tensor:
    """The flawed verifier of the public EasySpec code: every root-to-leaf path is verified
    independently by chain speculative sampling; the longest accepted path (first on ties) wins,
    followed by its recovered / bonus token. Returns only the first output token and whether
    more than one token was emitted (``[B]``, ``[B]`` bool)."""
    batch, width, vocab = logits.shape
    filt = apply_sampling_constraints(logits.reshape(-1, vocab), temperature.repeat_interleave(width),
                                      None if top_k is None else top_k.repeat_interleave(width),
                                      None if top_p is None else top_p.repeat_interleave(width))
    probs = filt.reshape(batch, width, vocab).softmax(-1)
    paths = root_to_leaf_paths(tree)
    arange = torch.arange(batch)
    best_len = torch.full((batch,), -1)
    best_first = torch.zeros(batch, dtype=torch.long)
    for leaf in range(paths.shape[1]):
        path = paths[:, leaf]
        present = path[:, 0] >= 0
        row = torch.zeros(batch, dtype=torch.long)
        alive = present.clone()
        length = torch.zeros(batch, dtype=torch.long)
        first = torch.zeros(batch, dtype=torch.long)
        for k in range(path.shape[1] + 1):
            node = path[:, k] if k < path.shape[1] else torch.full((batch,), -1)
            p = probs[arange, row]
            draw_next = alive & (node < 0)  # path exhausted: bonus from p at the leaf
            x = tree.tokens[arange, node.clamp(min=0)]
            if tree.draw_mode is ChildDrawMode.IID_FROM_DRAFT:
                q = tree.draft_probs[arange, row]
            else:
                q = torch.nn.functional.one_hot(x, vocab).float()
            ratio = p.gather(1, x[:, None])[:, 0] / q.gather(1, x[:, None])[:, 0].clamp_min(1e-30)
            u = torch.rand(batch, generator=gen)
            test = alive & (node >= 0)
            acc = test & (u < ratio)
            rej = test & ~acc
            resid = (p - q).clamp_min(0)
            resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p)
            sample_from = torch.where(rej[:, None], resid, p)
            race = torch.empty_like(sample_from).exponential_(generator=gen)
            drawn = (sample_from / race).argmax(-1)
            emit = draw_next | rej
            if k == 0:
                first = torch.where(emit, drawn, first)
            first = torch.where(acc & (length == 0), x, first)
            length = length + acc.long()
            alive = alive & acc
            row = torch.where(acc, node + 1, row)
        better = present & (length > best_len)
        best_len = torch.where(better, length, best_len)
        best_first = torch.where(better, first, best_first)
    return best_first, best_len > 0


@dataclass
class LosslessCase:
    name: str
    recipe: dict
    vocab: int = 5
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    draft_mix: float = 0.5
    draft_temperature: float = 1.0


def expected_two_token_distribution(case: LosslessCase, target: ContextTable) -> np.ndarray:
    """Exact ``P(x1, x2)`` of sequential sampling from the filtered target, ``[V, V]``."""
    vocab = case.vocab

    def dist(length: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        rows = target.lookup(length, value)
        n = rows.shape[0]
        filt = apply_sampling_constraints(
            rows, torch.full((n,), case.temperature),
            None if case.top_k is None else torch.full((n,), case.top_k),
            None if case.top_p is None else torch.full((n,), case.top_p))
        return filt.double().softmax(-1)

    p1 = dist(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))[0]
    p2 = dist(torch.ones(vocab, dtype=torch.long), torch.arange(vocab))
    return (p1[:, None] * p2).numpy()


def sample_first_two_tokens(case: LosslessCase, num_samples: int, seed: int, biased: bool = False
                            ) -> tuple[np.ndarray, ContextTable]:
    """Counts ``[V, V]`` of the first two generated tokens over ``num_samples`` independent runs.
    When a verify step emits a single token, a second step (new tree rooted at it) emits the next."""
    vocab = case.vocab
    target = ContextTable(vocab, 4, seed=1000 + seed)
    draft = ContextTable(vocab, 4, seed=2000 + seed, base=target, mix=case.draft_mix)
    gen = torch.Generator().manual_seed(seed)

    def step(root: Ctx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = root.length.shape[0]
        tree = build_tree(case.recipe, draft, root, gen, case.draft_temperature)
        logits = target_rows(tree, target, root)
        temperature = torch.full((n,), case.temperature)
        top_k = None if case.top_k is None else torch.full((n,), case.top_k)
        top_p = None if case.top_p is None else torch.full((n,), case.top_p)
        if biased:
            first, more = biased_per_path_verify(tree, logits, temperature, top_k, top_p, gen)
            return first, torch.zeros_like(first), more
        out = tree_rejection_sample(tree, logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                    generator=gen)
        tokens = out.output_token_ids.long()
        return tokens[:, 0], tokens[:, 1], out.num_accepted > 0

    root = Ctx(torch.zeros(num_samples, dtype=torch.long), torch.zeros(num_samples, dtype=torch.long))
    x1, x2, has_two = step(root)
    if biased:
        has_two = torch.zeros_like(has_two)  # the biased helper only reports x1; always take a 2nd step
    need = ~has_two
    if bool(need.any()):
        sub = Ctx(torch.ones(int(need.sum()), dtype=torch.long), x1[need])
        y1, _, _ = step(sub)
        x2 = x2.clone()
        x2[need] = y1
    counts = np.zeros((vocab, vocab), dtype=np.int64)
    np.add.at(counts, (x1.numpy(), x2.numpy()), 1)
    return counts, target


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float, float, int]:
    """Pearson chi-square of ``counts`` against ``probs`` over the cells with positive probability.
    Returns (statistic, p-value, total-variation distance, degrees of freedom). Raises if a
    zero-probability cell was observed (that alone disproves losslessness)."""
    counts = counts.ravel().astype(np.float64)
    probs = probs.ravel()
    impossible = probs <= 0
    if counts[impossible].sum() > 0:
        return float("inf"), 0.0, 0.5 * np.abs(counts / counts.sum() - probs).sum(), int((~impossible).sum()) - 1
    n = counts.sum()
    observed, expected = counts[~impossible], n * probs[~impossible]
    stat, pvalue = stats.chisquare(observed, expected)
    tv = 0.5 * np.abs(counts / n - probs).sum()
    return float(stat), float(pvalue), float(tv), len(observed) - 1


# ---------------------------------------------------------------- paged attention fixtures
def random_parents(num_queries: int, gen: torch.Generator, forest: bool = False) -> list[int]:
    """Request-local parents; query 0 is the root unless ``forest`` (several -1 roots, as in a
    drafter pass without the root token)."""
    parents = [-1]
    for j in range(1, num_queries):
        low = -1 if forest else 0
        parents.append(int(torch.randint(low, j, (1,), generator=gen)))
    return parents


def make_paged_batch(parents_per_request, prefix_lens, block_size, num_q_heads, num_kv_heads, head_dim,
                     dtype, seed, device="cpu"):
    """Random caches whose blocks are scattered over a shuffled pool; returns the kernel arguments."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(p + len(par)) // block_size) for p, par in zip(prefix_lens, parents_per_request)]
    pool = sum(needed) + 7
    order = torch.randperm(pool, generator=gen)
    max_blocks = max(needed) + 2
    block_table = torch.zeros(len(needed), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(needed):
        block_table[b, :n] = order[used: used + n].int()
        used += n
    key_cache = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(pool, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    lens = [len(p) for p in parents_per_request]
    cu = torch.tensor([0] + lens).cumsum(0).int()
    parents = torch.tensor([p for par in parents_per_request for p in par])
    mask = ancestor_mask_from_parents(parents, cu)
    query = torch.randn(int(cu[-1]), num_q_heads, head_dim, generator=gen).to(dtype)
    args = dict(query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table,
                prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32), cu_query_lens=cu, tree_mask=mask)
    return {k: v.to(device) for k, v in args.items()}


def spec_decode_metadata(drafts: list[list[int]], device):
    """vLLM's ``SpecDecodeMetadata`` of a batch whose requests have these drafts (``[]``: none), its rows laid out as
    vLLM's runner lays them out (``_calc_spec_decode_metadata``): each request's drafts' rows, then its bonus row."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    sampled = torch.tensor([len(d) + 1 for d in drafts])
    cu_sampled = sampled.cumsum(0)
    starts = cu_sampled - sampled
    target = torch.cat([starts[i] + torch.arange(len(d)) for i, d in enumerate(drafts)])
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor([token for d in drafts for token in d], dtype=torch.int32, device=device),
        num_draft_tokens=[len(d) for d in drafts],
        cu_num_draft_tokens=torch.tensor([len(d) for d in drafts], device=device).cumsum(0).int(),
        cu_num_sampled_tokens=cu_sampled.int().to(device),
        target_logits_indices=target.int().to(device),
        bonus_logits_indices=(cu_sampled - 1).int().to(device),
        logits_indices=torch.arange(int(cu_sampled[-1]), dtype=torch.int32, device=device),
    )
