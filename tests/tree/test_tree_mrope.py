"""Tree rows of an M-RoPE target (Qwen VL) get the positions vLLM would give the same tokens in a chain (issue 70,
item 1): vLLM fills each verify row ``P + j`` with its three streams ``P + j + mrope_position_delta``
(``MRotaryEmbedding.get_next_input_positions_tensor``); the runner moves every stream of a tree row by
``depth - column``, so a node at depth ``d`` sits at ``P + d + delta`` in all three, and the commit moves them back
before the drafter reads the accepted branch at its linear positions."""

from __future__ import annotations

import types

import numpy as np
import torch

from vllm_easyspec.integration.runner import TreeRunnerMixin
from vllm_easyspec.integration.tree_step import TreeVerifyForward
from vllm_easyspec.tree.verify_step import TreeRequest, TreeVerifyStep


def _step_and_vllms_positions(delta: int):
    """Two tree requests after a prefill row: request A (P = 9) with a branching tree, request B (P = 30) a path."""
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

    requests = [TreeRequest(batch_row=0, query_start=1, prefix_len=9, tokens=[5, 6, 7, 8], parents=[-1, -1, 0, 1]),
                TreeRequest(batch_row=1, query_start=6, prefix_len=30, tokens=[4, 4], parents=[-1, 0])]
    mrope = np.full((3, 9), -100, dtype=np.int64)  # row 0 belongs to another request
    for request in requests:
        MRotaryEmbedding.get_next_input_positions_tensor(out=mrope, out_offset=request.query_start,
                                                         mrope_position_delta=delta, context_len=request.prefix_len,
                                                         num_new_tokens=1 + request.num_nodes)
    return TreeVerifyStep(requests), torch.from_numpy(mrope)


def test_tree_rows_take_a_chains_m_rope_positions_and_the_commit_restores_vllms():
    delta = -7  # an image earlier in the prompt: text after it runs behind its token index
    step, vllms = _step_and_vllms_positions(delta)
    runner = types.SimpleNamespace(mrope_positions=types.SimpleNamespace(gpu=vllms.clone()))
    forward = TreeVerifyForward(step)
    forward.mrope_shift = step.row_shifts()
    TreeRunnerMixin._shift_mrope_positions(runner, *forward.mrope_shift)
    moved = runner.mrope_positions.gpu
    # A: root at 9, nodes at depths 1, 1, 2, 2; B: a path, unchanged; the other request's row untouched
    assert moved[:, 1:6].tolist() == [[9 + delta, 10 + delta, 10 + delta, 11 + delta, 11 + delta]] * 3
    assert torch.equal(moved[:, 6:9], vllms[:, 6:9]) and torch.equal(moved[:, 0], vllms[:, 0])
    rows, positions = step.row_positions()
    assert torch.equal(moved[:, rows], (positions + delta)[None].expand(3, -1))  # the positions a chain would give
    TreeRunnerMixin._shift_mrope_positions(runner, forward.mrope_shift[0], -forward.mrope_shift[1])
    assert torch.equal(runner.mrope_positions.gpu, vllms)
