"""Each tree node's grammar mask is the grammar's mask after the node's own path (issue 62), without an engine: the
scheduler-side rows of :mod:`vllm_easyspec.integration.tree_grammar` against a fresh xgrammar matcher advanced along
each path, with vLLM's own ``XgrammarGrammar`` over the tiny tokenizer."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

VOCAB = 64
REGEX = "((w15w19|w15w23|w20w21w22|w41)w33)+"
# root children w15, w20 and w60 (which the grammar forbids); under w15: w19, w23 and w33 (forbidden there); under
# w20: w21 (then w22, then w33); under w15 w19: w33; and a child of the forbidden w60
TOKENS = [15, 20, 60, 19, 23, 33, 21, 33, 22, 33, 41]
PARENTS = [-1, -1, -1, 0, 0, 0, 1, 3, 6, 8, 2]
FORBIDDEN = {2, 5, 10}  # w60, w15 w33, and everything under w60


def _grammar(tokenizer_dir, max_rollback: int = 16):
    import xgrammar as xgr
    from transformers import AutoTokenizer
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tokenizer_dir), vocab_size=VOCAB)
    compiled = xgr.GrammarCompiler(info).compile_regex(REGEX)
    return XgrammarGrammar(vocab_size=VOCAB, matcher=xgr.GrammarMatcher(compiled, max_rollback_tokens=max_rollback),
                           ctx=compiled), compiled


def _mask_after(compiled, tokens: list[int]) -> torch.Tensor:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    for token in tokens:
        assert matcher.accept_token(token)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0]


def _path(index: int) -> list[int]:
    path = []
    while index >= 0:
        path.insert(0, TOKENS[index])
        index = PARENTS[index]
    return path


def _manager(reasoning_ends_at: int | None) -> types.SimpleNamespace:
    """vLLM's StructuredOutputManager as the seams read it: constrained from the start (None), or in a reasoning
    section that token ``reasoning_ends_at`` ends (vLLM's bounds: constrained from just after it)."""
    import xgrammar as xgr
    from vllm.v1.structured_output import ConstraintBounds

    def bounds(request, tokens) -> ConstraintBounds:
        if reasoning_ends_at is None:
            return ConstraintBounds(0, 0)
        end = tokens.index(reasoning_ends_at) + 1 if reasoning_ends_at in tokens else len(tokens) + 1
        return ConstraintBounds(end, end)

    return types.SimpleNamespace(_get_constraint_bounds=bounds, backend=types.SimpleNamespace(
        allocate_token_bitmask=lambda rows: xgr.allocate_token_bitmask(rows, VOCAB)))


def test_a_reasoning_section_keeps_the_nodes_before_its_end_unconstrained(tiny_tokenizer_dir):
    from vllm_easyspec.integration.tree_grammar import _kept_nodes, _node_rows

    grammar, _ = _grammar(tiny_tokenizer_dir)
    request = types.SimpleNamespace(request_id="r", structured_output_request=types.SimpleNamespace(grammar=grammar))
    assert _kept_nodes(_manager(None), request, TOKENS, PARENTS) == len(TOKENS)
    assert _kept_nodes(_manager(22), request, TOKENS, PARENTS) == TOKENS.index(22)  # node 8 ends the section
    assert _kept_nodes(_manager(15), request, TOKENS, PARENTS) == 0
    root = torch.full((2,), -1, dtype=torch.int32).numpy()
    root[0] &= ~(1 << 5)  # vLLM 0.33 masks implicit reasoning ends in a reasoning row; 0.32 masks nothing there
    rows = _node_rows(_manager(22), request, TOKENS[:8], PARENTS[:8], root=root)
    assert rows.shape == (8, 2) and bool((rows == root).all())  # each node's row is vLLM's reasoning row


def test_each_nodes_row_is_the_grammars_mask_after_its_path_and_the_matcher_ends_where_it_began(tiny_tokenizer_dir):
    import xgrammar as xgr

    from vllm_easyspec.integration.tree_grammar import _node_rows

    grammar, compiled = _grammar(tiny_tokenizer_dir)
    grammar.accept_tokens("r", [41, 33])  # the request's output so far
    manager = _manager(reasoning_ends_at=None)
    request = types.SimpleNamespace(request_id="r", structured_output_request=types.SimpleNamespace(grammar=grammar))
    root = _mask_after(compiled, [41, 33]).numpy()
    rows = torch.from_numpy(_node_rows(manager, request, TOKENS, PARENTS, root))
    for node in range(len(TOKENS)):
        if node in FORBIDDEN:
            assert torch.equal(rows[node], torch.from_numpy(root)), node
        else:
            assert torch.equal(rows[node], _mask_after(compiled, [41, 33, *_path(node)])), node
    assert not torch.equal(rows[0], rows[1])  # w15 and w20 allow different next tokens
    after = xgr.allocate_token_bitmask(1, VOCAB)
    grammar.fill_bitmask(after, 0)
    assert torch.equal(after[0], torch.from_numpy(root)) and not grammar.is_terminated()


def _vllm_rows(request_ids: list[str], drafts: dict[str, list[int]], strided: int) -> np.ndarray:
    """vLLM's grammar_bitmask output for chains: each request's root row ``r * 100``, then one row per draft
    ``r * 100 + 1 + i``; back to back (0.32), or in a block of ``strided`` rows each, the rest stale (0.33)."""
    rows = []
    for index, req_id in enumerate(request_ids):
        block = [index * 100 + i for i in range(1 + len(drafts.get(req_id, ())))]
        rows += block + [-7] * (strided - len(block)) if strided else block
    return np.repeat(np.asarray(rows, dtype=np.int32)[:, None], 2, axis=1)


def _worker_rows(bitmask: np.ndarray, request_ids: list[str], drafts: dict[str, list[int]], strided: bool) -> dict:
    """Each request's rows as vLLM's worker reads them (structured_output.utils.apply_grammar_bitmask): 0.32 walks
    the rows back to back, 0.33 infers a block of ``len(bitmask) // requests`` rows per request."""
    stride = len(bitmask) // len(request_ids) if strided else 0
    out, start = {}, 0
    for req_id in request_ids:
        count = 1 + len(drafts.get(req_id, ()))
        out[req_id] = bitmask[start : start + count, 0].tolist()
        start += stride or count
    return out


@pytest.mark.parametrize("release", ["0.32.0", "0.33.0"])
def test_tree_rows_land_where_each_releases_worker_reads_them(monkeypatch, release):
    """A tree request's rows (root, then one per node) are where the worker of that vLLM release reads them,
    among chain requests and requests without drafts (issue 69: 0.33 gives each request a fixed block)."""
    from vllm_easyspec.integration import tree_grammar
    from vllm_easyspec.integration.compat import RELEASES

    strided = RELEASES[release].strided_grammar_rows
    stride = 1 + 5 if strided else 0  # num_speculative_tokens 5
    monkeypatch.setattr(tree_grammar, "vllm_release", lambda: RELEASES[release])
    monkeypatch.setattr(tree_grammar, "_node_rows", lambda manager, request, tokens, parents, root:
                        root[None] + 1 + np.arange(len(tokens), dtype=np.int32)[:, None] * 10)  # node j: root + 1 + 10 j
    request_ids = ["chain", "tree", "none", "tree2"]
    drafts = {"chain": [1, 2], "tree": [3, 4, 5, 6, 7], "tree2": [8]}
    requests = {req_id: types.SimpleNamespace() for req_id in request_ids}
    setattr(requests["tree"], tree_grammar.REQUEST_PARENTS, [-1, 0, 0, 1, 1])
    setattr(requests["tree2"], tree_grammar.REQUEST_PARENTS, [-1])

    def original(manager, requests, structured_output_request_ids, scheduled_spec_decode_tokens):
        return _vllm_rows(structured_output_request_ids, scheduled_spec_decode_tokens, stride)

    bitmask = tree_grammar._grammar_bitmask(original)(None, requests, request_ids, drafts)
    assert len(bitmask) == (len(request_ids) * stride if strided else 4 + 2 + 5 + 1)
    assert _worker_rows(bitmask, request_ids, drafts, strided) == {
        "chain": [0, 1, 2], "tree": [100, 101, 111, 121, 131, 141], "none": [200], "tree2": [300, 301]}
