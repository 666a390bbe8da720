"""Structured output with token trees: each node's grammar mask from the grammar state along its own path
(docs/design.md, "Requests a tree cannot serve exactly").

vLLM keeps a request's matcher in the scheduler, which validates a chain of drafts and fills one bitmask row per
draft position after the request's root row (0.32 packs each request's rows back to back, 0.33 gives each a block of
``1 + num_speculative_tokens`` rows: ``compat.RELEASES``); the worker applies them to the request's logit rows in
order. For a tree, the worker hands each structured-output request's node parents over with its drafts
(:data:`~vllm_easyspec.integration.tree_step.DRAFT_PARENTS` on vLLM's ``DraftTokenIds``; under pipeline parallelism
every tree request's, kept on the request for the earlier stages: ``pipeline_trees``); ``update_draft_token_ids``
(seam) keeps the whole tree (in an open reasoning section, the nodes before the first that ends it), and
``grammar_bitmask`` (seam) fills vLLM's rows with the trees left out, then after each root row one row per node: the
matcher's mask after the node's path (:func:`walk_paths`), a full mask after the grammar's end, the root's row for a
forbidden node (its parent's row masks it) and in an open reasoning section (vLLM's row there).

Invariant: a request whose drafts come without parents is handled exactly as vLLM handles it.
"""

from __future__ import annotations

import functools

import numpy as np

from vllm_easyspec.integration.compat import plugin_logger, vllm_release
from vllm_easyspec.integration.tree_step import DRAFT_PARENTS

logger = plugin_logger(__name__)
REQUEST_PARENTS = "easyspec_draft_parents"  # on the scheduler's Request: the parents of its spec_token_ids


def install() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    if getattr(Scheduler.update_draft_token_ids, "_easyspec_patched", False):
        return
    # Replaces vllm.v1.core.sched.scheduler.Scheduler.update_draft_token_ids: vLLM's, except that a structured-output
    # request's tree keeps all its nodes (step 2 of the module docstring).
    Scheduler.update_draft_token_ids = _update_draft_token_ids(Scheduler.update_draft_token_ids)
    # Replaces vllm.v1.structured_output.StructuredOutputManager.grammar_bitmask: vLLM's rows, plus one per tree node
    # filled along the node's own path (step 3).
    StructuredOutputManager.grammar_bitmask = _grammar_bitmask(StructuredOutputManager.grammar_bitmask)


def _update_draft_token_ids(original):
    @functools.wraps(original)
    def update_draft_token_ids(self, draft_token_ids) -> None:
        trees: dict[str, list[int]] = getattr(draft_token_ids, DRAFT_PARENTS, None) or {}
        for req_id in draft_token_ids.req_ids:
            request = self.requests.get(req_id)
            if request is not None:
                setattr(request, REQUEST_PARENTS, None)
        if not trees:
            return original(self, draft_token_ids)
        plain = type(draft_token_ids)([], [])
        for req_id, tokens in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids, strict=True):
            request = self.requests.get(req_id)
            if req_id not in trees or request is None or not request.use_structured_output:
                plain.req_ids.append(req_id)
                plain.draft_token_ids.append(tokens)
                if req_id in trees and request is not None:  # under pipeline parallelism: for the earlier stages
                    setattr(request, REQUEST_PARENTS, list(trees[req_id]))
            elif request.is_finished():
                continue
            elif request.is_prefill_chunk:
                request.spec_token_ids = []  # a prefill chunk takes no drafts
            else:
                kept = _kept_nodes(self.structured_output_manager, request, list(tokens), list(trees[req_id]))
                request.spec_token_ids = list(tokens[:kept])
                setattr(request, REQUEST_PARENTS, list(trees[req_id][:kept]))
        original(self, plain)

    update_draft_token_ids._easyspec_patched = True
    return update_draft_token_ids


def _constrained_from_start(manager, request) -> bool:
    """The grammar constrains the request's next token (no reasoning section still open before it)."""
    bounds = manager._get_constraint_bounds(request, ())
    return bounds.constraint_start == 0 and bounds.grammar_start == 0


