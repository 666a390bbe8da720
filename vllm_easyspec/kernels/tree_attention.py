"""Triton tree attention over vLLM's paged KV cache (FlashAttention layout), split over the KV length.

Contract (``vllm_easyspec/kernels/README.md`` states it with the design, the read count and the launch rules):
``query`` ``[T, Hq, D]``, request ``b`` owning rows ``cu_query_lens[b]:cu_query_lens[b + 1]``; ``key_cache`` /
``value_cache`` ``[num_blocks, block_size, Hkv, D]`` and ``block_table`` ``[B, max_blocks]`` int32, any strides
except that the head dimension of ``query``, the caches and ``out`` is contiguous; request-local query ``j`` is
tree column ``c = first_column + j`` and its K/V is already in the cache at logical position ``prefix_lens[b] + c``,
as are the columns before it; ``tree_mask`` ``[T, W]`` (bool / uint8): ``tree_mask[t, c]`` iff column ``c`` is an
ancestor of row ``t`` or ``t`` itself (diagonal included; only columns ``c < first_column + n_b`` are read). Row
``t`` attends to its request's whole prefix plus the tree positions its mask allows; softmax in fp32, output in
``out``'s dtype; ``Hq`` a multiple of ``Hkv``. Positions past ``prefix_lens[b] + first_column + n_b`` and their
block-table entries are never read, nor positions past the block table's width. No atomics: repeated runs are
bitwise identical. A verify forward's rows are the whole tree (``first_column`` 0); a draft level's rows are its
frontier, the last columns of the tree so far.

Features (the layer's ``AttentionFeatures``, as vLLM's Triton attention computes a causal row at the same logical
position): tree column ``c`` is at logical position ``prefix_lens[b] + column_offsets[b, c]``, a prefix key at its
cache position; a row sees a key iff its mask (or the prefix) allows it and the key is within its window and its
chunk; the scaled score is soft-capped before masking, ALiBi's ``slope[h] * (key - query)`` added after, and each
head's sink is one more logit of the softmax. Positions before the first one a row tile's lowest row sees, and
their block-table entries (vLLM frees the blocks behind a window), are never read. Plain layers compile to the
kernel without features.

fp8 caches (float8 views of K / k_scale, V / v_scale; the scales one-element device tensors) are read as vLLM's Triton
attention reads them: dequantized into a plain query's dtype, or, for a float8 query (q_scale), multiplied in fp8 with
the scales on the score and the output and the softmax weights rounded to fp8 for ``p @ V``. Unquantized caches
compile to the kernel without any of it.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_easyspec.tree.attention import PLAIN, AttentionFeatures

# Streaming multiprocessors assumed where no GPU can be asked (CPU tensors under Triton's interpreter):
# an H100's, so interpreter runs take the launch an H100 would.
NOMINAL_SM_COUNT = 132
NOMINAL_SHARED_MEMORY = 227 * 1024  # shared memory per program assumed there (the H100's opt-in limit)
# Fraction of a device's shared memory per program that the launch estimate may plan to use; the rest is
# left for what the estimate leaves out (block-table tiles, reduction scratch, layout conversions).
SHARED_MEMORY_MARGIN = 0.75
MAX_SPLITS = 64  # at most this many KV splits: the merge kernel holds all splits of a head in registers
WAVE_EFFICIENCY_TOLERANCE = 0.85  # of the best wave efficiency, the split count must reach (FA-2's heuristic)


@dataclass(frozen=True)
class TreeAttentionLaunch:
    """Launch parameters of :func:`tree_attention_triton` (see :func:`choose_launch`).

    Invariants: ``block_m``, ``block_n`` powers of two ``>= 16``; ``num_splits >= 1``;
    ``min_split_len`` a positive multiple of ``block_n``.
    """

    block_m: int  # rows (query token x query head of the group) per program
    block_n: int  # KV positions per inner iteration
    num_splits: int  # KV ranges per (request, KV head, row tile)
    min_split_len: int  # positions a KV range covers at least
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        if self.min_split_len <= 0 or self.min_split_len % self.block_n:
            raise ValueError(f"min_split_len ({self.min_split_len}) must be a positive multiple of "
                             f"block_n ({self.block_n})")


def _shared_memory_bytes(block_m: int, block_n: int, block_d: int, num_stages: int, element_size: int) -> int:
    """Estimated shared memory of one program: the query tile plus ``num_stages`` buffered K and V tiles."""
    return element_size * block_d * (block_m + 2 * num_stages * block_n)


def _split_count(programs_per_split: int, sm_count: int, max_splits: int) -> int:
    """FlashAttention-2's split heuristic: the fewest splits whose wave efficiency (programs over whole
    waves of ``sm_count``) reaches ``WAVE_EFFICIENCY_TOLERANCE`` of the best; 1 when the unsplit grid
    already nearly fills the device."""
    if programs_per_split >= 0.8 * sm_count or max_splits <= 1:
        return 1

    def efficiency(splits: int) -> float:
        waves = programs_per_split * splits / sm_count
        return waves / math.ceil(waves)

    best = max(efficiency(s) for s in range(1, max_splits + 1))
    return next(s for s in range(1, max_splits + 1) if efficiency(s) >= WAVE_EFFICIENCY_TOLERANCE * best)


@functools.cache
def choose_launch(*, batch: int, num_kv_heads: int, group: int, max_query_len: int, kv_len_bound: int,
                  head_dim: int, element_size: int, sm_count: int, shared_memory: int) -> TreeAttentionLaunch:
    """Launch parameters from the shape alone (host values only: no device-to-host sync). A pure function of
    its arguments, cached: every layer of a forward pass asks again with the same shape. ``BLOCK_M`` holds one
    request's ``max_query_len * group`` rows (16 to 128, 64 for fp32, within 64 accumulator registers per thread);
    ``num_splits`` is FlashAttention-2's wave-efficiency heuristic, at most :data:`MAX_SPLITS` and
    ``kv_len_bound / min_split_len`` (``kv_len_bound``: the block table's width in positions); ``min_split_len`` is
    at least ``BLOCK_M`` so a split writes no more fp32 partials than it reads 16-bit K/V; ``num_stages``, then
    ``BLOCK_N``, then ``BLOCK_M`` shrink until the estimated shared memory fits :data:`SHARED_MEMORY_MARGIN` of
    ``shared_memory`` (the exact rules: ``kernels/README.md``).
    """
    rows = max(1, max_query_len * group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = min(max(16, triton.next_power_of_2(rows)), 64 if element_size >= 4 else 128)
    while block_m > 16 and block_m * block_d > 128 * 128:
        block_m //= 2
    num_warps = 8 if block_m * block_d >= 128 * 128 else 4
    row_tiles = triton.cdiv(rows, block_m)
    block_n = 32 if element_size >= 4 else 64
    min_split_len = triton.cdiv(max(128, block_m), block_n) * block_n
    max_splits = min(MAX_SPLITS, max(1, kv_len_bound // min_split_len))
    num_splits = _split_count(batch * num_kv_heads * row_tiles, sm_count, max_splits)
    budget = SHARED_MEMORY_MARGIN * shared_memory
    if element_size < 4 and block_m <= 64 and kv_len_bound >= 512 * num_splits:
        if _shared_memory_bytes(block_m, 128, block_d, 2, element_size) <= budget:
            block_n = 128
            min_split_len = triton.cdiv(min_split_len, block_n) * block_n
    num_stages = 3
    while _shared_memory_bytes(block_m, block_n, block_d, num_stages, element_size) > budget:
        if num_stages > 1:
            num_stages -= 1
        elif block_n > 16:
            block_n //= 2
        elif block_m > 16:
            block_m //= 2
        else:
            break
    return TreeAttentionLaunch(block_m=block_m, block_n=block_n, num_splits=num_splits,
                               min_split_len=min_split_len, num_warps=num_warps, num_stages=num_stages)


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table_row_ptr, pos, pos_ok, kv_head, d, d_ok,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, k_scale, v_scale,
                  KV_BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr, DEQUANTIZE: tl.constexpr, Q_DTYPE: tl.constexpr):
    """K as ``[BLOCK_D, BLOCK_N]`` and V as ``[BLOCK_N, BLOCK_D]`` at logical positions ``pos`` of one request
    (block-table lookup per position, so any block size works); positions with ``pos_ok`` false are
    neither looked up nor read (0). ``DEQUANTIZE`` (fp8 cache, unquantized query): ``(x.to(fp32) * scale)`` in the
    query's dtype, as vLLM's ``_cast_kv_tile``."""
    block = tl.load(block_table_row_ptr + pos // KV_BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    slot = pos % KV_BLOCK_SIZE
    k = tl.load(k_cache_ptr + block[None, :] * stride_kb + slot[None, :] * stride_ks + kv_head * stride_kh
                + d[:, None], mask=pos_ok[None, :] & d_ok[:, None], other=0.0)
    v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
                + d[None, :], mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
    if DEQUANTIZE:
        k = (k.to(tl.float32) * k_scale).to(Q_DTYPE)
        v = (v.to(tl.float32) * v_scale).to(Q_DTYPE)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _fp8_grid(x, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """fp32 ``x >= 0`` rounded to nearest even on the grid of a float8 format (``MANTISSA`` bits, least normal
    exponent ``MIN_EXP``; no overflow), in fp32: how a GPU converts, where the interpreter's conversion misrounds."""
    exponent = tl.maximum((x.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 + MIN_EXP)
    step = ((exponent - MANTISSA) << 23).to(tl.float32, bitcast=True)
    return (x + step * 12582912.0) - step * 12582912.0  # 1.5 * 2^23 steps: fp32 addition rounds to the grid


@triton.jit
def _online_softmax_step(q, k, v, allowed, bias, m_i, l_i, acc, scale_log2, soft_cap_log2,
                         DOT_PRECISION: tl.constexpr, SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr,
                         P_SCALE: tl.constexpr, P_MANTISSA: tl.constexpr, P_MIN_EXP: tl.constexpr):
    """Fold one K/V tile into the running base-2 max ``m_i``, sum ``l_i`` and unnormalised ``acc``. As vLLM's Triton
    attention: the scaled score soft-capped (``SOFT_CAP``; tanh through exp, as its ``apply_softcap``), masked to
    ``-inf`` where ``allowed`` (broadcast to ``[BLOCK_M, BLOCK_N]``) is false, then ``bias`` (ALiBi) added; all in
    base 2. A row with nothing allowed so far keeps ``m_i = -inf``, ``l_i = 0``, ``acc = 0``. ``P_SCALE`` (fp8
    queries): ``p * P_SCALE`` rounded to the fp8 V's dtype for ``p @ v``, divided out after, as vLLM's kernel does;
    ``P_MANTISSA`` > 0 (interpreter only) rounds to the grid of that many mantissa bits and least normal exponent
    ``P_MIN_EXP`` in fp32 instead."""
    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
    if SOFT_CAP:
        scores = soft_cap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * scores / soft_cap_log2) + 1.0))
    scores = tl.where(allowed, scores, float("-inf"))
    if ALIBI:
        scores += bias
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if P_SCALE == 1:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    else:
        p = p * P_SCALE
        p = p.to(v.dtype) if P_MANTISSA == 0 else _fp8_grid(p, P_MANTISSA, P_MIN_EXP)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION) / P_SCALE
    return m_new, l_i, acc


