"""The drafter's proposals are masked by a structured-output request's grammar (issue 62), without an engine: each
draft level's logits of a node allow exactly what a fresh xgrammar matcher allows after the request's output, the
bonus token and the node's path; a draft vocabulary that is a subset of the target's (EAGLE-3 ``d2t``) gets the
target mask at its ids; a chain step's positions are masked along the chain drawn so far; nodes the grammar forbids
are pruned at hand-over, i.i.d.-drawn sibling groups only whole and only where exact (a chi-square test, and its
biased case failing); a batch without structured output reads nothing; a grammar that cannot be compiled or an
output the matcher rejects leaves drafting unmasked."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch

from tests.tree.test_tree_grammar import REGEX, VOCAB, _mask_after
from tests.tree.test_tree_uniform import _step, _verify
from tests.tree.tree_testlib import chi_square
from vllm_easyspec.integration.draft_grammar import NO_GRAMMAR, DraftGrammars, GrammarStep, allowed_ids
from vllm_easyspec.integration.node_policy import CandidateTree
from vllm_easyspec.integration.tree_grammar import node_paths
from vllm_easyspec.integration.tree_step import PendingTree
from vllm_easyspec.tree.building import ChildDrawMode
from vllm_easyspec.tree.config import TreeConfig
from vllm_easyspec.tree.drafting import LevelwiseTreeDraft

PROMPT, OUTPUT, BONUS = [1, 2, 3], [41], 33  # after w41 w33 the grammar allows w15, w20 or w41
STATIC = TreeConfig(choices=[[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]])
DYNAMIC = TreeConfig(top_k=3, depth=4, budget=9)
# a draft vocabulary of 16 tokens (EAGLE-3 d2t): target ids, one (-1) without a target token
D2T = [15, 19, 20, 21, 22, 23, 33, 41, 5, 6, 7, 8, 9, 10, 11, -1]


def _grammars(tokenizer_dir, draft_ids=None) -> DraftGrammars:
    from transformers import AutoTokenizer
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    config = types.SimpleNamespace(
        structured_outputs_config=types.SimpleNamespace(disable_any_whitespace=False, reasoning_parser=None),
        model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type="llama")),
        speculative_config=None)
    grammars = DraftGrammars(config, lambda: draft_ids, rollback=16)
    grammars.backend = XgrammarBackend(config, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
                                       vocab_size=VOCAB)  # the engine's is built from its config on first use
    grammars.backend.num_speculative_tokens = 16
    return grammars


def _params(**structured):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    if not structured:
        return SamplingParams()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**structured))
    params.structured_outputs._backend = "xgrammar"  # as vLLM's input processor resolves it
    return params


def _batch(output: list[int], **structured) -> types.SimpleNamespace:
    """Row 0 plain, row 1 ("r") with ``structured`` outputs and ``output`` so far."""
    histories = [np.asarray(PROMPT + [7, 8]), np.asarray(PROMPT + output)]
    return types.SimpleNamespace(requests={"plain": types.SimpleNamespace(sampling_params=_params()),
                                           "r": types.SimpleNamespace(sampling_params=_params(**structured))},
                                 history=lambda row: histories[row], num_prompt_tokens=np.asarray([3, 3]))


def _ready_step(grammars: DraftGrammars, batch, branch: list[int] | None = None, bonus: int = BONUS):
    """The step once the request's grammar is compiled (the first step submits the compilation)."""
    arguments = (["plain", "r"], batch, {"r": branch or []}, lambda: [5, bonus])
    step = grammars.step(*arguments)
    if step is NO_GRAMMAR:
        grammars.matchers["r"].grammar.result(timeout=60)
        step = grammars.step(*arguments)
    return step


def _check_row(masked: torch.Tensor, raw: torch.Tensor, allowed: torch.Tensor) -> None:
    """``masked`` keeps ``raw`` where ``allowed`` ([V] bool), -inf elsewhere; unmasked where nothing is allowed."""
    if not allowed.any():
        assert torch.equal(masked, raw)
        return
    assert torch.equal(masked[allowed], raw[allowed]) and bool((masked[~allowed] == float("-inf")).all())


