"""The drafter's proposals are masked by a structured-output request's grammar (issue 62), without an engine: each
draft level's logits of a node allow exactly what a fresh xgrammar matcher allows after the request's output, the
bonus token and the node's path; a draft vocabulary that is a subset of the target's (EAGLE-3 ``d2t``) gets the
target mask at its ids; nodes the grammar forbids are pruned at hand-over; a batch without structured output reads
nothing; a grammar that cannot be compiled or an output the matcher rejects leaves drafting unmasked."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from tests.tree.test_tree_grammar import REGEX, VOCAB, _mask_after
from vllm_easyspec.integration.draft_grammar import NO_GRAMMAR, DraftGrammars, GrammarStep, allowed_ids
from vllm_easyspec.integration.node_policy import CandidateTree
from vllm_easyspec.integration.tree_grammar import node_paths
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
    return torch.tensor([token >= 0 and bool((int(bits[token // 32]) >> (token % 32)) & 1) or token < 0
                         for token in ids])


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
    assert len(valid) < len(tokens)  # more children than the grammar allows: some nodes are forbidden
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
    assert allowed[0].tolist() == [token < 0 for token in D2T]
    assert allowed[1].tolist() == [token in (5, -1) for token in D2T]
    assert allowed_ids(torch.full((1, 1), -1, dtype=torch.int32), torch.tensor([0, 31, 32])).tolist() == \
        [[True, True, False]]  # an id beyond the mask's vocabulary is not a target token