def _kept_nodes(manager, request, tokens: list[int], parents: list[int]) -> int:
    """How many of a tree's first nodes the request verifies: all where the grammar constrains its next token; in
    an open reasoning section those before the first node whose path ends the section (its row would need the
    grammar's mask), a prefix as the worker's tree is cut (every kept row unconstrained, as vLLM's in reasoning)."""
    if _constrained_from_start(manager, request):
        return len(tokens)
    for index, path in enumerate(node_paths(tokens, parents)):
        if manager._get_constraint_bounds(request, path).constraint_start <= len(path):
            return index
    return len(tokens)


def _grammar_bitmask(original):
    @functools.wraps(original)
    def grammar_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens):
        trees = {}
        for req_id in structured_output_request_ids:
            parents = getattr(requests[req_id], REQUEST_PARENTS, None)
            tokens = scheduled_spec_decode_tokens.get(req_id)
            if parents is not None and tokens:
                trees[req_id] = (list(tokens), parents[: len(tokens)])
        if not trees:
            return original(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)
        without_trees = {req_id: tokens for req_id, tokens in scheduled_spec_decode_tokens.items() if req_id not in trees}
        rows = original(self, requests, structured_output_request_ids, without_trees)
        stride = len(rows) // len(structured_output_request_ids) if vllm_release().strided_grammar_rows else 0
        parts, start = [], 0
        for req_id in structured_output_request_ids:  # strided: a block of rows each, its first 1 + drafts read
            count = stride or 1 + len(without_trees.get(req_id, ()))
            parts.append(rows[start : start + count].copy())
            start += count
            if req_id in trees:  # vLLM's one row for it, the root's; its nodes' rows after it
                nodes = _node_rows(self, requests[req_id], *trees[req_id], root=parts[-1][0])
                if stride:
                    parts[-1][1 : 1 + len(nodes)] = nodes
                else:
                    parts.append(nodes)
        return np.concatenate(parts)

    return grammar_bitmask


def _node_rows(manager, request, tokens: list[int], parents: list[int], root: np.ndarray) -> np.ndarray:
    """One bitmask row per node: the grammar's next-token mask after the node's path (module docstring, step 3)."""
    if not _constrained_from_start(manager, request):  # a reasoning section's tree (_kept_nodes): vLLM's row there
        return np.repeat(root[None], len(tokens), axis=0)
    grammar = request.structured_output_request.grammar
    bitmask = manager.backend.allocate_token_bitmask(len(tokens))  # every token allowed

    def fill(index: int, valid: bool) -> None:
        if not valid:
            bitmask[index] = bitmask.new_tensor(root)  # never reached: the node's parent row masks its token
        elif not grammar.is_terminated():  # after the grammar's end, as vLLM: no constraint (the request stops)
            grammar.fill_bitmask(bitmask, index)
    walk_paths(grammar, node_paths(tokens, parents), fill)
    return bitmask.numpy()


def node_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Each node's tokens from the root's child down to the node (parents come first)."""
    paths: list[list[int]] = []
    for token, parent in zip(tokens, parents, strict=True):
        paths.append([*(paths[parent] if parent >= 0 else []), token])
    return paths


def walk_paths(grammar, paths: list[list[int]], visit=lambda index, valid: None) -> list[bool]:
    """Advance vLLM's ``grammar`` along each path in turn (rolled back to the longest prefix it shares with the
    previous one) and call ``visit(index, valid)`` there, ``valid`` when the grammar accepts the whole path (a
    token after its end excluded); returns those flags. The grammar ends where it began."""
    advanced: list[int] = []
    flags = []
    for index, path in enumerate(paths):
        shared = 0
        while shared < min(len(advanced), len(path)) and advanced[shared] == path[shared]:
            shared += 1
        if len(advanced) > shared:
            grammar.rollback(len(advanced) - shared)
            del advanced[shared:]
        valid = True
        for token in path[shared:]:
            if grammar.is_terminated() or grammar.validate_tokens([token]) != [token]:
                valid = False
                break
            grammar.accept_tokens("", [token])
            advanced.append(token)
        visit(index, valid)
        flags.append(valid)
    if advanced:
        grammar.rollback(len(advanced))
    return flags
