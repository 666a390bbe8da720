"""Draft proposals masked by structured-output grammars (docs/design.md, "Requests a tree cannot serve exactly").

The worker's own matchers (vLLM's ``XgrammarBackend``, compiled in a background thread) mask each draft level's
logits by the grammar after the request's output, the bonus token and the node's path (a chain step's positions
too: :class:`ChainMasks`), and prune forbidden nodes at hand-over. Masks change which nodes are drafted, never what
verification accepts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from vllm_easyspec.integration.compat import plugin_logger
from vllm_easyspec.integration.tree_grammar import node_paths, walk_paths
from vllm_easyspec.integration.tree_step import PendingTree, keeping_nodes
from vllm_easyspec.tree.building import ChildDrawMode

logger = plugin_logger(__name__)


class _NoGrammar:
    """No grammar masks or prunes this step's drafts (no structured request is ready in its batch)."""

    keeps_nodes = True

    def mask(self, logits: torch.Tensor, draft=None) -> torch.Tensor: return logits
    def prune(self, candidates: list, logprobs: torch.Tensor | None) -> tuple[list, torch.Tensor | None]:
        return candidates, logprobs
    def prune_drawn(self, pending: dict) -> dict: return pending
    def chain(self, ids: torch.Tensor | None, rows: int) -> _NoGrammar: return self
    def masking(self, model) -> contextlib.nullcontext: return contextlib.nullcontext()
    def drafted(self, tokens: torch.Tensor) -> None: pass


NO_GRAMMAR = _NoGrammar()


@dataclasses.dataclass
class _Matcher:
    grammar: Any  # a Future of vLLM's StructuredOutputGrammar, the grammar, or None: drafted unmasked
    consumed: int = 0  # output tokens the grammar has accepted


