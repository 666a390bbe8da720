"""CPU tree attention: prefix-once + tree-part + log-sum-exp merge vs naive gather-plus-SDPA per node.

Usage:  python -m benchmarks kernels [--repeats 15] [--dtype float32] [--threads 1] [--prefix-lens 256 1024 4096]

One request with a 16-token tree (the root plus 15 draft nodes, EAGLE-like shape, depth 5) over a
paged KV cache (block size 16, blocks shuffled), Llama-3-8B attention shape (32 query heads, 8 KV
heads, head size 128), prefix lengths 256 / 1024 / 4096. Reports the median wall time of each
implementation and the max abs difference between them. Writes
``benchmarks/results/tree_attention_cpu.{md,json}``. The engine does not use this path; the Triton kernel it
serves on GPUs is timed by ``python -m benchmarks kernels gpu`` (``benchmarks.kernels.gpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from benchmarks.harness.paged_tree_attention import tree_attention_cpu, tree_attention_naive
from benchmarks.harness.report import command_line
from benchmarks.harness.setups import RESULTS_DIR
from vllm_easyspec.tree.building import TokenTreeBatch

# root, then 15 nodes: 3 root children, 2 grandchildren each ... (parents are query indices)
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 3, 4, 4, 5, 6, 8, 9, 12, 13]


def build_inputs(prefix_len: int, dtype: torch.dtype, seed: int = 0, block_size: int = 16,
                 num_q_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128) -> dict:
    gen = torch.Generator().manual_seed(seed)
    n = len(TREE_PARENTS)
    num_blocks = -(-(prefix_len + n) // block_size)
    pool = num_blocks + 4
    block_table = torch.randperm(pool, generator=gen)[:num_blocks].int()[None]
    shape = (pool, block_size, num_kv_heads, head_dim)
    cu = torch.tensor([0, n], dtype=torch.int32)
    return dict(
        query=torch.randn(n, num_q_heads, head_dim, generator=gen).to(dtype),
        key_cache=torch.randn(shape, generator=gen).to(dtype),
        value_cache=torch.randn(shape, generator=gen).to(dtype),
        block_table=block_table,
        prefix_lens=torch.tensor([prefix_len], dtype=torch.int32),
        cu_query_lens=cu,
        tree_mask=TokenTreeBatch(torch.zeros(1, n, dtype=torch.long), torch.tensor([TREE_PARENTS]), torch.tensor([n]),
                                 "without_replacement").ancestor_mask()[0],  # query j's ancestors and itself
        softmax_scale=head_dim**-0.5,
    )


def median_ms(fn, args: dict, repeats: int) -> float:
    fn(**args)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(**args)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str], prog: str = "python -m benchmarks kernels") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: the 2-core machine is shared, and more threads "
                             "than free cores makes OpenMP timings meaningless)")
    parser.add_argument("--prefix-lens", type=int, nargs="+", default=[256, 1024, 4096])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rows = []
    for prefix_len in args.prefix_lens:
        inputs = build_inputs(prefix_len, dtype)
        naive_ms = median_ms(tree_attention_naive, inputs, args.repeats)
        cpu_ms = median_ms(tree_attention_cpu, inputs, args.repeats)
        diff = (tree_attention_cpu(**inputs).float() - tree_attention_naive(**inputs).float()).abs().max().item()
        rows.append(dict(prefix_len=prefix_len, tree_tokens=len(TREE_PARENTS), naive_ms=round(naive_ms, 3),
                         cpu_path_ms=round(cpu_ms, 3), speedup=round(naive_ms / cpu_ms, 2), max_abs_diff=diff))
        print(rows[-1], flush=True)
    env = dict(torch=torch.__version__, threads=torch.get_num_threads(), dtype=args.dtype,
               cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
               load_average=[round(x, 2) for x in os.getloadavg()], repeats=args.repeats,
               shape="1 request, 32 q heads, 8 kv heads, head size 128, block size 16")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "tree_attention_cpu.json").write_text(json.dumps(dict(env=env, rows=rows), indent=2) + "\n")
    lines = [
        "# CPU tree attention: prefix once + tree part + LSE merge vs naive per-node gather + SDPA",
        "",
        f"Command: `{command_line('kernels', argv)}`",
        f"Environment: torch {env['torch']}, {env['threads']} threads, {env['cores']} cores, "
        f"load average at the end {env['load_average']} (shared machine: timings are noisy). "
        f"Shape: {env['shape']}; tree of {len(TREE_PARENTS)} query tokens (root + 15 nodes, depth 5). "
        f"Median of {args.repeats} runs.",
        "",
        "| prefix | naive gather+SDPA (ms) | CPU path (ms) | speed-up | max abs diff |",
        "|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['prefix_len']} | {r['naive_ms']:.2f} | {r['cpu_path_ms']:.2f} | {r['speedup']:.1f}x | "
              f"{r['max_abs_diff']:.1e} |" for r in rows]
    (RESULTS_DIR / "tree_attention_cpu.md").write_text("\n".join(lines) + "\n")

