"""Deferred first passes (integration/deferred_first_pass.py) without an engine: the rows a skipped step keeps,
and the first-pass inputs a later step gets with them in front, on the layouts vLLM's ``propose`` receives."""

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from tests.fake_device import on_host, second_device
from vllm_easyspec.integration.deferred_first_pass import MAX_KEPT_ROWS, DeferredFirstPass

HIDDEN = 3


def _arguments(rows: list[list[int]], rejected: list[int] | None = None, sample: bool = False,
               device: torch.device | None = None) -> dict:
    """vLLM's ``propose`` arguments for requests whose rows sit at the given positions (token = 100 * request +
    position, slot = 1000 + position, hidden state = position); what the runner keeps on its device is on
    ``device`` (default: the host)."""
    lengths = [len(r) for r in rows]
    starts = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    positions = torch.tensor([p for r in rows for p in r], dtype=torch.int64)
    owners = torch.tensor([i for i, r in enumerate(rows) for _ in r])
    cad = CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts.clone(),
        seq_lens=torch.tensor([r[-1] + 1 for r in rows], dtype=torch.int32),
        num_reqs=len(rows), num_actual_tokens=int(starts[-1]), max_query_len=max(lengths),
        max_seq_len=max(r[-1] + 1 for r in rows), block_table_tensor=torch.zeros(len(rows), 4, dtype=torch.int32),
        slot_mapping=1000 + positions,
    )
    arguments = {
        "target_token_ids": 100 * owners + positions,
        "target_positions": positions,
        "target_hidden_states": positions[:, None].float().repeat(1, HIDDEN),
        "next_token_ids": torch.zeros(len(rows), dtype=torch.int64),
        "token_indices_to_sample": None,
        "common_attn_metadata": cad,
        "num_rejected_tokens_gpu": None if rejected is None else torch.tensor(rejected),
    }
    if sample:  # the last verified row of each request
        ends = starts[1:] - 1 - (torch.tensor(rejected) if rejected else 0)
        arguments["token_indices_to_sample"] = ends.to(torch.int32)
    if device is not None:
        for name in ("target_token_ids", "target_positions", "target_hidden_states", "next_token_ids",
                     "token_indices_to_sample", "num_rejected_tokens_gpu"):
            if arguments[name] is not None:
                arguments[name] = arguments[name].to(device)
        arguments["common_attn_metadata"] = cad.replace(
            query_start_loc=cad.query_start_loc.to(device), seq_lens=cad.seq_lens.to(device),
            block_table_tensor=cad.block_table_tensor.to(device), slot_mapping=cad.slot_mapping.to(device))
    return arguments


def test_kept_rows_go_in_front_of_each_requests_rows():
    deferred, live = DeferredFirstPass(), {"a", "b"}
    # step 1: a verified positions 10, 11 (its row at 12 was rejected); b is at position 5
    deferred.keep(_arguments([[10, 11, 12], [5]], rejected=[1, 0]), ["a", "b"], live)
    deferred.keep(_arguments([[12], [6]]), ["a", "b"], live)  # step 2: one row each
    out = deferred.catch_up(_arguments([[13, 14], [7]], rejected=[0, 0], sample=True), ["a", "b"], live, 100)
    cad = out["common_attn_metadata"]
    assert out["target_positions"].tolist() == [10, 11, 12, 13, 14, 5, 6, 7]
    assert out["target_token_ids"].tolist() == [10, 11, 12, 13, 14, 105, 106, 107]
    assert out["target_hidden_states"][:, 0].tolist() == [10, 11, 12, 13, 14, 5, 6, 7]
    assert cad.slot_mapping.tolist() == [1010, 1011, 1012, 1013, 1014, 1005, 1006, 1007]
    assert cad.query_start_loc_cpu.tolist() == [0, 5, 8] and cad.query_start_loc.tolist() == [0, 5, 8]
    assert cad.num_actual_tokens == 8 and cad.max_query_len == 5
    assert cad.seq_lens.tolist() == [15, 8]  # the context's end does not move
    assert out["token_indices_to_sample"].tolist() == [4, 7]  # each request's last row, moved
    assert deferred.caught_up_rows == 5 and not deferred.rows
    # nothing kept: the next step's arguments pass through unchanged
    plain = _arguments([[15], [8]])
    assert deferred.catch_up(plain, ["a", "b"], live, 100) is plain


def test_rows_that_would_leave_a_gap_are_dropped():
    deferred = DeferredFirstPass()
    deferred.keep(_arguments([[3, 4], [9]]), ["a", "b"], {"a", "b"})
    # a starts over at position 0 (preempted, recomputed); b finished
    out = deferred.catch_up(_arguments([[0, 1, 2]]), ["a"], {"a"}, 100)
    assert out["target_positions"].tolist() == [0, 1, 2]
    assert deferred.dropped_rows == 2 and not deferred.rows


def test_the_newest_rows_are_kept_when_the_buffers_are_short():
    deferred, live = DeferredFirstPass(), {"a", "b"}
    for position in range(4):
        deferred.keep(_arguments([[position], [20 + position]]), ["a", "b"], live)
    out = deferred.catch_up(_arguments([[4], [24]]), ["a", "b"], live, capacity=4)
    assert out["target_positions"].tolist() == [2, 3, 4, 22, 23, 24]
    assert deferred.dropped_rows == 4
    # a request deferred for very long keeps its newest MAX_KEPT_ROWS rows
    many = DeferredFirstPass()
    many.keep(_arguments([list(range(MAX_KEPT_ROWS + 7))]), ["a"], {"a"})
    assert many.rows["a"].start == 7 and many.rows["a"].count == MAX_KEPT_ROWS


def test_keep_and_catch_up_stay_on_the_runners_device():
    """The same steps with the runner's tensors on a second device (tests/fake_device.py): no host/device mix,
    and the same inputs as on the host."""

    def steps(device):
        deferred, live = DeferredFirstPass(), {"a", "b"}
        deferred.keep(_arguments([[10, 11, 12], [5]], rejected=[1, 0], device=device), ["a", "b"], live)
        deferred.keep(_arguments([[12], [6]], device=device), ["a", "b"], live)
        out = deferred.catch_up(_arguments([[13, 14], [7]], rejected=[0, 0], sample=True, device=device),
                                ["a", "b"], live, 100)
        cad = out["common_attn_metadata"]
        return [on_host(t).tolist() for t in (out["target_token_ids"], out["target_positions"],
                                              out["target_hidden_states"], out["token_indices_to_sample"],
                                              cad.slot_mapping, cad.query_start_loc)]

    expected = steps(None)
    with second_device() as device:
        assert steps(device) == expected