@triton.jit
def _visible(key_pos, allowed, row_first, q_pos, slope, POSITIONS: tl.constexpr, ALIBI: tl.constexpr):
    """``allowed`` narrowed to the keys each row sees (logical ``key_pos`` from the row's ``row_first`` on; the
    callers pass only keys at or before the row), and the base-2 ALiBi term ``slope * (key - query)``."""
    bias = 0.0
    if POSITIONS:
        allowed = allowed & (key_pos[None, :] >= row_first[:, None])
    if ALIBI:
        bias = slope[:, None] * (key_pos[None, :] - q_pos[:, None]).to(tl.float32)
    return allowed, bias


@triton.jit
def _tree_attention_kernel(out_ptr, partial_acc_ptr, partial_stats_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                           block_table_ptr, prefix_lens_ptr, cu_q_ptr, mask_ptr, offsets_ptr, slopes_ptr, sinks_ptr,
                           k_scale_ptr, v_scale_ptr, q_scale_ptr, scale_log2, soft_cap_log2, window, chunk,
                           stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb,
                           stride_vs, stride_vh, stride_bt, stride_mt, stride_ob, stats_plane, num_kv_heads, row_tiles,
                           num_splits, min_split_len, first_column, kv_len_bound, KV_BLOCK_SIZE: tl.constexpr,
                           GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, UPCAST: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, POSITIONS: tl.constexpr, SOFT_CAP: tl.constexpr,
                           ALIBI: tl.constexpr, SINKS: tl.constexpr, FP8_KV: tl.constexpr, FP8_Q: tl.constexpr,
                           P_SCALE: tl.constexpr, P_MANTISSA: tl.constexpr, P_MIN_EXP: tl.constexpr):
    """One row tile of one (request, KV head) against one KV range (the design in kernels/README.md).

    ``SPLIT``: write the unnormalised accumulator to ``partial_acc [T, Hq, num_splits, HEAD_DIM]`` and the
    base-2 running max / sum to ``partial_stats [2, T, Hq, num_splits]`` (planes ``stats_plane`` apart);
    otherwise write the normalised output to ``out`` (with each head's sink, ``SINKS``). Rows whose KV range is
    empty record max ``-inf``, sum 0 and no accumulator. ``POSITIONS`` (windows, chunks, ALiBi): row ``j`` is at
    logical position ``prefix + offsets[first_column + j]``, tree column ``c`` at ``prefix + offsets[c]``, prefix
    keys at their cache positions; the ranges start at the first position the tile's lowest row sees. ``FP8_KV``:
    the cache holds K / k_scale, V / v_scale in fp8 (scales: device scalars); ``FP8_Q``: so does the query (q_scale),
    and, as vLLM's kernel, the scales multiply the score and the output, not the tiles (``_online_softmax_step``).
    """
    pid = tl.program_id(0)
    row_tile = pid % row_tiles
    rest = pid // row_tiles
    split = rest % num_splits
    rest = rest // num_splits
    kv_head = rest % num_kv_heads
    req = rest // num_kv_heads
    q_start = tl.load(cu_q_ptr + req)
    n_q = tl.load(cu_q_ptr + req + 1) - q_start
    first_row = row_tile * BLOCK_M
    if first_row < n_q * GROUP:
        prefix = tl.load(prefix_lens_ptr + req)
        rows = first_row + tl.arange(0, BLOCK_M)
        local_q = rows // GROUP
        row_ok = local_q < n_q
        q_head = kv_head * GROUP + rows % GROUP
        token = (q_start + local_q).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        # query j sits at tree column first_column + j; the tile's last query is its last visible position
        # (ancestors precede descendants)
        row_start = prefix + first_column
        # ... and never past the block table (a draft level's rows beyond the model's length see less)
        kv_end = tl.minimum(row_start + tl.minimum(n_q, (first_row + BLOCK_M - 1) // GROUP + 1), kv_len_bound)
        offsets_row_ptr = offsets_ptr + req * stride_ob
        base = 0  # the first position any row of the tile sees
        q_pos = local_q  # with row_first, read only with POSITIONS
        row_first = local_q
        if POSITIONS:
            q_pos = prefix + tl.load(offsets_row_ptr + first_column + local_q, mask=row_ok, other=0)
            row_first = tl.maximum(tl.maximum(q_pos - window + 1, q_pos // chunk * chunk), 0)
            # nothing before it is read: vLLM frees the blocks behind a window, their table entries may be reused
            base = tl.min(tl.where(row_ok, row_first, kv_len_bound), 0)
        slope = 0.0
        if ALIBI:
            slope = tl.load(slopes_ptr + q_head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        split_len = tl.maximum(min_split_len,
                               tl.cdiv(tl.cdiv(row_start + n_q - base, num_splits), BLOCK_N) * BLOCK_N)
        lo = base + split * split_len
        hi = tl.minimum(lo + split_len, kv_end)
        # rows whose own position is not before the range: only they can see a position of it
        row_sees_range = row_ok & (row_start + local_q >= lo)
        q = tl.load(q_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh + d[None, :],
                    mask=row_sees_range[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        k_scale = 1.0
        v_scale = 1.0
        if FP8_KV:
            k_scale = tl.load(k_scale_ptr)
            v_scale = tl.load(v_scale_ptr)
        if FP8_Q:
            scale_log2 = scale_log2 * tl.load(q_scale_ptr) * k_scale
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # prefix positions [lo, min(hi, prefix)): every row sees all of them (within its window or chunk)
        prefix_hi = tl.minimum(hi, prefix)
        kv_row_ptr = block_table_ptr + req * stride_bt
        for start in range(lo, prefix_hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_ok = pos < prefix_hi
            k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, kv_row_ptr, pos, pos_ok, kv_head, d, d_ok,
                                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, k_scale, v_scale,
                                 KV_BLOCK_SIZE, UPCAST, FP8_KV and not FP8_Q, q_ptr.dtype.element_ty)
            allowed, bias = _visible(pos, pos_ok[None, :], row_first, q_pos, slope, POSITIONS, ALIBI)
            m_i, l_i, acc = _online_softmax_step(q, k, v, allowed, bias, m_i, l_i, acc, scale_log2, soft_cap_log2,
                                                 DOT_PRECISION, SOFT_CAP, ALIBI, P_SCALE, P_MANTISSA, P_MIN_EXP)

        # tree positions [max(lo, prefix), hi): tree_mask decides per row
        for start in range(tl.maximum(lo, prefix), hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_ok = pos < hi
            k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, kv_row_ptr, pos, pos_ok, kv_head, d, d_ok,
                                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, k_scale, v_scale,
                                 KV_BLOCK_SIZE, UPCAST, FP8_KV and not FP8_Q, q_ptr.dtype.element_ty)
            allowed = tl.load(mask_ptr + token[:, None] * stride_mt + (pos - prefix)[None, :],
                              mask=row_ok[:, None] & pos_ok[None, :], other=0)
            key_pos = pos
            if POSITIONS:
                key_pos = prefix + tl.load(offsets_row_ptr + pos - prefix, mask=pos_ok, other=0)
            allowed, bias = _visible(key_pos, allowed != 0, row_first, q_pos, slope, POSITIONS, ALIBI)
            m_i, l_i, acc = _online_softmax_step(q, k, v, allowed, bias, m_i, l_i, acc, scale_log2, soft_cap_log2,
                                                 DOT_PRECISION, SOFT_CAP, ALIBI, P_SCALE, P_MANTISSA, P_MIN_EXP)

        if FP8_Q:
            acc = acc * v_scale
        if SPLIT:
            part = (token * (num_kv_heads * GROUP) + q_head) * num_splits + split
            tl.store(partial_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                     mask=row_sees_range[:, None] & d_ok[None, :])
            tl.store(partial_stats_ptr + part, m_i, mask=row_ok)
            tl.store(partial_stats_ptr + stats_plane + part, l_i, mask=row_ok)
        else:
            if SINKS:  # one more base-2 logit per head, with a zero value: in the denominator only
                sink = tl.load(sinks_ptr + q_head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
                m_new = tl.maximum(m_i, sink)
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.exp2(sink - m_new)
                acc = acc * alpha[:, None]
            acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + token[:, None] * stride_ot + q_head[:, None] * stride_oh + d[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(out_ptr, partial_acc_ptr, partial_stats_ptr, sinks_ptr, stride_ot, stride_oh, stats_plane,
                         num_q_heads, num_splits, HEADS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    """Log-sum-exp merge of ``num_splits`` partial results for ``HEADS`` query heads of one token.

    Splits whose max is ``-inf`` (no visible position in their range) get weight 0 and their accumulator,
    possibly never written, is not read. A row with no visible position at all is written as 0. ``SINKS``: each
    head's sink is one more term (max ``sink * log2(e)``, sum 1, no accumulator).
    """
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    splits = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    part = (token * num_q_heads + heads[:, None]) * num_splits + splits[None, :]
    part_ok = (heads < num_q_heads)[:, None] & (splits < num_splits)[None, :]
    m = tl.load(partial_stats_ptr + part, mask=part_ok, other=float("-inf"))
    sums = tl.load(partial_stats_ptr + stats_plane + part, mask=part_ok, other=0.0)
    m_max = tl.max(m, 1)
    if SINKS:
        sink = tl.load(sinks_ptr + heads, mask=heads < num_q_heads, other=0.0).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_safe[:, None])
    denominator = tl.sum(weight * sums, 1)
    if SINKS:
        denominator += tl.exp2(sink - m_safe)
    acc = tl.load(partial_acc_ptr + part[:, :, None] * HEAD_DIM + d[None, None, :],
                  mask=(weight > 0.0)[:, :, None] & (d < HEAD_DIM)[None, None, :], other=0.0)
    merged = tl.sum(acc * weight[:, :, None], 1) / tl.where(denominator == 0.0, 1.0, denominator)[:, None]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
             merged.to(out_ptr.dtype.element_ty), mask=(heads < num_q_heads)[:, None] & (d < HEAD_DIM)[None, :])


FP32_DOT_PRECISIONS = ("ieee", "tf32", "tf32x3")


def triton_default_fp32_precision(device: torch.device | str) -> str:
    """The precision ``tl.dot`` uses for float32 operands when the call names none, on ``device``: Triton's
    ``TRITON_F32_DEFAULT`` if set, else TF32 on NVIDIA GPUs, else IEEE.

    vLLM's Triton attention (``unified_attention``) calls ``tl.dot`` without a precision, so on an NVIDIA GPU
    a float32 model attends in TF32 (about 1e-3 relative error). Tree rows must be computed the same way,
    or a float32 greedy step decides a near-tie differently from the step without speculation.
    """
    chosen = os.environ.get("TRITON_F32_DEFAULT")
    if chosen:
        if chosen not in FP32_DOT_PRECISIONS:
            raise ValueError(f"TRITON_F32_DEFAULT={chosen!r}: the tree kernel supports {FP32_DOT_PRECISIONS}.")
        return chosen
    device = torch.device(device)
    return "tf32" if device.type == "cuda" and torch.version.hip is None else "ieee"


def _is_interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


@functools.cache
def _device_limits(device: torch.device) -> tuple[int, int]:
    """(SM count, shared memory per program in bytes) of ``device``; nominal H100 values off-GPU."""
    if device.type != "cuda":
        return NOMINAL_SM_COUNT, NOMINAL_SHARED_MEMORY
    props = torch.cuda.get_device_properties(device)
    shared = getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block
    return props.multi_processor_count, shared


def _check_arguments(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, tree_mask: torch.Tensor,
                     out: torch.Tensor | None, fp32_precision: str) -> None:
    if fp32_precision not in FP32_DOT_PRECISIONS:
        raise ValueError(f"fp32_precision must be one of {FP32_DOT_PRECISIONS}; got {fp32_precision!r}.")
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of KV heads ({key_cache.shape[2]}).")
    if query.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("query, key_cache and value_cache need a contiguous last (head_size) dimension.")
    if tree_mask.shape[0] != query.shape[0]:
        raise ValueError(f"tree_mask must have one row per query token ({query.shape[0]}); got {tree_mask.shape[0]}.")
    if out is not None and out.stride(-1) != 1:
        raise ValueError("out needs a contiguous last (head_size) dimension.")
    if out is None and query.dtype in FP8_DTYPES:
        raise ValueError("a float8 query needs out, in the dtype attention's output takes.")


def _merge_splits(out: torch.Tensor, partial_acc: torch.Tensor, partial_stats: torch.Tensor, num_splits: int,
                  block_d: int, sinks: torch.Tensor | None) -> None:
    """Launches :func:`_merge_splits_kernel` over every (token, block of query heads) of ``out``."""
    num_tokens, num_q_heads, head_dim = out.shape
    block_s = triton.next_power_of_2(num_splits)
    heads_per_program = max(1, min(triton.next_power_of_2(num_q_heads), 8192 // (block_s * block_d)))
    _merge_splits_kernel[(num_tokens, triton.cdiv(num_q_heads, heads_per_program))](
        out, partial_acc, partial_stats, partial_stats if sinks is None else sinks, out.stride(0), out.stride(1),
        partial_stats[0].numel(), num_q_heads, num_splits,
        HEADS=heads_per_program, BLOCK_S=block_s, HEAD_DIM=head_dim, BLOCK_D=block_d, SINKS=sinks is not None,
        num_warps=8 if heads_per_program * block_s * block_d > 8192 else 4,
    )


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _fp8_arguments(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scales: tuple,
                   block_n: int, interpreted: bool, dummy: torch.Tensor) -> tuple[tuple, dict]:
    """fp8 caches (float8 views, as vLLM's backends pass them) need ``k_scale`` and ``v_scale``, a float8 query (of the
    caches' dtype) ``q_scale`` and ``out``: vLLM's layer's one-element scale tensors, read on the device. Returns their
    pointers (``dummy`` for those not given: never read) and the kernel's flags: ``FP8_KV``, ``FP8_Q``, ``P_SCALE``
    (fp8 queries: vLLM's 256 for e4m3fn, else 128) and the interpreter's rounding grid of ``p * P_SCALE``
    (``P_MANTISSA`` 0 on a GPU: the hardware rounds)."""
    k_scale, v_scale, q_scale = scales
    fp8_kv, fp8_q = key_cache.dtype in FP8_DTYPES, query.dtype in FP8_DTYPES
    if value_cache.dtype != key_cache.dtype or fp8_kv != (k_scale is not None) or fp8_kv != (v_scale is not None):
        raise ValueError(f"k_scale and v_scale are given exactly for fp8 caches, both of one dtype; got "
                         f"{key_cache.dtype} / {value_cache.dtype} caches, scales given: {k_scale is not None}, "
                         f"{v_scale is not None}")
    if fp8_q != (q_scale is not None) or (fp8_q and query.dtype != key_cache.dtype):
        raise ValueError(f"a float8 query needs q_scale and caches of its dtype, and only it takes q_scale; got a "
                         f"{query.dtype} query over {key_cache.dtype} caches, q_scale given: {q_scale is not None}")
    if fp8_q and block_n < 32:
        raise ValueError(f"float8 queries need block_n >= 32 (fp8 tl.dot), got {block_n}")
    flags = dict(FP8_KV=fp8_kv, FP8_Q=fp8_q, P_SCALE=1.0, P_MANTISSA=0, P_MIN_EXP=0)
    if fp8_q:
        info = torch.finfo(key_cache.dtype)
        flags.update(P_SCALE=256.0 if key_cache.dtype == torch.float8_e4m3fn else 128.0,
                     P_MANTISSA=-round(math.log2(info.eps)) if interpreted else 0,
                     P_MIN_EXP=round(math.log2(info.smallest_normal)))
    return tuple(dummy if t is None else t for t in scales), flags


NO_REACH = 1 << 30  # the window and chunk of a layer without them (positions stay far below)


def _feature_arguments(features: AttentionFeatures, column_offsets: torch.Tensor | None, shape: tuple[int, int],
                       num_q_heads: int, dummy: torch.Tensor) -> tuple[tuple, dict]:
    """The kernel's feature arguments (pointers, the base-2 soft cap, window, chunk, the offsets' row stride) and
    constexpr flags; unused pointers are ``dummy`` and never dereferenced. ``shape``: (B, the columns read)."""
    positions = features.uses_positions
    if positions and (column_offsets is None or column_offsets.dim() != 2 or column_offsets.shape[0] != shape[0]
                      or column_offsets.shape[1] < shape[1]):
        raise ValueError(f"windows, chunks and ALiBi need column_offsets {list(shape)} or wider, the tree columns' "
                         f"logical offsets; got {None if column_offsets is None else list(column_offsets.shape)}")
    for name in ("alibi_slopes", "sinks"):
        vector = getattr(features, name)
        if vector is not None and (vector.numel() != num_q_heads or vector.stride(-1) != 1):
            raise ValueError(f"{name} must be a contiguous [Hq] = [{num_q_heads}] tensor; got {tuple(vector.shape)}")
    offsets = dummy if not positions else column_offsets if column_offsets.stride(1) == 1 else \
        column_offsets.contiguous()
    pointers = (offsets, dummy if features.alibi_slopes is None else features.alibi_slopes,
                dummy if features.sinks is None else features.sinks)
    cap = (features.soft_cap or 1.0) * math.log2(math.e)
    flags = dict(POSITIONS=positions, SOFT_CAP=bool(features.soft_cap), ALIBI=features.alibi_slopes is not None,
                 SINKS=features.sinks is not None)
    return (*pointers, cap, features.window or NO_REACH, features.chunk or NO_REACH, offsets.stride(0)), flags


def tree_attention_triton(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_table: torch.Tensor, prefix_lens: torch.Tensor, cu_query_lens: torch.Tensor,
                          tree_mask: torch.Tensor, softmax_scale: float, out: torch.Tensor | None = None,
                          max_query_len: int | None = None, *, first_column: int = 0,
                          features: AttentionFeatures = PLAIN, column_offsets: torch.Tensor | None = None,
                          launch: TreeAttentionLaunch | None = None, fp32_precision: str = "ieee",
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                          q_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Tree attention (the contract is in the module docstring).

    ``first_column``: the tree column of each request's first query (a host value, the same for every request).
    ``features``: the layer's (:class:`~vllm_easyspec.tree.attention.AttentionFeatures`; ALiBi slopes and sinks
    ``[Hq]`` on the query's device); ``column_offsets`` ``[B, W]`` int32, needed when they use positions (windows,
    chunks, ALiBi): tree column ``c`` of request ``b`` is at logical position ``prefix_lens[b] + column_offsets[b, c]``.
    ``max_query_len`` (the largest number of query rows of one request) sizes the grid; pass it to avoid
    a device-to-host sync: the launch then depends on host values only (shapes, ``max_query_len``, the
    block table's width). ``launch`` overrides :func:`choose_launch` (tests force many small splits and
    row tiles with it). Scratch buffers for the split results are allocated on the query's device.
    ``fp32_precision`` is the ``tl.dot`` input precision for float32 inputs (:data:`FP32_DOT_PRECISIONS`):
    exact products by default; vLLM's backend passes :func:`triton_default_fp32_precision`, what vLLM's own
    attention uses. Triton's interpreter always computes exact products. fp8 caches and queries: :func:`_fp8_arguments`.
    """
    _check_arguments(query, key_cache, value_cache, tree_mask, out, fp32_precision)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    batch = block_table.shape[0]
    if max_query_len is None:
        max_query_len = int((cu_query_lens[1:] - cu_query_lens[:-1]).max()) if batch else 0
    if first_column < 0 or tree_mask.shape[1] < first_column + max_query_len:
        raise ValueError(f"tree_mask has {tree_mask.shape[1]} columns; rows from first_column={first_column} on need "
                         f"{first_column + max_query_len}.")
    out = torch.empty_like(query) if out is None else out
    if num_tokens == 0 or batch == 0 or max_query_len == 0:
        return out
    mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
    mask = mask if mask.stride(-1) == 1 else mask.contiguous()
    group = num_q_heads // num_kv_heads
    kv_len_bound = block_table.shape[1] * block_size
    if launch is None:
        sm_count, shared_memory = _device_limits(query.device)
        launch = choose_launch(batch=batch, num_kv_heads=num_kv_heads, group=group, max_query_len=max_query_len,
                               kv_len_bound=kv_len_bound, head_dim=head_dim,
                               element_size=query.element_size(), sm_count=sm_count, shared_memory=shared_memory)
    interpreted = _is_interpreted(_tree_attention_kernel)
    fp8_pointers, fp8 = _fp8_arguments(query, key_cache, value_cache, (k_scale, v_scale, q_scale), launch.block_n,
                                       interpreted, prefix_lens)
    block_d = max(32 if fp8["FP8_Q"] else 16, triton.next_power_of_2(head_dim))
    # tl.dot on bf16 misreads its operands under the interpreter (triton-lang/triton#11584): upcast there.
    # fp32 inputs use fp32_precision; the upcast interpreter path uses exact fp32 products.
    upcast = query.dtype == torch.float32 or interpreted
    precision = "ieee" if interpreted else fp32_precision if query.dtype == torch.float32 else "tf32"
    # Triton's interpreter converts fp32 -> bf16 by truncation (GPUs round to nearest), which would double
    # the output error; under the interpreter, write fp32 and round with torch instead.
    kernel_out = (torch.empty(out.shape, dtype=torch.float32, device=out.device)
                  if interpreted and out.dtype == torch.bfloat16 else out)
    split = launch.num_splits > 1
    scratch = (num_tokens, num_q_heads, launch.num_splits)  # without splits never dereferenced (SPLIT is False)
    partial_acc = torch.empty((*scratch, head_dim), dtype=torch.float32, device=query.device) if split else kernel_out
    partial_stats = torch.empty((2, *scratch), dtype=torch.float32, device=query.device) if split else kernel_out
    row_tiles = triton.cdiv(max_query_len * group, launch.block_m)
    (*pointers, cap, window, chunk, stride_ob), flags = _feature_arguments(
        features, column_offsets, (batch, first_column + max_query_len), num_q_heads, prefix_lens)
    _tree_attention_kernel[(batch * num_kv_heads * launch.num_splits * row_tiles,)](
        kernel_out, partial_acc, partial_stats, query, key_cache, value_cache, block_table, prefix_lens,
        cu_query_lens, mask, *pointers, *fp8_pointers, float(softmax_scale) * math.log2(math.e), cap, window, chunk,
        query.stride(0), query.stride(1), kernel_out.stride(0), kernel_out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), mask.stride(0), stride_ob,
        num_tokens * num_q_heads * launch.num_splits, num_kv_heads, row_tiles, launch.num_splits,
        launch.min_split_len, first_column, kv_len_bound,
        KV_BLOCK_SIZE=block_size, GROUP=group, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n,
        HEAD_DIM=head_dim, BLOCK_D=block_d, SPLIT=split, UPCAST=upcast, DOT_PRECISION=precision, **flags, **fp8,
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    if split:
        _merge_splits(kernel_out, partial_acc, partial_stats, launch.num_splits, block_d, features.sinks)
    if kernel_out is not out:
        out.copy_(kernel_out)
    return out