class DraftGrammars:
    """The worker's grammar matchers; ``draft_ids()``: each draft logit column's target id on the device (-1:
    none), or None for the target's vocabulary; ``rollback``: the longest path a matcher walks and rolls back."""

    def __init__(self, vllm_config, draft_ids: Callable[[], torch.Tensor | None], rollback: int,
                 masks_drafts: bool = True) -> None:
        """``masks_drafts`` False: drafts bridged by text, whose logits the target's grammar cannot mask; their
        trees are pruned only."""
        self.vllm_config, self.draft_ids, self.rollback = vllm_config, draft_ids, rollback
        self.masks_drafts = masks_drafts
        self.matchers: dict[str, _Matcher] = {}
        self.prompt_ends_reasoning: dict[str, bool] = {}  # with a reasoning parser: the prompt closes the section
        self.compiled: set[tuple] = set()  # grammar keys compiled once: the compiler's cache has them
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="easyspec-grammar")

    @functools.cached_property
    def backend(self):
        """vLLM's xgrammar backend for the target's tokenizer, built on first use (in the compiling thread)."""
        from vllm.tokenizers import cached_tokenizer_from_config
        from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

        model = self.vllm_config.model_config
        backend = XgrammarBackend(self.vllm_config, tokenizer=cached_tokenizer_from_config(model_config=model),
                                  vocab_size=model.get_vocab_size())
        backend.num_speculative_tokens = self.rollback  # the matchers' rollback limit
        return backend

    @functools.cached_property
    def reasoner(self):
        """vLLM's reasoning parser, built as the scheduler builds it (without a request's template kwargs), or
        None: the grammar constrains the output from its first token."""
        config = self.vllm_config.structured_outputs_config
        if not config.reasoning_parser or getattr(config, "enable_in_reasoning", False):
            return None
        from vllm.reasoning import ReasoningParserManager
        from vllm.tokenizers import cached_tokenizer_from_config

        if config.reasoning_parser_plugin:
            ReasoningParserManager.import_reasoning_parser(config.reasoning_parser_plugin)
        parser = ReasoningParserManager.get_reasoning_parser(config.reasoning_parser)
        return parser(tokenizer=cached_tokenizer_from_config(model_config=self.vllm_config.model_config))

    @functools.cached_property
    def ids(self) -> tuple[torch.Tensor | None, list[int] | None]:
        """Each draft logit column's target id on the device and on the host (read once); None: the same ids."""
        ids = self.draft_ids()
        return ids, None if ids is None else ids.tolist()

    def step(self, req_ids: list[str], batch, last_branch: dict[str, list[int]],
             bonus_tokens: Callable[[], list[int]]):
        """The step's masks: a :class:`GrammarStep` over the structured requests whose matcher is ready;
        ``bonus_tokens()`` reads the step's bonus tokens to the host (only for a batch with such a request)."""
        for gone in {*self.matchers, *self.prompt_ends_reasoning} - set(batch.requests):
            self.matchers.pop(gone, None)
            self.prompt_ends_reasoning.pop(gone, None)
        rows = [(row, req_id, params) for row, req_id in enumerate(req_ids)
                if (params := getattr(batch.requests.get(req_id), "sampling_params", None)) is not None
                and params.structured_outputs is not None]
        if not rows:
            return NO_GRAMMAR
        bonus = bonus_tokens()
        ready = {}
        for row, req_id, params in rows:
            prompt, history = int(batch.num_prompt_tokens[row]), batch.history(row)
            output = [*history[prompt:].tolist(), *last_branch.get(req_id, [])]
            constrained = self._constrained(req_id, history[:prompt], output)
            grammar = None if constrained is None else self._advanced(req_id, params, constrained)
            if grammar is not None:
                ready[req_id] = (row, grammar, bonus[row])
        return GrammarStep(ready, *self.ids, self.backend.allocate_token_bitmask, self.masks_drafts) if ready \
            else NO_GRAMMAR

    def _constrained(self, req_id: str, prompt, output: list[int]) -> list[int] | None:
        """The output tokens the grammar constrains: all, or (a reasoning parser) those after the reasoning
        section's end, None while it is open (drafted unmasked; the scheduler cuts nodes at its end)."""
        reasoner = self.reasoner
        if reasoner is None:
            return output
        if req_id not in self.prompt_ends_reasoning:
            self.prompt_ends_reasoning[req_id] = reasoner.is_reasoning_end(prompt.tolist())
        if self.prompt_ends_reasoning[req_id]:
            return output
        return list(reasoner.extract_content_ids(output)) if reasoner.is_reasoning_end(output) else None

    def _advanced(self, req_id: str, params, output: list[int]):
        """The request's grammar after ``output``, or None (not compiled yet, or drafted unmasked for good)."""
        matcher = self.matchers.get(req_id)
        if matcher is None:
            matcher = self.matchers[req_id] = _Matcher(self._compile(params))
        if isinstance(matcher.grammar, Future):
            if not matcher.grammar.done():
                return None
            try:
                matcher.grammar = matcher.grammar.result()
            except Exception as error:  # an invalid grammar, a backend that cannot be built: unmasked
                logger.info("easyspec.tree: request %s's drafts are not masked by its grammar (%s)", req_id, error)
                matcher.grammar = None
        if matcher.grammar is not None and len(output) < matcher.consumed:
            matcher.grammar.reset()
            matcher.consumed = 0
        if matcher.grammar is not None and not matcher.grammar.accept_tokens(req_id, output[matcher.consumed:]):
            matcher.grammar = None
        matcher.consumed = len(output)
        return matcher.grammar

    def _compile(self, params):
        """A Future of the request's grammar, or the grammar itself where its key compiled before."""
        from vllm.v1.structured_output.request import get_structured_output_key

        key = get_structured_output_key(params.structured_outputs)
        compile_now = functools.partial(self._compile_now, params.structured_outputs._backend, key,
                                        params.all_stop_token_ids)
        return compile_now() if key in self.compiled else self._executor.submit(compile_now)

    def _compile_now(self, backend: str | None, key: tuple, stops) -> Any:
        if backend != "xgrammar":  # vLLM's default; other backends' matchers are not followed here
            raise ValueError(f"the {backend} structured-output backend is not matched in the worker")
        grammar = self.backend.compile_grammar(*key, stop_token_ids=stops)
        self.compiled.add(key)
        return grammar


