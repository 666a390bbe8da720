"""The drafter drafts the tree: the tree path of the plugin's draft-model proposer and of its EAGLE proposer
(:mod:`~vllm_easyspec.integration.proposers`; docs/design.md, "Drafting a tree with a draft model", "EAGLE heads
draft trees", "Merged candidates: prompt lookup", "Trees across vocabularies, bridged by text").

One step: vLLM's own first pass over the verified tokens (the runner has rewritten them to the accepted branch;
an EAGLE head reads the target's states of that branch), one forward per further level over the frontier
(:class:`~vllm_easyspec.tree.drafting.LevelwiseTreeDraft`), masked by structured-output grammars
(:mod:`~vllm_easyspec.integration.draft_grammar`), prompt-lookup paths merged in, and each request's tree handed
to the verifier as a :class:`~vllm_easyspec.integration.tree_step.PendingTree`. A step that drafts nothing skips
even the first pass (:mod:`~vllm_easyspec.integration.deferred_first_pass`); ``{"chain": k}`` is the proposer's
own chain drafting.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.forward_context import set_forward_context

from vllm_easyspec.integration.compat import plugin_logger
from vllm_easyspec.integration.deferred_first_pass import DeferredFirstPass
from vllm_easyspec.integration.draft_grammar import NO_GRAMMAR, DraftGrammars
from vllm_easyspec.integration.node_policy import CandidateTree, NodePolicy
from vllm_easyspec.integration.options import EasySpecOptions
from vllm_easyspec.integration.tree_attention import DraftTreeAttention, TreeLevelMetadata
from vllm_easyspec.integration.tree_step import PendingTree, TreeVerifier
from vllm_easyspec.tree.building import ChildDrawMode
from vllm_easyspec.tree.drafting import LevelwiseTreeDraft
from vllm_easyspec.tree.merging import merge_path, prompt_lookup
from vllm_easyspec.tree.retokenizing import TreeRetokenizer, approximate_target_to_draft, token_bytes
from vllm_easyspec.tree.sampling import greedy_rows

if TYPE_CHECKING:
    from vllm_easyspec.integration.proposers import DraftingBatch

logger = plugin_logger(__name__)


class TreeDrafting:
    """Drafts token trees with a vLLM draft-model proposer (see the module docstring)."""

    def __init__(self, proposer, options: EasySpecOptions, draft_chain: Callable[..., torch.Tensor]) -> None:
        """``draft_chain``: the proposer's chain drafting, called with vLLM's ``propose`` arguments."""
        self.proposer = proposer
        self.config = config = options.tree
        self.draft_chain = draft_chain
        self.verifier: TreeVerifier | None = None  # the runner's, connected once it exists (runner.__init__)
        self.deferred = DeferredFirstPass()
        self.retokenizer: TreeRetokenizer | None = None
        self.draft_usable: torch.Tensor | None = None  # retokenize: draft tokens that have text (or map)
        self.unshared_target_tokens: torch.Tensor | None = None  # retokenize: target ids the draft lacks
        if options.bridges_by_text:
            self._bridge_by_text()
        elif options.across_vocabularies:
            reason = "retokenize is false" if config.retokenize is False else "draw is 'sample'"
            logger.info("easyspec.tree: the vocabularies are bridged by vLLM's shared ids (%s)", reason)
        # drafts masked by structured-output grammars (across a text bridge only pruned: the draft's ids are not
        # the target's)
        self.grammars = DraftGrammars(proposer.vllm_config, lambda: (
            proposer.vocab_mapping.draft_to_target_ids if proposer.use_heterogeneous_vocab else self.output_ids),
                                      rollback=config.num_nodes + 1, masks_drafts=self.retokenizer is None)

    def _bridge_by_text(self) -> None:
        """``tree.retokenize``: the retokenizer, the draft tokens it can use, and the refined target -> draft
        table of the proposer's vocabulary mapping, for a draft model with ``use_heterogeneous_vocab``
        (:func:`~vllm_easyspec.integration.front_end.prepare_tree_engine_args`). Where token text is unknown,
        an explicit ``retokenize`` is refused and the default keeps vLLM's shared ids."""
        proposer = self.proposer
        from vllm.tokenizers.registry import get_tokenizer

        spec = proposer.speculative_config
        target_tokenizer = get_tokenizer(spec.target_model_config.tokenizer,
                                         trust_remote_code=spec.target_model_config.trust_remote_code)
        draft_tokenizer = get_tokenizer(spec.draft_model_config.model,
                                        trust_remote_code=spec.draft_model_config.trust_remote_code)
        try:
            draft_bytes, target_bytes = token_bytes(draft_tokenizer), token_bytes(target_tokenizer)
        except ValueError as unknown_text:
            if self.config.retokenize:
                raise
            logger.info("easyspec.tree: the vocabularies are bridged by vLLM's shared ids, not by text: %s",
                        str(unknown_text).replace("; remove retokenize", ""))
            return
        mapping = proposer.vocab_mapping
        draft_to_target = mapping.draft_to_target_ids.cpu()
        special = {index: int(draft_to_target[index]) for index, data in enumerate(draft_bytes)
                   if data is None and index < len(draft_to_target) and int(draft_to_target[index]) >= 0}

        def encode_with(tokenizer):
            return lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]

        self.retokenizer = TreeRetokenizer(draft_bytes, special, encode_with(target_tokenizer))
        usable = torch.zeros(mapping.draft_vocab_size, dtype=torch.bool)
        known = min(len(draft_bytes), mapping.draft_vocab_size)
        usable[:known] = torch.tensor([data is not None for data in draft_bytes[:known]])
        usable[list(special)] = True
        self.draft_usable = usable.to(mapping.intersection_mask_draft.device)
        table = mapping.target_to_draft_ids.cpu()
        self.unshared_target_tokens = table == -1
        filled = approximate_target_to_draft(table, target_bytes, encode_with(draft_tokenizer))
        mapping.target_to_draft_ids.copy_(table.to(mapping.target_to_draft_ids.device))
        logger.info("easyspec.tree.retokenize: the draft proposes any of its %d tokens with text; %d target "
                    "tokens outside the shared vocabulary reach it as their draft encoding's last token",
                    int(usable.sum()), filled)

    @functools.cached_property
    def output_ids(self) -> torch.Tensor | None:
        """The target id of each token of the head's reduced output vocabulary (EAGLE-3 ``d2t``), or None when
        the drafter's logits are over the target's vocabulary or a draft model's own. Read at the first
        drafting step, once the model is loaded."""
        model = self.proposer.model
        d2t = getattr(model, "draft_id_to_target_id", None)
        if (d2t is None or not hasattr(model, "logits_processor") or not hasattr(model, "lm_head")
                or self.proposer.use_heterogeneous_vocab):
            return None
        return torch.arange(d2t.shape[0], device=d2t.device) + d2t.detach().long()

    @property
    def _chain_ids(self) -> torch.Tensor | None:
        """The target id of each column of vLLM's chain draft logits (an EAGLE-3 head's span the target's
        vocabulary), None where they are the target's."""
        proposer = self.proposer
        return proposer.vocab_mapping.draft_to_target_ids if proposer.use_heterogeneous_vocab else None

    @property
    def policy(self) -> NodePolicy:
        return self.verifier.policy

    @property
    def batch(self) -> DraftingBatch:
        """This step's batch, as the runner handed it to the proposer."""
        return self.proposer.drafting_batch

    def propose(self, **arguments) -> torch.Tensor:
        """vLLM's ``propose`` arguments in, ``[B, N]`` node tokens out (module docstring); the policy times the
        whole drafting stage."""
        mark = self.policy.start()
        drafts = self._propose(**arguments)
        self.policy.drafting_done(mark)
        return drafts

    def _propose(self, **arguments) -> torch.Tensor:
        proposer = self.proposer
        cad = arguments["common_attn_metadata"]
        batch_size = cad.batch_size()
        if proposer.pass_hidden_states_to_model:  # an EAGLE head reads the target's states of the accepted branch
            arguments["target_hidden_states"] = self.verifier.branch_hidden_states(arguments["target_hidden_states"])
        policy = self.policy
        budget = policy.budget(batch_size)
        req_ids = self._request_ids(batch_size)
        live = set(self.verifier.requests)
        # the step's bonus tokens on the host, read once if prompt lookup or a grammar asks for them
        bonus_tokens = functools.cache(lambda: arguments["next_token_ids"][: len(req_ids)].tolist())
        if budget.chain:
            arguments = self.deferred.catch_up(arguments, req_ids, live, self._first_pass_room(cad))
            grammar = self.grammars.step(req_ids, self.batch, self.verifier.last_branch, bonus_tokens)
            proposer.chain_masks = grammar.chain(self._chain_ids, batch_size)
            try:
                chains = self.draft_chain(**(arguments | {"num_speculative_tokens": budget.nodes}))
            finally:
                proposer.chain_masks = NO_GRAMMAR
            return self._hand_over_chains(chains, batch_size)
        paths = self._lookup_paths(req_ids, bonus_tokens) if budget.nodes else None
        depth = 0
        if budget.nodes:
            path_lengths = None if paths is None else [min(len(path), self._path_nodes) for path in paths]
            depth = policy.plan_depth(req_ids, cad.num_actual_tokens + self.deferred.kept_rows(req_ids),
                                      self.batch.requests, path_lengths)
        grammar = self.grammars.step(req_ids, self.batch, self.verifier.last_branch, bonus_tokens) \
            if budget.nodes else NO_GRAMMAR
        if depth == 0:  # nothing to draft: the first pass waits
            self.deferred.keep(arguments, req_ids, live)
            if paths is not None and budget.nodes:  # the prompt-lookup paths may still pay on their own (auto)
                return self._hand_over_paths(paths, batch_size, arguments["next_token_ids"], budget.nodes, grammar)
            return self._hand_over(None, batch_size, arguments["next_token_ids"], 0)
        arguments = self.deferred.catch_up(arguments, req_ids, live, self._first_pass_room(cad))
        return self._propose_trees(budget.nodes, depth, paths, grammar, **arguments)

    def _lookup_paths(self, req_ids: list[str], bonus_tokens: Callable[[], list[int]]) -> list[list[int]] | None:
        """Each request's prompt-lookup path (target vocabulary; as long as a merge into the deepest tree can
        use; empty where it has none or may not speculate), or None without ``sources.prompt_lookup``."""
        lookup = None if self.config.sources is None else self.config.sources.prompt_lookup
        if lookup is None:
            return None
        next_tokens = bonus_tokens()  # lookup runs on the host
        return [[] if self.verifier.fallback_reason(req_id) is not None else
                prompt_lookup(self._history(row, req_id, next_tokens[row]), lookup.min_match, lookup.max_match,
                              self.config.max_depth + lookup.nodes)
                for row, req_id in enumerate(req_ids)]

    def _first_pass_room(self, cad) -> int:
        """Rows the first pass's buffers hold beyond this step's own (and the slots a draft model adds)."""
        proposer = self.proposer
        buffers = [proposer.input_ids, proposer.positions, getattr(proposer, "hidden_states", None),
                   getattr(proposer, "_slot_mapping_buffer", None)]
        size = min(buffer.shape[-1 if buffer.ndim == 1 else 0] for buffer in buffers if buffer is not None)
        extra = getattr(proposer, "net_num_new_slots_per_request", 0) if proposer.needs_extra_input_slots else 0
        return size - cad.num_actual_tokens - extra * cad.batch_size()

    def _propose_trees(self, node_limit: int, depth: int, lookup_paths: list[list[int]] | None, grammar, *,
                       target_token_ids, target_positions, target_hidden_states, next_token_ids,
                       token_indices_to_sample, common_attn_metadata, sampling_metadata, mm_embed_inputs=None,
                       num_rejected_tokens_gpu=None, **_unused) -> torch.Tensor:
        """One tree drafting step at ``node_limit`` nodes, at most ``depth`` deep; ``lookup_paths``: the requests'
        prompt-lookup paths (:meth:`_lookup_paths`); ``grammar``: the step's grammar masks (:mod:`.draft_grammar`)."""
        proposer = self.proposer
        proposer._last_draft_probs = None
        batch_size = common_attn_metadata.batch_size()
        if proposer.pass_hidden_states_to_model and proposer.method == "eagle3":
            target_hidden_states = proposer.model.combine_hidden_states(target_hidden_states)
        policy = self.policy
        mark = policy.start()
        root_hidden, root_feed, root_positions, cad = self._first_pass(
            target_token_ids, target_positions, target_hidden_states, next_token_ids,
            token_indices_to_sample, common_attn_metadata, mm_embed_inputs, num_rejected_tokens_gpu)
        root_logits = grammar.mask(self._logits(root_hidden)[:, None])[:, 0]
        policy.first_pass_done(mark, common_attn_metadata.num_actual_tokens, batch_size)  # the roots' logits too
        greedy, temperatures = greedy_rows(self.batch.temperatures, batch_size)  # the host's copy: no wait
        drafted = self.config.drafted_within(node_limit).within_depth(depth)
        draft = LevelwiseTreeDraft(drafted, root_logits, greedy, temperatures, sampling_metadata.generators)
        state = DraftTreeAttention(prefix_lens=(root_positions + 1).int(), block_table=cad.block_table_tensor[:batch_size])
        mark = policy.start()
        levels, level_rows = self._draft_levels(draft, state, root_feed, root_positions, batch_size, grammar)
        if levels:
            policy.levels_done(mark, levels, level_rows // levels)
        return self._hand_over(draft.build(), batch_size, next_token_ids, node_limit, lookup_paths, grammar)

    def _draft_levels(self, draft: LevelwiseTreeDraft, state: DraftTreeAttention, root_feed: torch.Tensor | None,
                      root_positions: torch.Tensor, batch_size: int, grammar=NO_GRAMMAR) -> tuple[int, int]:
        """One draft forward per tree level over that level's frontier, until ``draft`` is done; returns the
        levels and the rows they forwarded. An EAGLE head's nodes read the state their parent produced."""
        feeds_hidden = self.proposer.pass_hidden_states_to_model  # an EAGLE head: each node reads its parent's state
        stash_feed = None if root_feed is None else root_feed.new_zeros(batch_size, 0, root_feed.shape[-1])
        levels, level_rows = 0, 0
        while not draft.done:
            tokens = draft.frontier_tokens()
            width = tokens.shape[1]
            metadata = TreeLevelMetadata(state=state, width=width, tree_mask=draft.frontier_mask(),
                                         depth=draft.frontier_depth)
            # one position per frontier row (vLLM's rotary op reads one per token, unchecked)
            positions = root_positions.repeat_interleave(width) + draft.frontier_depth
            if self.output_ids is not None:
                tokens = self.output_ids[tokens]
            parent_states = (_parent_states(root_feed, stash_feed, draft.frontier_parent_columns())
                             if feeds_hidden else None)
            hidden, feed = self._level_forward(metadata, tokens.reshape(-1), positions, parent_states)
            if feeds_hidden:
                stash_feed = torch.cat([stash_feed, feed.view(batch_size, width, -1)], dim=1)
            draft.expand(grammar.mask(self._logits(hidden).view(batch_size, width, -1), draft))
            levels, level_rows = levels + 1, level_rows + batch_size * width
        return levels, level_rows

    def _level_forward(self, metadata: TreeLevelMetadata, input_ids: torch.Tensor, positions: torch.Tensor,
                       parent_states: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One level through the drafter as vLLM runs a chain's draft step: inputs in the proposer's buffers, the
        row count padded to a captured size (CUDA graphs, piecewise: attention runs between the pieces), and on
        GPUs the rows' K/V written to their lookahead slots (``levels_in_cache``). Returns the level's hidden
        states and, for an EAGLE head, the states its children read."""
        proposer, count = self.proposer, metadata.num_actual_tokens
        mode, padded, across_dp = proposer._determine_batch_execution_and_padding(count)
        proposer.input_ids[:count] = input_ids.to(proposer.input_ids.dtype)
        proposer._set_positions(count, positions)
        inputs = {"input_ids": proposer.input_ids[:padded], "positions": proposer._get_positions(padded),
                  "inputs_embeds": None}
        if parent_states is not None:
            proposer.hidden_states[:count] = parent_states
            inputs["hidden_states"] = proposer.hidden_states[:padded]
        slots = {}  # on CPUs a level writes nothing
        if self._levels_in_cache:
            slots = proposer._get_slot_mapping(padded, metadata.slots(proposer.block_size, proposer.max_model_len))
        with set_forward_context({name: metadata for name in proposer._draft_attn_layer_names}, proposer.vllm_config,
                                 num_tokens=padded, num_tokens_across_dp=across_dp, cudagraph_runtime_mode=mode,
                                 slot_mapping=slots):
            output = proposer.model(**inputs)
        hidden, feed = output if proposer.model_returns_tuple() else (output, None)
        return hidden[:count], None if feed is None else feed[:count]

    @functools.cached_property
    def _levels_in_cache(self) -> bool:
        """Whether the drafter's attention writes a level's K/V to the cache and reads it there (GPUs)."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        layers = get_layers_from_vllm_config(self.proposer.vllm_config, Attention,
                                             self.proposer._draft_attn_layer_names)
        return bool(layers) and all(getattr(layer.impl, "levels_in_cache", False) for layer in layers.values())

    # ------------------------------------------------------------------------------------------ steps
    def _first_pass(self, target_token_ids, target_positions, target_hidden_states, next_token_ids,
                    token_indices_to_sample, cad, mm_embed_inputs, num_rejected_tokens_gpu):
        """vLLM's first drafter forward (``SpecDecodeBaseProposer.propose`` up to its first sample), which
        this path runs as is; returns the roots' hidden states (for logits, and the state an EAGLE head feeds
        its children, or None for a draft model), their positions, and the metadata."""
        proposer = self.proposer
        num_tokens, token_indices_to_sample, cad = proposer.set_inputs_first_pass(
            target_token_ids=target_token_ids, next_token_ids=next_token_ids,
            target_positions=target_positions, target_hidden_states=target_hidden_states,
            token_indices_to_sample=token_indices_to_sample, cad=cad,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu)
        _, per_layer_attn_metadata = proposer.build_per_group_and_layer_attn_metadata(cad)
        cudagraph_mode, num_input_tokens, num_tokens_across_dp = (
            proposer._determine_batch_execution_and_padding(num_tokens))
        model_kwargs, slot_mapping_size = proposer.build_model_inputs_first_pass(num_tokens, num_input_tokens,
                                                                                 mm_embed_inputs)
        with set_forward_context(
            per_layer_attn_metadata, proposer.vllm_config, num_tokens=num_input_tokens,
            num_tokens_across_dp=num_tokens_across_dp, cudagraph_runtime_mode=cudagraph_mode,
            slot_mapping=proposer._get_slot_mapping(slot_mapping_size, cad.slot_mapping),
        ):
            output = proposer.model(**model_kwargs)
        hidden, feed = output if proposer.model_returns_tuple() else (output, None)
        root_feed = None if feed is None else feed[token_indices_to_sample]
        # a draft with M-RoPE holds its positions in mrope_positions (text: every stream equal)
        positions = proposer.mrope_positions[0] if proposer.uses_mrope else proposer.positions
        return hidden[token_indices_to_sample], root_feed, positions[token_indices_to_sample], cad

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary: an EAGLE-3 head's reduced one (:attr:`output_ids`), a draft
        model's restricted to target-mappable tokens across vocabularies, or with ``retokenize`` to the tokens
        that have text (or map, special ones)."""
        proposer = self.proposer
        if self.output_ids is not None:
            model = proposer.model
            return model.logits_processor(model.lm_head, hidden).float()
        logits = proposer.model.compute_logits(hidden).float()
        if self.draft_usable is not None:
            logits = logits.masked_fill(~self.draft_usable, float("-inf"))
        elif proposer.use_heterogeneous_vocab:
            logits = proposer.vocab_mapping.constrain_draft_logits(logits)
        return logits

    def _hand_over_chains(self, chains: torch.Tensor, batch_size: int) -> torch.Tensor:
        """The proposer's ``[B, k]`` chain drafts (target ids) to the runner's verifier, as chains."""
        verifier = self.verifier
        req_ids = self._request_ids(batch_size)
        rows = chains.tolist()
        paths = {req_id: PendingTree.chain(rows[row]) for row, req_id in enumerate(req_ids)
                 if verifier.fallback_reason(req_id) is None}
        verifier.propose(paths, set(req_ids) - set(paths), node_limit=chains.shape[1], chain=True)
        return chains

    def _request_ids(self, batch_size: int) -> list[str]:
        return self.batch.req_ids[:batch_size]

    @property
    def _path_nodes(self) -> int:
        """The most prompt-lookup nodes a tree takes (``sources.prompt_lookup.nodes``), alone as with drafts."""
        return self.config.sources.prompt_lookup.nodes

    def _hand_over_paths(self, paths: list[list[int]], batch_size: int, next_token_ids: torch.Tensor,
                         node_limit: int, grammar=NO_GRAMMAR) -> torch.Tensor:
        """A step that drafts nothing (``easyspec.tree.auto``): each request's prompt-lookup path alone, its first
        :attr:`_path_nodes` tokens, of which the policy picks how many to verify. A path of deterministic nodes
        verifies as vLLM verifies a chain, greedy or sampled."""
        verifier = self.verifier
        req_ids = self._request_ids(batch_size)
        # a request without a path has nothing to choose from, as one that may not speculate
        no_drafts = {req_id for req_id, path in zip(req_ids, paths, strict=True)
                     if not path or verifier.fallback_reason(req_id) is not None}
        candidates = []
        for req_id, path in zip(req_ids, paths, strict=True):
            if req_id not in no_drafts:
                path = path[: self._path_nodes]
                verifier.stats.source_nodes += len(path)
                candidates.append(CandidateTree(req_id, path, list(range(-1, len(path) - 1)),
                                                ChildDrawMode.WITHOUT_REPLACEMENT, from_lookup=(True,) * len(path)))
        pending = self.policy.choose(grammar.prune(candidates, None)[0], node_limit, batch_size, None)
        verifier.propose(pending, no_drafts, node_limit=node_limit, chain=False)
        return _pending_tokens(req_ids, pending, self.config.num_nodes, next_token_ids.device)

    def _hand_over(self, trees, batch_size: int, next_token_ids: torch.Tensor, node_limit: int,
                   lookup_paths: list[list[int]] | None = None, grammar=NO_GRAMMAR) -> torch.Tensor:
        """Map to target ids, merge the sources' candidates in (``lookup_paths``: :meth:`_lookup_paths`), give
        the trees, cut by the policy (none drafted when ``node_limit`` is 0), to the runner's verifier, and
        return ``[B, N]`` node tokens (a tree with fewer than ``N`` nodes is cut to its own size later, in
        :meth:`~vllm_easyspec.integration.tree_step.TreeVerifier.trim_drafts`)."""
        verifier = self.verifier
        req_ids = self._request_ids(batch_size)
        if trees is None:
            verifier.propose({}, set(req_ids), node_limit=node_limit, chain=False)
            return torch.zeros(batch_size, self.config.num_nodes, dtype=torch.long, device=next_token_ids.device)
        tokens, token_lists, parent_lists = self._target_trees(trees)
        no_drafts: set[str] = set()
        candidates: list[CandidateTree] = []
        for row, req_id in enumerate(req_ids):
            if verifier.fallback_reason(req_id) is not None:
                no_drafts.add(req_id)
                continue
            row_tokens, row_parents, mode = token_lists[row], parent_lists[row], trees.draw_modes[row]
            drafted = len(row_tokens)
            if lookup_paths is not None and mode is ChildDrawMode.WITHOUT_REPLACEMENT:
                row_tokens, row_parents, added = merge_path(row_tokens, row_parents, lookup_paths[row],
                                                            self._path_nodes)
                verifier.stats.source_nodes += added
            candidates.append(CandidateTree(
                req_id, row_tokens, row_parents, mode, self._target_probs(trees.draft_probs.get(row)),
                tuple(index >= drafted for index in range(len(row_tokens))), row,
                # i.i.d. children: how many to verify must not depend on what was drawn (that would bias the draws)
                value_blind=self.retokenizer is not None or mode is ChildDrawMode.IID_FROM_DRAFT))
        candidates, logprobs = grammar.prune(candidates, trees.logprobs)  # nodes a grammar forbids
        pending = grammar.prune_drawn(self.policy.choose(candidates, node_limit, batch_size, logprobs))
        verifier.propose(pending, no_drafts, node_limit=node_limit, chain=False)
        if lookup_paths is None and self.retokenizer is None and self.policy.keeps_drafted_order and grammar.keeps_nodes:
            return tokens  # each request verifies a prefix of its drafted row
        return _pending_tokens(req_ids, pending, self.config.num_nodes, tokens.device, tokens.dtype)

    def _target_trees(self, trees) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
        """The drafted trees in the target's vocabulary: ``[B, n]`` tokens (drafted ids where they are re-encoded
        by text) and each row's tokens and parents as host lists."""
        proposer = self.proposer
        tokens = trees.tokens
        if self.retokenizer is not None:
            retokenized = [self.retokenizer.retokenize(row_tokens, row_parents, self.config.drafted_nodes)
                           for row_tokens, row_parents in zip(tokens.tolist(), trees.parents.tolist(), strict=True)]
            return tokens, [row[0] for row in retokenized], [row[1] for row in retokenized]
        if proposer.use_heterogeneous_vocab:
            tokens = proposer.vocab_mapping.map_draft_to_target_ids(tokens)
        elif self.output_ids is not None:
            tokens = self.output_ids[tokens]
        return tokens, tokens.tolist(), trees.parents.tolist()

    def _target_probs(self, probs: torch.Tensor | None) -> torch.Tensor | None:
        """An i.i.d. tree's draft probabilities in the target's vocabulary (None for top-k or retokenized)."""
        proposer = self.proposer
        if probs is not None and proposer.use_heterogeneous_vocab:
            return _to_target_vocab(probs, proposer.vocab_mapping)
        if probs is not None and self.output_ids is not None:
            return _spread(probs, self.output_ids, proposer.model.config.vocab_size)
        return probs

    def _history(self, row: int, req_id: str, next_token: int) -> np.ndarray:
        """The request's tokens through this step's bonus token (target vocabulary): the runner's token ids
        (not yet holding this step's output when the drafter runs), the accepted branch, the bonus token."""
        known = self.batch.history(row)
        recent = np.asarray([*self.verifier.last_branch.get(req_id, []), next_token], dtype=np.int64)
        return np.concatenate((known.astype(np.int64), recent))


