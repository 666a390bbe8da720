"""Kernel checks executed by ``conftest.kernel_runner``: in-process on a GPU, or in a worker process
running Triton's interpreter on CPU. Each function builds its inputs from plain arguments (so it can be
sent to the worker) and returns plain results for the test to assert on."""

from __future__ import annotations

import math

import torch

from tests.tree.attention_reference import depth_offsets, reference_error, tree_attention_reference
from tests.tree.tree_testlib import make_paged_batch, random_parents
from vllm_easyspec.tree.attention import AttentionFeatures

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _poisoned_batch(dtype: str, block_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                    sizes: list[int], prefix_lens: list[int], seed: int, forest_request: int | None,
                    parents: list[list[int]] | None = None) -> dict:
    """``make_paged_batch`` with everything the kernel must not read poisoned: the pool blocks no request
    owns and the slots past each request's last position hold NaN, and the tree mask gets three extra
    columns, true (like every column ``>= n_b`` of request ``b``'s rows). ``parents``: the trees (else random)."""
    gen = torch.Generator().manual_seed(seed)
    if parents is None:
        parents = [random_parents(n, gen, forest=(i == forest_request)) for i, n in enumerate(sizes)]
    args = make_paged_batch(parents, prefix_lens, block_size, num_q_heads, num_kv_heads, head_dim,
                            DTYPES[dtype], seed=seed + 1)
    owned = [0] * args["key_cache"].shape[0]
    for b, (prefix, size) in enumerate(zip(prefix_lens, sizes)):
        end = prefix + size
        for logical in range(-(-end // block_size)):
            owned[int(args["block_table"][b, logical])] = min(block_size, end - logical * block_size)
    for block, used in enumerate(owned):
        args["key_cache"][block, used:] = float("nan")
        args["value_cache"][block, used:] = float("nan")
    mask = torch.ones(args["tree_mask"].shape[0], args["tree_mask"].shape[1] + 3, dtype=torch.bool)
    start = 0
    for size in sizes:
        mask[start:start + size, :size] = args["tree_mask"][start:start + size, :size]
        start += size
    args["tree_mask"] = mask
    return {k: v.to(_device()) for k, v in args.items()}


def _run_triton(args: dict, scale: float, launch: dict | None, out_dtype: torch.dtype | None = None,
                **features) -> torch.Tensor:
    """The kernel on ``args`` into a NaN-filled output (every element must be written) of ``out_dtype`` (default: the
    query's); ``features``: the kernel's ``features``, ``column_offsets``, ``first_column`` and fp8 scales."""
    from vllm_easyspec.kernels.tree_attention import TreeAttentionLaunch, tree_attention_triton

    out = torch.full(args["query"].shape, float("nan"), dtype=out_dtype or args["query"].dtype,
                     device=args["query"].device)
    sizes = args["cu_query_lens"][1:] - args["cu_query_lens"][:-1]
    result = tree_attention_triton(**args, softmax_scale=scale, out=out, max_query_len=int(sizes.max()),
                                   launch=None if launch is None else TreeAttentionLaunch(**launch), **features)
    assert result is out
    return out


def triton_attention_error(dtype: str, block_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                           sizes: list[int], prefix_lens: list[int], seed: int, scale: float,
                           forest_request: int | None = None, launch: dict | None = None) -> float:
    """Max error of the Triton kernel against the float64 reference (``reference_error``; NaN, a poisoned read,
    fails as inf). ``launch``: ``TreeAttentionLaunch`` fields forcing the splits and row tiles (default: the
    kernel's own choice)."""
    args = _poisoned_batch(dtype, block_size, num_q_heads, num_kv_heads, head_dim, sizes, prefix_lens, seed,
                           forest_request)
    out = _run_triton(args, scale, launch)
    assert out.dtype == DTYPES[dtype] and out.shape == args["query"].shape
    return reference_error(args, out, scale)


def triton_level_error(dtype: str, block_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                       size: int, width: int, prefix_lens: list[int], seed: int, scale: float,
                       launch: dict | None = None, table_blocks: int | None = None) -> float:
    """A draft level: the query rows are each request's last ``width`` tree columns (``first_column = size -
    width``), masked by their rows of the whole tree's mask. Max error against those rows of the float64
    reference for the whole tree (NaN, a poisoned read, fails as inf). ``table_blocks``: the block table cut to
    that width; rows then see only the positions before its end (the reference's mask loses the columns past it)."""
    from vllm_easyspec.kernels.tree_attention import TreeAttentionLaunch, tree_attention_triton

    args = _poisoned_batch(dtype, block_size, num_q_heads, num_kv_heads, head_dim, [size] * len(prefix_lens),
                           prefix_lens, seed, None)
    rows = torch.cat([torch.arange(b * size + size - width, (b + 1) * size) for b in range(len(prefix_lens))])
    level = dict(args, query=args["query"][rows.to(_device())], tree_mask=args["tree_mask"][rows.to(_device())],
                 cu_query_lens=torch.arange(0, (len(prefix_lens) + 1) * width, width, dtype=torch.int32,
                                            device=_device()))
    reference = {k: v.cpu() for k, v in args.items()}
    if table_blocks is not None:
        level["block_table"] = args["block_table"][:, :table_blocks].contiguous()
        columns = torch.arange(reference["tree_mask"].shape[1])
        for b, prefix in enumerate(prefix_lens):
            reference["tree_mask"][b * size:(b + 1) * size, columns >= table_blocks * block_size - prefix] = False
    out = torch.full(level["query"].shape, float("nan"), dtype=level["query"].dtype, device=_device())
    tree_attention_triton(**level, softmax_scale=scale, out=out, max_query_len=width, first_column=size - width,
                          launch=None if launch is None else TreeAttentionLaunch(**launch))
    ref = tree_attention_reference(**reference, softmax_scale=scale, out_dtype=torch.float32)[rows]
    error = (out.cpu().float() - ref).abs() / ref.abs().clamp_min(1.0)
    return error.nan_to_num(nan=float("inf")).max().item()


FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# k_scale, v_scale, q_scale: an fp8 value times 0.375 or 1.25 is exact in bf16 and fp16, so the dequantized tiles are
# the bytes' values on a GPU (round to nearest) and under the interpreter (which truncates fp32 -> bf16) alike
FP8_SCALES = (0.375, 1.25, 0.3)


def triton_fp8_errors(cache: str, dtype: str, quantized_query: bool, block_size: int, heads: tuple[int, int],
                      head_dim: int, sizes: list[int], prefix_lens: list[int], seed: int, scale: float,
                      launch: dict | None = None, features: str = "plain") -> dict:
    """The kernel over fp8 caches (``cache``: :data:`FP8`) holding K / k_scale and V / v_scale (:data:`FP8_SCALES`;
    the poisoned slots NaN), the query in ``dtype`` or, with ``quantized_query``, in fp8 as vLLM's layer quantizes it
    on CUDA (Q / q_scale, clamped), the output in ``dtype``. Errors against the float64 reference over the bytes
    dequantized (``error``), over K/V and the query before quantization (``unquantized_error``), and over the bytes
    without their scales (``unscaled_error``); ``features`` (:func:`make_features`) at the cache positions."""
    args = _poisoned_batch("float32", block_size, *heads, head_dim, sizes, prefix_lens, seed, None)
    k_scale, v_scale, q_scale = (torch.tensor(value, device=_device()) for value in FP8_SCALES)
    fp8 = dict(args, key_cache=(args["key_cache"] / k_scale).to(FP8[cache]),
               value_cache=(args["value_cache"] / v_scale).to(FP8[cache]))
    finite = torch.finfo(FP8[cache]).max
    fp8["query"] = ((args["query"] / q_scale).clamp(-finite, finite).to(FP8[cache]) if quantized_query
                    else args["query"].to(DTYPES[dtype]))
    feats = make_features(features, heads[0])
    out = _run_triton(fp8, scale, launch, DTYPES[dtype], features=feats, k_scale=k_scale, v_scale=v_scale,
                      q_scale=q_scale if quantized_query else None)
    query_scale = q_scale.double() if quantized_query else 1.0

    def error(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> float:
        return reference_error(dict(args, query=query, key_cache=key_cache, value_cache=value_cache), out, scale,
                               feats)

    return {"error": error(fp8["query"].double() * query_scale, fp8["key_cache"].double() * k_scale.double(),
                           fp8["value_cache"].double() * v_scale.double()),
            "unquantized_error": error(args["query"].to(DTYPES[dtype]), args["key_cache"], args["value_cache"]),
            "unscaled_error": error(fp8["query"].double(), fp8["key_cache"].double(), fp8["value_cache"].double())}


def triton_fp8_weight_rounding_errors(sizes: list[int], seed: int, scale: float) -> dict:
    """Trees without prefix (every row's keys in one K/V tile, so the kernel's running max is the row's max) over e4m3
    caches with an fp8 query (:func:`triton_fp8_errors`'s scales), the output in fp32. Errors against a float64
    reference that rounds each softmax weight ``p * 256`` (p relative to the row's max) to e4m3 for ``p @ V`` and
    divides by the unrounded sum, as vLLM's kernel does (``rounded_error``), and against the plain one (``error``)."""
    from tests.tree.attention_reference import gather_positions

    args = _poisoned_batch("float32", 16, 4, 2, 32, sizes, [0] * len(sizes), seed, None)
    k_scale, v_scale, q_scale = (torch.tensor(value, device=_device()) for value in FP8_SCALES)
    e4m3 = torch.float8_e4m3fn
    fp8 = dict(args, query=(args["query"] / q_scale).clamp(-448, 448).to(e4m3),
               key_cache=(args["key_cache"] / k_scale).to(e4m3), value_cache=(args["value_cache"] / v_scale).to(e4m3))
    out = _run_triton(fp8, scale, None, torch.float32, k_scale=k_scale, v_scale=v_scale, q_scale=q_scale).cpu()
    cpu = {k: v.cpu() for k, v in fp8.items()}
    query = cpu["query"].double() * FP8_SCALES[2]
    keys, values = cpu["key_cache"].double() * FP8_SCALES[0], cpu["value_cache"].double() * FP8_SCALES[1]
    rounded = torch.empty(out.shape, dtype=torch.float64)
    cu = cpu["cu_query_lens"].tolist()
    for b in range(len(sizes)):
        for t in range(cu[b], cu[b + 1]):
            branch = cpu["tree_mask"][t, :sizes[b]].nonzero()[:, 0]
            k = gather_positions(keys, cpu["block_table"][b], branch).repeat_interleave(2, 1)  # [L, Hq, D]
            v = gather_positions(values, cpu["block_table"][b], branch).repeat_interleave(2, 1)
            scores = torch.einsum("hd,lhd->hl", query[t], k) * scale
            weights = (scores - scores.max(1, keepdim=True).values).exp()
            fp8_weights = (weights * 256).float().to(e4m3).double() / 256
            rounded[t] = torch.einsum("hl,lhd->hd", fp8_weights, v) / weights.sum(1)[:, None]
    plain = dict(args, query=query, key_cache=keys, value_cache=values)
    return {"rounded_error": ((out.double() - rounded).abs() / rounded.abs().clamp_min(1.0)).max().item(),
            "error": reference_error(plain, out, scale)}


def fp8_grid_mismatches(cache: str, values: list[float]) -> list[tuple[float, float, float]]:
    """The tree kernel's fp8 rounding of ``p * P_SCALE`` under the interpreter (``_fp8_grid``) against torch's
    conversion (round to nearest even, as a GPU's): (value, grid, torch) wherever they differ."""
    import triton

    from tests.tree.fp8_grid_kernel import fp8_grid_kernel

    x = torch.tensor(values, dtype=torch.float32, device=_device())
    y = torch.empty_like(x)
    info = torch.finfo(FP8[cache])
    fp8_grid_kernel[(1,)](x, y, x.numel(), MANTISSA=-round(math.log2(info.eps)),
                      MIN_EXP=round(math.log2(info.smallest_normal)), BLOCK=triton.next_power_of_2(x.numel()))
    expected = x.to(FP8[cache]).float()
    return [(a, b, c) for a, b, c in zip(x.tolist(), y.tolist(), expected.tolist()) if b != c]


def make_features(name: str, num_q_heads: int) -> AttentionFeatures:
    """The features a test names, joined by ``+``: ``window`` (16, or ``window=N``), ``chunk`` (32, or ``chunk=N``),
    ``soft_cap`` (1.5), ``alibi`` (slopes 2^-(h+1)), ``sinks`` (-1 to 4 over the heads); ``plain``: none. Vectors on
    the kernel's device."""
    heads = torch.arange(num_q_heads, dtype=torch.float32)
    vectors = {"alibi_slopes": 2.0 ** -(heads + 1), "sinks": torch.linspace(-1.0, 4.0, num_q_heads)}
    defaults = {"window": 16, "chunk": 32, "soft_cap": 1.5, "alibi": "alibi_slopes", "sinks": "sinks"}
    fields = {}
    for part in name.split("+"):
        key, _, value = part.partition("=")
        if key == "plain":
            continue
        field = defaults[key] if key in ("alibi", "sinks") else key
        fields[field] = vectors[field].to(_device()) if field in vectors else int(value or defaults[key])
    if "soft_cap" in fields:
        fields["soft_cap"] = float(defaults["soft_cap"])
    return AttentionFeatures(**fields)


def _poison_behind_reach(args: dict, features: AttentionFeatures, offsets: torch.Tensor, first_column: int,
                         rows_per_request: list[int]) -> int:
    """NaN into every block wholly before the first position the lowest row of each request sees (behind its window,
    before its chunk: vLLM frees them, and their table entries may point at reused blocks); returns how many."""
    block_size, poisoned = args["key_cache"].shape[1], 0
    for b, (prefix, rows) in enumerate(zip(args["prefix_lens"].tolist(), rows_per_request)):
        lowest = prefix + offsets[b, first_column: first_column + rows].min()
        for logical in range(int(features.first_visible(lowest)) // block_size):
            block = int(args["block_table"][b, logical])
            args["key_cache"][block] = args["value_cache"][block] = float("nan")
            poisoned += 1
    return poisoned


def triton_feature_errors(dtype: str, block_size: int, heads: tuple[int, int], head_dim: int,
                          parents: list[list[int]], prefix_lens: list[int], seed: int, scale: float, features: str,
                          launch: dict | None = None, level_width: int | None = None, ignored: bool = False) -> dict:
    """Verify trees (request-local ``parents``, root first) under ``features`` (:func:`make_features`), each column at
    logical position ``prefix + depth``; with ``level_width``, only the last ``level_width`` columns of each (equal
    sized) tree are query rows, a draft level (``first_column = size - level_width``). Returns the kernel's error on
    those rows against the float64 reference under the features (``error``), the blocks behind each request's reach
    poisoned with NaN before the kernel runs (``poisoned``), and with ``ignored`` the error of the kernel without the
    features, run before the poisoning (``ignored_error``)."""
    sizes = [len(tree) for tree in parents]
    args = _poisoned_batch(dtype, block_size, *heads, head_dim, sizes, prefix_lens, seed, None, parents=parents)
    feats = make_features(features, heads[0])
    offsets = depth_offsets(args["tree_mask"].cpu(), args["cu_query_lens"].cpu())
    cu = args["cu_query_lens"].tolist()
    width = level_width or max(sizes)
    first_column = sizes[0] - width if level_width else 0
    rows = torch.cat([torch.arange(cu[b + 1] - width, cu[b + 1]) if level_width else torch.arange(cu[b], cu[b + 1])
                      for b in range(len(sizes))])
    run = args if not level_width else dict(
        args, query=args["query"][rows.to(_device())], tree_mask=args["tree_mask"][rows.to(_device())],
        cu_query_lens=torch.arange(0, (len(sizes) + 1) * width, width, dtype=torch.int32, device=_device()))
    reference = tree_attention_reference(**{k: v.cpu() for k, v in args.items()}, softmax_scale=scale,
                                         out_dtype=torch.float32, features=feats, column_offsets=offsets)[rows]

    def error(out: torch.Tensor) -> float:
        return ((out.cpu().float() - reference).abs() / reference.abs().clamp_min(1.0)).nan_to_num(
            nan=float("inf")).max().item()

    kernel = dict(column_offsets=offsets.to(_device()), first_column=first_column)
    result = {"ignored_error": error(_run_triton(run, scale, launch, **kernel))} if ignored else {}
    result["poisoned"] = _poison_behind_reach(args, feats, offsets, first_column,
                                              [width] * len(sizes) if level_width else sizes)
    result["error"] = error(_run_triton(run, scale, launch, features=feats, **kernel))
    return result


def triton_attention_repeat_is_bitwise(dtype: str, block_size: int, num_q_heads: int, num_kv_heads: int,
                                       head_dim: int, sizes: list[int], prefix_lens: list[int], seed: int,
                                       launch: dict | None = None) -> bool:
    """Two runs of the kernel on the same inputs give bitwise identical outputs (no race, no atomics)."""
    args = _poisoned_batch(dtype, block_size, num_q_heads, num_kv_heads, head_dim, sizes, prefix_lens, seed, None)
    first, second = (_run_triton(args, 0.3, launch) for _ in range(2))
    bits = {4: torch.int32, 2: torch.int16}[first.element_size()]
    return torch.equal(first.view(bits), second.view(bits))


def triton_compaction(caches: list[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor
                      ) -> list[torch.Tensor]:
    """Run the Triton compaction on copies of ``caches``; return them (on CPU)."""
    from vllm_easyspec.kernels.kv_compaction import compact_kv_triton

    moved = [c.clone().to(_device()) for c in caches]
    compact_kv_triton(moved, src_slots.to(_device()), dst_slots.to(_device()))
    return [c.cpu() for c in moved]