class GrammarStep:
    """One drafting step's grammars: ``requests`` maps a request to (its batch row, its grammar after its output,
    the step's bonus token); ``allocate(n)``: ``n`` host bitmask rows allowing every token."""

    keeps_nodes = False  # pruned trees are handed over from the host

    def __init__(self, requests: dict[str, tuple[int, Any, int]], ids: torch.Tensor | None,
                 host_ids: list[int] | None, allocate: Callable[[int], torch.Tensor], masks: bool = True) -> None:
        self.requests, self.ids, self.host_ids, self.allocate, self.masks = requests, ids, host_ids, allocate, masks
        self.rows = [row for row, _, _ in requests.values()]

    def mask(self, logits: torch.Tensor, draft=None) -> torch.Tensor:
        """``logits`` ``[B, F, V]`` of the roots (``draft`` None, F = 1) or of ``draft``'s frontier, masked in place
        where the grammar allows some draft token after the node's path; reads the frontier's paths to the host."""
        if not self.masks:
            return logits
        width = logits.shape[1]
        paths = [[[]]] * len(self.rows) if draft is None else draft.frontier_paths(self.rows)
        bitmask = self.allocate(len(self.rows) * width)
        for index, ((_, grammar, bonus), row_paths) in enumerate(zip(self.requests.values(), paths, strict=True)):
            def fill(node: int, valid: bool, grammar=grammar, index=index) -> None:
                if valid and not grammar.is_terminated():
                    grammar.fill_bitmask(bitmask, index * width + node)
            walk_paths(grammar, [[bonus, *self._target(path)] for path in row_paths], fill)
        ids = self.ids if self.ids is not None else torch.arange(logits.shape[-1], device=logits.device)
        allowed = allowed_ids(bitmask.to(logits.device, non_blocking=True), ids).view(len(self.rows), width, -1)
        rows = torch.tensor(self.rows).to(logits.device, non_blocking=True)
        chosen = logits[rows]
        masked = chosen.masked_fill(~allowed, float("-inf"))  # a row the mask leaves no finite logit stays unmasked
        logits[rows] = torch.where(masked.isfinite().any(-1, keepdim=True), masked, chosen)
        return logits

    def _target(self, path: list[int]) -> list[int]:
        return path if self.host_ids is None else [self.host_ids[token] for token in path]

    def chain(self, ids: torch.Tensor | None, rows: int) -> ChainMasks:
        """The masks of a chain step over ``rows`` requests whose draft logits' columns are the target ids ``ids``
        (None: the target's vocabulary) and whose drafted tokens are target ids."""
        return ChainMasks(GrammarStep(self.requests, ids, None, self.allocate), rows)

    def prune(self, candidates: list, logprobs: torch.Tensor | None) -> tuple[list, torch.Tensor | None]:
        """Candidate trees without the nodes the grammar forbids (i.i.d. trees, and trees after a bonus token the
        grammar forbids, are kept whole), and ``logprobs`` ``[B, N]`` with pruned rows' drafted values at their new
        nodes."""
        out, index = [], None
        for tree in candidates:
            state = self.requests.get(tree.req_id)
            root, *valid = [False] if state is None or tree.draw_mode is ChildDrawMode.IID_FROM_DRAFT else walk_paths(
                state[1], [[state[2]], *([state[2], *path] for path in node_paths(tree.tokens, tree.parents))])
            if not root:  # a prefill chunk's placeholder bonus token: left to the scheduler
                out.append(tree)
                continue
            kept = [node for node, ok in enumerate(valid) if ok]  # a node's path extends its parent's
            out.append(keeping_nodes(tree, kept))
            if logprobs is not None and tree.row is not None and len(kept) < len(valid):
                drafted = [node for node in kept if node < logprobs.shape[1]]  # drafted nodes come first
                index = torch.arange(logprobs.shape[1]).repeat(logprobs.shape[0], 1) if index is None else index
                index[tree.row, : len(drafted)] = torch.tensor(drafted, dtype=torch.long)
        if index is not None:
            logprobs = logprobs.gather(1, index.to(logprobs.device, non_blocking=True))
        return out, logprobs

    def prune_drawn(self, pending: dict[str, PendingTree]) -> dict[str, PendingTree]:
        """The policy's i.i.d.-drawn trees without each sibling group the grammar forbids whole. Drafts are
        masked, so a whole group is forbidden only where the grammar allowed no draft token after its parent: the
        parent's draft distribution has no mass the target may accept, rejecting the group leaves the target's
        residual as it was, and dropping it is exact. Cut after the policy, whose choice is blind to the draws."""
        out = dict(pending)
        for req_id, tree in pending.items():
            state = self.requests.get(req_id)
            if state is None or tree.draw_mode is not ChildDrawMode.IID_FROM_DRAFT:
                continue
            forbidden = _forbidden_groups(state[1], state[2], tree.tokens, tree.parents)
            kept: list[int] = []
            for node, parent in enumerate(tree.parents):
                if parent not in forbidden and (parent < 0 or parent in kept):
                    kept.append(node)
            if len(kept) < len(tree.tokens):
                out[req_id] = tree.keeping(kept)
        return out


