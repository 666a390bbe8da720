"""Token trees on an M-RoPE target through ``LLM()`` (issue 70, item 1): a tiny float32 PaddleOCR-VL model (Ernie-4.5
text layers with Qwen2-VL's three-stream M-RoPE) and a text-only draft (``tests/mrope_models.py``, which also says
why not a Qwen VL model: without torchvision vLLM cannot import those).

One batch of text prompts (every stream at ``P + j``, ``mrope_position_delta`` 0) and prompts with an image (an
image of ``h x w`` merged patches takes ``h * w`` tokens but ``max(h, w)`` positions, so the text after it runs at
``P + j + delta``, ``delta = max(h, w) - h * w``: -3 and -12 here), so one verify forward holds rows of all three
deltas, greedy for 40 tokens: the output equals a vanilla engine's, branching trees were verified, and every request,
with or without an image, accepted branch nodes (not their parent's first child). A tree node sits where a chain
would put its token only if the runner moves every stream of its row by ``depth - column`` from the
``P + column + delta`` vLLM gave it: with the rows left at vLLM's linear positions every request's output differs
from vanilla here, and with the nodes put at ``P + depth`` (the delta dropped) the two image prompts' do.
"""

from __future__ import annotations

import collections

import pytest

from tests.mrope_models import IMAGE_PROMPT, build_mrope_pair, tiny_image
from vllm_easyspec.instruments.worker_extension import read_tree_stats

TREE = {"easyspec": {"tree": {"top_k": 3, "depth": 3, "budget": 8}}}
ENGINE = {"block_size": 32, "limit_mm_per_prompt": {"image": 1}}
TEXT_PROMPTS = [[1] + [3 + (i * 7 + j * 5) % 57 for j in range(20 + i)] for i in range(3)]  # ids 3-59: text only
IMAGES = [  # (text before the image, merged patches high and wide, text after it)
    ("w5 w9 w13 w17", (2, 3), "w21 w4 w8 w30 w41 w7"),
    ("w11", (4, 4), "w22 w33 w44 w55 w6 w16 w26"),
]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def mrope_pair(tiny_root):
    return build_mrope_pair(tiny_root / "mrope")


def _prompts() -> list:
    """The text prompts, then the prompts with an image."""
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=tokens) for tokens in TEXT_PROMPTS] + [
        {"prompt": f"{before} {IMAGE_PROMPT} {after}", "multi_modal_data": {"image": tiny_image(*size, seed=i)}}
        for i, (before, size, after) in enumerate(IMAGES)]


def _greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(output.outputs[0].token_ids) for output in llm.generate(_prompts(), params, use_tqdm=False)]


def record_requests(worker) -> None:
    """From now on, the runner records each new request's ``mrope_position_delta`` (as vLLM computes it) and in
    how many steps its accepted branch held a node that is not its parent's first child."""
    runner, verifier = worker.model_runner, worker.model_runner.tree_verifier
    runner.recorded = {"delta": {}, "off_top_path_steps": collections.Counter()}
    init, record_branch = runner._init_mrope_positions, verifier.record_branch

    def recording_delta(request_state):
        init(request_state)
        runner.recorded["delta"][request_state.req_id] = request_state.mrope_position_delta

    def recording_branch(step, branch):
        record_branch(step, branch)
        runner.recorded["off_top_path_steps"].update(step.requests[index].req_id
                                                     for index in step.left_the_top_path(branch))

    runner._init_mrope_positions = recording_delta
    verifier.record_branch = recording_branch


def read_requests(worker) -> dict:
    return worker.model_runner.recorded


def test_greedy_trees_equal_vanilla_on_an_m_rope_target_with_text_and_image_prompts(llm_pool, mrope_pair):
    target, draft = mrope_pair
    vanilla = llm_pool.get(target, **ENGINE)
    assert vanilla.llm_engine.model_config.uses_mrope
    expected = _greedy(vanilla)
    llm = llm_pool.get(target, **ENGINE, additional_config=TREE,
                       speculative_config={"method": "draft_model", "model": str(draft)})
    llm.collective_rpc(record_requests)
    before = llm.collective_rpc(read_tree_stats)[0]
    assert _greedy(llm) == expected
    stats = {key: value - before[key] for key, value in llm.collective_rpc(read_tree_stats)[0].items()
             if isinstance(value, int)}
    assert stats["tree_requests"] - stats["path_requests"] > 0, stats  # branching trees were verified
    recorded = llm.collective_rpc(read_requests)[0]
    # text at delta 0, an image of h x w merged patches: delta max(h, w) - h * w (-3 and -12)
    assert sorted(recorded["delta"].values()) == sorted([0] * len(TEXT_PROMPTS) + [max(h, w) - h * w
                                                                                   for _, (h, w), _ in IMAGES])
    # every request, with and without an image, accepted branch nodes (not their parent's first child)
    assert all(recorded["off_top_path_steps"][req_id] > 0 for req_id in recorded["delta"]), recorded
