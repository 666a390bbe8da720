"""Steps that speculate nothing skip the drafter's first pass; the next step that drafts catches it up
(docs/design.md, "Tree size that follows the batch"): a request's kept rows (token ids, positions, slots, the
target's hidden states) go in front of its new rows in that step's first pass (:meth:`DeferredFirstPass.catch_up`).

Invariant: a request's kept rows are its positions ``start .. start + n - 1`` with none missing, and are used
only by a step whose first row for that request is at ``start + n``. Rows that would break this (a preempted
request starting over, rows trimmed to fit the drafter's buffers) are dropped: the draft's K/V at those positions
stays stale, which lowers acceptance there and never changes what the target emits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_KEPT_ROWS = 1024  # per request; older kept rows are dropped (their draft K/V stays stale)


@dataclass
class KeptRows:
    """One request's rows whose first pass was skipped, oldest first."""

    start: int  # position of the first kept row
    tokens: list[torch.Tensor] = field(default_factory=list)  # [n_i] per skipped step
    slots: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)  # [n_i, H] per skipped step
    count: int = 0

    @property
    def next_position(self) -> int:
        return self.start + self.count

    def add(self, tokens: torch.Tensor, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        self.tokens.append(tokens)
        self.slots.append(slots)
        self.hidden.append(hidden)
        self.count += tokens.shape[0]
        if self.count > MAX_KEPT_ROWS:
            self.keep_last(MAX_KEPT_ROWS)

    def keep_last(self, rows: int) -> None:
        """Drop all but the newest ``rows`` rows."""
        drop = self.count - rows
        if drop <= 0:
            return
        tokens, slots, hidden = (torch.cat(parts)[drop:] for parts in (self.tokens, self.slots, self.hidden))
        self.tokens, self.slots, self.hidden = [tokens], [slots], [hidden]
        self.start += drop
        self.count = rows


@dataclass
class DeferredFirstPass:
    """The rows of skipped first passes, by request (module docstring)."""

    rows: dict[str, KeptRows] = field(default_factory=dict)
    skipped_steps: int = 0
    caught_up_rows: int = 0
    dropped_rows: int = 0

    def keep(self, arguments: dict, req_ids: list[str], live: set[str]) -> None:
        """A step whose first pass is skipped: keep each request's verified rows (vLLM's ``propose``
        ``arguments``, batch rows ``req_ids``; the rows after a request's last verified one were rejected and
        are not kept). ``live``: the requests still running; the others' rows are dropped."""
        self.skipped_steps += 1
        self._forget_finished(live)
        cad = arguments["common_attn_metadata"]
        starts = cad.query_start_loc_cpu.tolist()
        rejected = arguments.get("num_rejected_tokens_gpu")
        rejected = [0] * len(req_ids) if rejected is None else rejected[: len(req_ids)].tolist()
        positions = arguments["target_positions"]
        first_positions = positions[cad.query_start_loc[: len(req_ids)].long()].tolist()
        for index, req_id in enumerate(req_ids):
            begin, end = starts[index], starts[index + 1] - rejected[index]
            if end <= begin:
                continue
            kept = self.rows.get(req_id)
            if kept is None or kept.next_position != first_positions[index]:
                if kept is not None:
                    self.dropped_rows += kept.count
                kept = self.rows[req_id] = KeptRows(start=first_positions[index])
            kept.add(arguments["target_token_ids"][begin:end].clone(), cad.slot_mapping[begin:end].clone(),
                     arguments["target_hidden_states"][begin:end].clone())

    def kept_rows(self, req_ids: list[str]) -> int:
        """Rows kept for ``req_ids``: what a first pass now would catch up (at most)."""
        return sum(self.rows[req_id].count for req_id in req_ids if req_id in self.rows)

    def catch_up(self, arguments: dict, req_ids: list[str], live: set[str], capacity: int) -> dict:
        """vLLM's ``propose`` arguments with each request's kept rows in front of its rows (at most ``capacity``
        rows added in all, the newest kept), or ``arguments`` unchanged when no request has any."""
        self._forget_finished(live)
        if not self.rows:
            return arguments
        cad = arguments["common_attn_metadata"]
        positions = arguments["target_positions"]
        first_positions = positions[cad.query_start_loc[: len(req_ids)].long()].tolist()
        kept_by_row: list[KeptRows | None] = []
        for index, req_id in enumerate(req_ids):
            kept = self.rows.pop(req_id, None)
            if kept is not None and kept.next_position != first_positions[index]:
                self.dropped_rows += kept.count
                kept = None
            kept_by_row.append(kept)
        total = sum(kept.count for kept in kept_by_row if kept is not None)
        if total == 0:
            return arguments
        if total > capacity:  # the newest rows of each request, in proportion
            for kept in kept_by_row:
                if kept is not None:
                    keep = kept.count * max(capacity, 0) // total
                    self.dropped_rows += kept.count - keep
                    kept.keep_last(keep)
        return self._with_kept_rows(arguments, kept_by_row)

    def _with_kept_rows(self, arguments: dict, kept_by_row: list[KeptRows | None]) -> dict:
        cad = arguments["common_attn_metadata"]
        starts = cad.query_start_loc_cpu.tolist()
        tokens, positions, hidden = (arguments[name] for name in
                                     ("target_token_ids", "target_positions", "target_hidden_states"))
        device = tokens.device
        parts: dict[str, list[torch.Tensor]] = {"tokens": [], "positions": [], "slots": [], "hidden": []}
        lengths, added = [], []
        for index, kept in enumerate(kept_by_row):
            begin, end = starts[index], starts[index + 1]
            count = 0 if kept is None else kept.count
            if count:
                parts["tokens"] += kept.tokens
                parts["positions"].append(torch.arange(kept.start, kept.start + count, device=device,
                                                       dtype=positions.dtype))
                parts["slots"] += kept.slots
                parts["hidden"] += kept.hidden
                self.caught_up_rows += count
            parts["tokens"].append(tokens[begin:end])
            parts["positions"].append(positions[begin:end])
            parts["slots"].append(cad.slot_mapping[begin:end])
            parts["hidden"].append(hidden[begin:end])
            lengths.append(count + end - begin)
            added.append(count)
        tail = slice(starts[-1], cad.num_actual_tokens)  # padding rows after the last request, if any
        parts["tokens"].append(tokens[tail])
        parts["positions"].append(positions[tail])
        parts["slots"].append(cad.slot_mapping[tail])
        parts["hidden"].append(hidden[tail])
        new_tokens, new_positions, new_slots, new_hidden = (torch.cat(parts[name]) for name in
                                                            ("tokens", "positions", "slots", "hidden"))
        query_start_cpu = torch.zeros(len(lengths) + 1, dtype=cad.query_start_loc_cpu.dtype)
        query_start_cpu[1:] = torch.tensor(lengths).cumsum(0)
        extra = sum(added)
        new_cad = cad.replace(
            query_start_loc=query_start_cpu.to(cad.query_start_loc.device, cad.query_start_loc.dtype,
                                               non_blocking=True),
            query_start_loc_cpu=query_start_cpu,
            num_actual_tokens=cad.num_actual_tokens + extra,
            max_query_len=max(lengths),
            slot_mapping=new_slots,
            positions=None if cad.positions is None else new_positions,
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        sample = arguments.get("token_indices_to_sample")
        if sample is not None:  # each request's row to sample from moves by the rows added up to it
            shift = torch.tensor(added, dtype=sample.dtype).cumsum(0).to(sample.device, non_blocking=True)
            sample = sample + shift
        return arguments | {"target_token_ids": new_tokens, "target_positions": new_positions,
                            "target_hidden_states": new_hidden, "token_indices_to_sample": sample,
                            "common_attn_metadata": new_cad}

    def _forget_finished(self, live: set[str]) -> None:
        """Requests that finished take their rows along."""
        for req_id in [r for r in self.rows if r not in live]:
            del self.rows[req_id]