def _pending_tokens(req_ids: list[str], pending: dict[str, PendingTree], width: int, device: torch.device,
                   dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``[B, width]`` node tokens on ``device``: each pending request's row starts with its tree's tokens,
    zeros elsewhere (rows without a pending tree get no drafts, :meth:`TreeVerifier.trim_drafts`). Built on the
    host and copied once, without waiting for the device."""
    out = torch.zeros(len(req_ids), width, dtype=dtype)
    for row, req_id in enumerate(req_ids):
        tokens = pending[req_id].tokens if req_id in pending else []
        if tokens:
            out[row, : len(tokens)] = torch.tensor(tokens, dtype=out.dtype)
    return out.to(device, non_blocking=True)


def _parent_states(root: torch.Tensor, stash: torch.Tensor, parent_columns: torch.Tensor) -> torch.Tensor:
    """``[B * F, H]``, contiguous: for each frontier node the state its parent produced (the root's for depth-1
    nodes). A compiled drafter (CUDA graphs) asserts its inputs' strides, so no row may be a stride-0 view."""
    batch, width = parent_columns.shape
    if stash.shape[1] == 0:
        return root.repeat_interleave(width, dim=0)
    index = parent_columns.clamp(min=0).to(stash.device, non_blocking=True)[:, :, None]
    index = index.expand(-1, -1, stash.shape[-1])
    from_stash = stash.gather(1, index)
    is_root = (parent_columns < 0).to(stash.device, non_blocking=True)[:, :, None]
    return torch.where(is_root, root[:, None, :], from_stash).reshape(batch * width, -1)


def _spread(probs: torch.Tensor, target_ids: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    """Probabilities over a reduced vocabulary ``[..., V_reduced]`` at their target ids ``[..., V_target]``."""
    out = probs.new_zeros(*probs.shape[:-1], target_vocab_size)
    out[..., target_ids] = probs
    return out


def _to_target_vocab(probs: torch.Tensor, mapping) -> torch.Tensor:
    """Draft-vocabulary probabilities (zero outside the mappable intersection) in target-vocabulary ids."""
    draft_ids = mapping.intersection_mask_draft.nonzero().flatten()
    return _spread(probs[:, draft_ids], mapping.draft_to_target_ids[draft_ids], mapping.target_vocab_size)