def _forbidden_groups(grammar, bonus: int, tokens: list[int], parents: list[int]) -> set[int]:
    """The parents (-1: the root) after whose path the grammar is open (valid, not ended) and forbids every child."""
    open_paths: list[bool] = []  # the root's path, then each node's

    def visit(_: int, valid: bool) -> None:
        open_paths.append(valid and not grammar.is_terminated())

    valid = walk_paths(grammar, [[bonus], *([bonus, *path] for path in node_paths(tokens, parents))], visit)
    return {parent for parent in set(parents) if open_paths[parent + 1]
            and not any(valid[node + 1] for node, up in enumerate(parents) if up == parent)}


class ChainMasks:
    """A chain step's grammar masks: vLLM's ``propose`` computes each position's draft logits for the batch's
    ``rows`` requests (the model's ``compute_logits``, masked in :meth:`masking`) and hands back the tokens it drew
    (:meth:`drafted`, target ids); a structured request's row is masked by the grammar after its output, the bonus
    token and its chain so far."""

    def __init__(self, step: GrammarStep, rows: int) -> None:
        self.step, self.rows = step, rows
        self.chain: list[torch.Tensor] = []

    def frontier_paths(self, rows: list[int]) -> list[list[list[int]]]:
        """Each of ``rows``' chain so far, as :meth:`GrammarStep.mask` reads a draft's frontier (one read)."""
        if not self.chain:
            return [[[]] for _ in rows]
        chain = torch.stack(self.chain, dim=1)
        return [[path] for path in chain[torch.tensor(rows).to(chain.device, non_blocking=True)].tolist()]

    @contextlib.contextmanager
    def masking(self, model):
        """While vLLM samples one position: ``model.compute_logits`` masked (a call over other rows is not)."""
        compute_logits = model.compute_logits

        def masked(hidden: torch.Tensor) -> torch.Tensor:
            logits = compute_logits(hidden)
            return logits if logits.shape[0] != self.rows else self.step.mask(logits[:, None], self)[:, 0]

        model.compute_logits = masked
        try:
            yield
        finally:
            del model.compute_logits

    def drafted(self, tokens: torch.Tensor) -> None:
        if tokens.shape[0] == self.rows:
            self.chain.append(tokens)


def allowed_ids(bitmask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` bool: whether each of ``R`` token bitmasks (int32 words over the target's vocabulary) allows
    the target id ``ids[v]`` of draft token ``v``; an id of -1 (no target token) is never allowed."""
    limit = 32 * bitmask.shape[1]
    safe = ids.clamp(0, limit - 1)
    bits = (bitmask[:, safe >> 5] >> (safe & 31)) & 1
    return (bits != 0) & (ids >= 0) & (ids < limit)