def _allowed_after(compiled, path: list[int], ids: list[int]) -> torch.Tensor:
    bits = _mask_after(compiled, path)
    return torch.tensor([token >= 0 and bool((int(bits[token // 32]) >> (token % 32)) & 1) for token in ids])


@pytest.mark.parametrize("config", [STATIC, DYNAMIC], ids=["static", "dynamic"])
@pytest.mark.parametrize("draft_vocab", ["target", "d2t"])
def test_each_nodes_draft_logits_are_masked_by_the_grammar_after_its_path(tiny_tokenizer_dir, config, draft_vocab):
    import xgrammar as xgr

    ids = list(range(VOCAB)) if draft_vocab == "target" else D2T
    grammars = _grammars(tiny_tokenizer_dir, None if draft_vocab == "target" else torch.tensor(D2T))
    step = _ready_step(grammars, _batch(OUTPUT, regex=REGEX))
    assert isinstance(step, GrammarStep) and step.rows == [1]
    compiled = grammars.backend.compiler.compile_regex(REGEX)
    generator = torch.Generator().manual_seed(0)
    raw = torch.randn(2, 1, len(ids), generator=generator)
    roots = step.mask(raw.clone())
    assert torch.equal(roots[0], raw[0])  # the plain request's row is untouched
    _check_row(roots[1, 0], raw[1, 0], _allowed_after(compiled, [*OUTPUT, BONUS], ids))
    draft = LevelwiseTreeDraft(config, roots[:, 0], [True, True])
    stash: list[list[int]] = []  # the structured row's path of each forwarded node, in stash order
    while not draft.done:
        tokens, columns = draft.frontier_tokens()[1].tolist(), draft.frontier_parent_columns()[1].tolist()
        paths = [(stash[column] if column >= 0 else []) + [ids[token]] for token, column in zip(tokens, columns)]
        raw = torch.randn(2, len(tokens), len(ids), generator=generator)
        masked = step.mask(raw.clone(), draft)
        assert torch.equal(masked[0], raw[0])
        for node, path in enumerate(paths):
            valid = xgr.GrammarMatcher(compiled)
            if all(valid.accept_token(token) for token in [*OUTPUT, BONUS, *path]) and not valid.is_terminated():
                _check_row(masked[1, node], raw[1, node], _allowed_after(compiled, [*OUTPUT, BONUS, *path], ids))
        stash += paths
        draft.expand(masked)
    trees = draft.build()
    tokens = [ids[token] for token in trees.tokens[1].tolist()]
    parents = trees.parents[1].tolist()
    candidates = [CandidateTree("r", tokens, parents, ChildDrawMode.WITHOUT_REPLACEMENT, row=1)]
    (pruned,), logprobs = step.prune(candidates, trees.logprobs)
    paths = node_paths(tokens, parents)
    valid = [node for node, path in enumerate(paths) if _accepts(compiled, [*OUTPUT, BONUS, *path])]
    # a static tree has more children than the grammar allows: some nodes are forbidden (a dynamic one may not)
    assert len(valid) < len(tokens) or config is DYNAMIC
    assert pruned.tokens == [tokens[node] for node in valid]
    assert node_paths(pruned.tokens, pruned.parents) == [paths[node] for node in valid]
    assert logprobs[1, : len(valid)].tolist() == trees.logprobs[1, valid].tolist()
    assert torch.equal(logprobs[0], trees.logprobs[0])
    after = xgr.allocate_token_bitmask(1, VOCAB)  # the request's matcher ends where it began: after its output
    step.requests["r"][1].fill_bitmask(after, 0)
    assert torch.equal(after[0], _mask_after(compiled, OUTPUT))


def _accepts(compiled, tokens: list[int]) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    return all(not matcher.is_terminated() and matcher.accept_token(token) for token in tokens)


def test_the_matcher_follows_the_output_and_prunes_a_lookup_path(tiny_tokenizer_dir):
    """The next step's matcher has accepted the bonus token and the accepted branch; a merged path is cut where
    the grammar forbids it."""
    grammars = _grammars(tiny_tokenizer_dir)
    _ready_step(grammars, _batch(OUTPUT, regex=REGEX))
    step = _ready_step(grammars, _batch(OUTPUT + [BONUS], regex=REGEX), branch=[20, 21], bonus=22)
    assert grammars.matchers["r"].consumed == 4
    path = CandidateTree("r", [33, 15, 33, 41], [-1, 0, 1, 2], ChildDrawMode.WITHOUT_REPLACEMENT,
                         from_lookup=(True,) * 4)
    (pruned,), _ = step.prune([path], None)
    assert pruned.tokens == [33, 15] and pruned.parents == [-1, 0] and pruned.from_lookup == (True, True)


def test_a_batch_without_structured_output_reads_nothing(tiny_tokenizer_dir):
    grammars = DraftGrammars(None, lambda: None, rollback=4)
    batch = types.SimpleNamespace(requests={"a": types.SimpleNamespace(sampling_params=_params())})
    unread = lambda: pytest.fail("a batch without structured output read the bonus tokens")  # noqa: E731
    assert grammars.step(["a"], batch, {}, unread) is NO_GRAMMAR
    assert NO_GRAMMAR.mask(logits := torch.zeros(1, 1, 4)) is logits and NO_GRAMMAR.keeps_nodes


@pytest.mark.parametrize("case", ["invalid grammar", "rejected output", "another backend"])
def test_a_grammar_the_worker_cannot_follow_leaves_drafting_unmasked(tiny_tokenizer_dir, case):
    grammars = _grammars(tiny_tokenizer_dir)
    structured = {"regex": "(w1[" if case == "invalid grammar" else REGEX}
    output = [60] if case == "rejected output" else OUTPUT
    batch = _batch(output, **structured)
    if case == "another backend":
        batch.requests["r"].sampling_params.structured_outputs._backend = "guidance"
    grammars.step(["plain", "r"], batch, {}, lambda: [5, BONUS])
    future = grammars.matchers["r"].grammar
    if hasattr(future, "exception"):
        future.exception(timeout=60)
    assert grammars.step(["plain", "r"], batch, {}, lambda: [5, BONUS]) is NO_GRAMMAR
    assert grammars.matchers["r"].grammar is None


def test_a_mask_that_allows_no_draft_token_leaves_the_row_unmasked():
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[1, 0] = 1 << 5  # target token 5
    ids = torch.tensor(D2T)
    allowed = allowed_ids(bitmask, ids)
    assert not allowed[0].any()  # a draft token without a target token is never allowed
    assert allowed[1].tolist() == [token == 5 for token in D2T]
    assert allowed_ids(torch.full((1, 1), -1, dtype=torch.int32), torch.tensor([0, 31, 32])).tolist() == \
        [[True, True, False]]  # an id beyond the mask's vocabulary is not a target token


class _ChainModel:
    """A draft model's ``compute_logits`` as vLLM's chain drafting calls it, one position at a time."""

    def __init__(self, vocab: int) -> None:
        self.generator, self.vocab, self.raw = torch.Generator().manual_seed(1), vocab, []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.raw.append(torch.randn(hidden.shape[0], self.vocab, generator=self.generator))
        return self.raw[-1].clone()


@pytest.mark.parametrize("draft_vocab", ["target", "draft ids"])
def test_a_chain_steps_positions_are_masked_along_the_chain_drawn_so_far(tiny_tokenizer_dir, draft_vocab):
    """vLLM's ``propose`` asks for one position's logits at a time; a structured request's row at position ``i`` is
    masked by the grammar after its output, the bonus token and the ``i`` tokens drawn before (target ids, whatever
    the logits' columns); the plain request's rows and a call over other rows are left alone."""
    ids = list(range(VOCAB)) if draft_vocab == "target" else D2T
    compiled = _grammars(tiny_tokenizer_dir).backend.compiler.compile_regex(REGEX)
    step = _ready_step(_grammars(tiny_tokenizer_dir), _batch(OUTPUT, regex=REGEX))
    masks = step.chain(None if draft_vocab == "target" else torch.tensor(D2T), rows=2)
    model = _ChainModel(len(ids))
    chain: list[int] = []
    for _ in range(3):
        with masks.masking(model):
            logits = model.compute_logits(torch.zeros(2, 8))
            assert torch.equal(model.compute_logits(torch.zeros(6, 8)), model.raw[-1])  # parallel drafting's rows
        assert torch.equal(logits[0], model.raw[-2][0])
        _check_row(logits[1], model.raw[-2][1], _allowed_after(compiled, [*OUTPUT, BONUS, *chain], ids))
        drawn = logits.argmax(-1)
        chain.append(ids[int(drawn[1])])
        masks.drafted(torch.tensor([ids[int(token)] for token in drawn]))
    assert _accepts(compiled, [*OUTPUT, BONUS, *chain[:2]]) and "compute_logits" not in vars(model)
    assert NO_GRAMMAR.chain(None, 2) is NO_GRAMMAR


IID = ChildDrawMode.IID_FROM_DRAFT


def test_drawn_trees_lose_only_sibling_groups_the_grammar_forbids_whole(tiny_tokenizer_dir):
    """Under the root (open after w41 w33): w15 and w20; under w15 the forbidden w60 and w61 (dropped with their
    child); under w20 w21 and the forbidden w60 (kept: not the whole group). The draft probabilities follow the kept
    nodes. A top-k tree, and a tree whose bonus token the grammar forbids (nothing open), are left alone."""
    step = _ready_step(_grammars(tiny_tokenizer_dir), _batch(OUTPUT, regex=REGEX))
    tokens, parents = [15, 20, 60, 61, 21, 60, 22, 33], [-1, -1, 0, 0, 1, 1, 4, 2]
    probs = torch.arange(9.0)[:, None].expand(9, VOCAB)  # row r: after node r - 1
    pending = {"r": PendingTree(tokens, parents, IID, 8, False, probs, features=list("abcdefgh"))}
    pruned = step.prune_drawn(pending)["r"]
    assert pruned.tokens == [15, 20, 21, 60, 22] and pruned.parents == [-1, -1, 1, 1, 2]
    assert pruned.draft_probs[:, 0].tolist() == [0, 1, 2, 5, 6, 7] and pruned.features == list("abefg")
    top_k = {"r": dataclasses.replace(pending["r"], draw_mode=ChildDrawMode.WITHOUT_REPLACEMENT)}
    assert step.prune_drawn(top_k)["r"] is top_k["r"]
    closed = step.requests["r"][:2] + (60,)
    step.requests["r"] = closed
    assert step.prune_drawn({"r": PendingTree([60, 61], [-1, -1], IID, 2, False, probs[:3])})["r"].tokens == [60, 61]
    assert NO_GRAMMAR.prune_drawn(pending) is pending


def _first_token_counts(step: GrammarStep, q: torch.Tensor, count: int, seed: int) -> np.ndarray:
    """First output tokens of ``count`` steps verifying two root children drawn i.i.d. from ``q`` (target ids),
    pruned by ``step``; the target: w15 or w20, each 1/2 (its logits masked by the grammar)."""
    draws = torch.multinomial(q.expand(count, -1), 2, replacement=True, generator=torch.Generator().manual_seed(seed))
    probs = torch.zeros(3, VOCAB)
    probs[0] = q
    grammar, bonus = step.requests["r"][1:]
    step = GrammarStep({f"r{i}": (i, grammar, bonus) for i in range(count)}, None, None, step.allocate)
    trees = list(step.prune_drawn({f"r{i}": PendingTree(row, [-1, -1], IID, 2, False, probs)
                                   for i, row in enumerate(draws.tolist())}).values())
    root = torch.full((VOCAB,), float("-inf"))
    root[[15, 20]] = 0.0
    logits = torch.cat([torch.cat([root[None], torch.zeros(len(tree.tokens), VOCAB)]) for tree in trees])
    torch.manual_seed(seed)
    verdict = _verify(_step(trees, [tree.draft_probs for tree in trees]), logits, temperature=1.0)
    return np.bincount(verdict.sampler_output.sampled_token_ids[:, 0].numpy(), minlength=VOCAB)


def test_dropping_a_drawn_group_keeps_the_targets_law_only_where_its_draft_allows_nothing(tiny_tokenizer_dir):
    """Two i.i.d. children drawn from a draft that puts no mass on w15 or w20 (drafted where the grammar allowed
    no draft token) are dropped and the first token follows the target (chi-square over 4,000 steps). Drawn from a
    draft with mass 0.3 on w15 (unmasked drafts), dropping the groups that came out forbidden breaks the law."""
    step = _ready_step(_grammars(tiny_tokenizer_dir), _batch(OUTPUT, regex=REGEX))
    law = np.zeros(VOCAB)
    law[[15, 20]] = 0.5
    nothing_allowed = torch.zeros(VOCAB)
    nothing_allowed[[60, 61]] = 0.5
    assert chi_square(_first_token_counts(step, nothing_allowed, 4000, seed=0), law)[1] > 1e-3
    unmasked = torch.zeros(VOCAB)
    unmasked[[15, 60, 61]] = torch.tensor([0.3, 0.35, 0.35])
    assert chi_square(_first_token_counts(step, unmasked, 4000, seed=0), law)[1] < 1e-6
