"""A JSON-lines trace of every tree verify step, for comparing one workload across devices or builds.

Set ``VLLM_EASYSPEC_STEP_TRACE=/path/prefix`` before the engine starts; each worker process appends one line per
tree verify step to ``/path/prefix.<pid>.jsonl``: every tree request's id, prefix length ``P``, nodes and parents,
the forward's input ids and RoPE positions of its rows, the target's argmax of each of its logit rows, its output row
and its accepted branch. Off (no cost) when the variable is unset. Steps of chains only are vLLM's and not traced.

``python -m vllm_easyspec.instruments.step_trace FILE...`` checks a greedy trace against the invariants of a tree
step (:func:`trace_violations`) and prints every line that breaks one: the place to start when a device or build
gives output that differs from vanilla.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from vllm_easyspec.control.planning import node_depths
from vllm_easyspec.tree.sampling import greedy_rows

TRACE_VARIABLE = "VLLM_EASYSPEC_STEP_TRACE"


def step_trace_path() -> str | None:
    """Where this process writes its trace, or None when tracing is off."""
    prefix = os.environ.get(TRACE_VARIABLE)
    return None if not prefix else f"{prefix}.{os.getpid()}.jsonl"


def trace_tree_step(path: str, step, metadata, logits: torch.Tensor, input_ids: torch.Tensor,
                    positions: torch.Tensor, verdict, sampling_metadata) -> None:
    """Append one line for the verify step ``step`` (a ``TreeVerifyStep``) sampled into ``verdict``."""
    argmax = logits.float().argmax(-1).tolist()
    rows = len(metadata.num_draft_tokens)
    greedy, _ = greedy_rows([0.0] * rows if sampling_metadata.temperature is None else sampling_metadata.temperature.cpu(),
                            rows)
    num_drafts = list(metadata.num_draft_tokens)
    cu_sampled = metadata.cu_num_sampled_tokens.tolist()
    output = verdict.sampler_output.sampled_token_ids.tolist()
    branch = verdict.branch
    accepted: dict[int, list[tuple[int, int, int]]] = {}
    for index, column, destination, token in zip(branch.request_index.tolist(), branch.source_column.tolist(),
                                                 branch.destination.tolist(), branch.tokens.tolist(), strict=True):
        accepted.setdefault(index, []).append((column, destination, token))
    requests = []
    for index, request in enumerate(step.requests):
        first_logit = cu_sampled[request.batch_row] - (num_drafts[request.batch_row] + 1)
        rows = slice(request.query_start, request.query_start + 1 + request.num_nodes)
        requests.append({
            "req_id": request.req_id,
            "prefix_len": request.prefix_len,
            "tokens": request.tokens,
            "parents": request.parents,
            "real_nodes": request.real_nodes,  # the rest pad the tree (tree.uniform), never accepted
            "input_ids": input_ids[rows].tolist(),
            "positions": positions[rows].tolist(),
            "argmax": argmax[first_logit: first_logit + 1 + request.num_nodes],
            "output": output[request.batch_row],
            "accepted": accepted.get(index, []),  # (column, destination position, token)
            "greedy": greedy[request.batch_row],
        })
    with open(path, "a") as f:
        f.write(json.dumps({"requests": requests, "num_draft_tokens": num_drafts}) + "\n")


def greedy_outcome(tokens: list[int], parents: list[int], argmax: list[int]) -> tuple[list[int], list[int]]:
    """The greedy verdict of one tree from the target's argmax rows (root first): the accepted nodes (deepest
    fully matching path; among equally deep ones the first) and the output row (their tokens, then the bonus)."""
    matches: list[bool] = []
    for token, parent in zip(tokens, parents, strict=True):
        parent_ok = parent < 0 or matches[parent]
        matches.append(parent_ok and argmax[parent + 1] == token)
    depths = node_depths(parents)
    best = max((node for node in range(len(tokens)) if matches[node]), key=lambda n: (depths[n], -n), default=-1)
    path: list[int] = []
    node = best
    while node >= 0:
        path.append(node)
        node = parents[node]
    path.reverse()
    return path, [tokens[n] for n in path] + [argmax[best + 1]]


def trace_violations(request: dict) -> list[str]:
    """What one traced request breaks of a greedy tree step's invariants (empty if nothing): rows at RoPE positions
    ``P + depth``, input ids the root then the nodes, the output row and the branch the greedy verdict of the
    traced argmax rows, the branch moved to ``P + 1 .. P + a``."""
    tokens, parents, prefix = request["tokens"], request["parents"], request["prefix_len"]
    problems = []
    positions = [prefix] + [prefix + depth for depth in node_depths(parents)]
    if request["positions"] != positions:
        problems.append(f"positions {request['positions']} != P + depth {positions}")
    if request["input_ids"][1:] != tokens:
        problems.append(f"input ids {request['input_ids'][1:]} != nodes {tokens}")
    real = request.get("real_nodes", len(tokens))
    path, expected = greedy_outcome(tokens[:real], parents[:real], request["argmax"])
    output = [token for token in request["output"] if token >= 0]
    if output != expected:
        problems.append(f"output {output} != greedy verdict {expected}")
    branch = [tuple(move) for move in request["accepted"]]
    moves = [(node + 1, prefix + 1 + index, tokens[node]) for index, node in enumerate(path)]
    if branch != moves:
        problems.append(f"branch {branch} != (column, P + 1 + i, token) {moves}")
    return problems


def main(paths: list[str]) -> int:
    """Check the greedy requests of traces (a request sampled at T > 0 has no greedy verdict to meet); print each
    violation; exit status 1 if any."""
    bad = checked = sampled = 0
    for path in paths:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                for request in json.loads(line)["requests"]:
                    if not request.get("greedy", True):
                        sampled += 1
                        continue
                    checked += 1
                    for problem in trace_violations(request):
                        bad += 1
                        print(f"{path}:{number} {request['req_id']} (P={request['prefix_len']}): {problem}")
    print(f"{bad} violation(s) in {checked} greedy tree request(s); {sampled} sampled at T > 0 not checked")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
