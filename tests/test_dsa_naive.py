"""The DSA indexer (dense definition and public entry) selects the tokens transformers'
``Glm5NextTextIndexer`` selects, compared as sets per query modulo score ties."""

import pytest
import torch
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

from kernels.dsa import kpool_compress, lightning_indexer_topk
from kernels.dsa.naive import naive_kpool_compress, naive_lightning_indexer_topk

HIDDEN, Q_LORA, HEADS, HEAD_DIM, KPOOL, TOPK = 64, 32, 8, 16, 4, 32


def _hf_indexer(select_tail: bool, seed: int) -> Glm5NextTextIndexer:
    config = Glm5NextTextConfig(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=Q_LORA,
        kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, index_n_heads=HEADS,
        index_head_dim=HEAD_DIM, index_topk=TOPK, index_kpool=KPOOL,
        index_kpool_always_select_tail=select_tail, num_hidden_layers=4,
    )
    torch.manual_seed(seed)
    indexer = Glm5NextTextIndexer(config, layer_idx=0)
    with torch.no_grad():  # the k-pool parameters start at zero: make them matter
        for p in indexer.parameters():
            p.normal_(0.0, 0.5 if p.ndim > 1 else 1.0)
    return indexer.eval()


def _indexer_inputs(indexer: Glm5NextTextIndexer, x: torch.Tensor, q_resid: torch.Tensor) -> dict:
    """Our function's inputs from the HF module's weights (the projections it does inside)."""
    batch, seq_len, _ = x.shape
    with torch.no_grad():
        return dict(
            q=indexer.wq_b(q_resid).view(batch, seq_len, HEADS, HEAD_DIM),
            k=indexer.k_norm(indexer.wk(x)),
            gate_scores=x @ indexer.index_kpool_compress_gate.T,
            ape=indexer.index_kpool_compress_ape.detach().clone(),
            weights=indexer.weights_proj(x) * HEADS**-0.5,
        )


def _pool_scores64(inputs: dict) -> torch.Tensor:
    """float64 pool scores ``[B, T, P]``, computed here from the definition."""
    q, k, g, ape = (inputs[n].double() for n in ("q", "k", "gate_scores", "ape"))
    batch, seq_len, dim = k.shape
    n_full = seq_len // KPOOL
    logits = (g[:, : n_full * KPOOL].view(batch, n_full, KPOOL, dim) + ape).softmax(2)
    pool_keys = (logits * k[:, : n_full * KPOOL].view(batch, n_full, KPOOL, dim)).sum(2)
    per_head = torch.relu(torch.einsum("bthd,bpd->bthp", q, pool_keys) * HEAD_DIM**-0.5)
    return torch.einsum("bthp,bth->btp", per_head, inputs["weights"].double())


def assert_same_selection_modulo_ties(ours, reference, scores64, tol=1e-4):
    """Per query, equal token sets: the tail part exactly, the pool part modulo ties.

    Both layouts hold the selected pools' tokens in ``[:TOPK]`` and the tail after it.
    A pool selected by one side only must score (float64, ``scores64`` ``[B, T, P]``) within
    ``tol`` of the selection boundary, the lowest score among the pools either side chose.
    """
    batch, seq_len, _ = ours.shape
    mismatched_rows = 0
    for b in range(batch):
        for t in range(seq_len):
            tail = {int(v) for v in ours[b, t, TOPK:] if v >= 0}
            assert tail == {int(v) for v in reference[b, t, TOPK:] if v >= 0}, f"query {t}: tails differ"
            a = {int(v) // KPOOL for v in ours[b, t, :TOPK] if v >= 0}
            r = {int(v) // KPOOL for v in reference[b, t, :TOPK] if v >= 0}
            if a == r:
                continue
            mismatched_rows += 1
            assert len(a) == len(r), f"query {t}: {len(a)} pools selected, reference {len(r)}"
            boundary = min(scores64[b, t, p].item() for p in a | r)
            for p in a ^ r:
                gap = abs(scores64[b, t, p].item() - boundary)
                assert gap <= tol * max(1.0, abs(boundary)), f"query {t}: pool {p} differs by score gap {gap}"
    assert mismatched_rows <= seq_len // 10, f"{mismatched_rows} of {seq_len} queries differ (ties are rare)"


@pytest.mark.parametrize("select_tail", [False, True])
def test_indexer_selects_the_tokens_transformers_selects(select_tail):
    seq_len = 384  # 96 pools, 8 selected: selection is real
    indexer = _hf_indexer(select_tail, seed=1)
    torch.manual_seed(2)
    x, q_resid = torch.randn(2, seq_len, HIDDEN), torch.randn(2, seq_len, Q_LORA)
    mask = torch.ones(2, seq_len, dtype=torch.bool)
    with torch.no_grad():
        expected = indexer(x, q_resid, mask, None)
    inputs = _indexer_inputs(indexer, x, q_resid)
    kwargs = dict(kpool=KPOOL, topk=TOPK, select_tail=select_tail, softmax_scale=HEAD_DIM**-0.5)
    dense = naive_lightning_indexer_topk(**inputs, **kwargs)
    blockwise = lightning_indexer_topk(**inputs, **kwargs, block_size=50)
    assert dense.shape == blockwise.shape == expected.shape
    scores64 = _pool_scores64(inputs)
    assert_same_selection_modulo_ties(dense, expected, scores64)
    assert_same_selection_modulo_ties(blockwise, expected, scores64)


def test_left_padded_transformers_rows_equal_the_unpadded_sequence():
    """transformers starts pools at the first non-padding token; we start them at 0."""
    seq_len, pad = 200, 3
    indexer = _hf_indexer(True, seed=3)
    torch.manual_seed(4)
    x, q_resid = torch.randn(1, seq_len + pad, HIDDEN), torch.randn(1, seq_len + pad, Q_LORA)
    mask = torch.ones(1, seq_len + pad, dtype=torch.bool)
    mask[:, :pad] = False
    with torch.no_grad():
        expected = indexer(x, q_resid, mask, None)[:, pad:]
    expected = torch.where(expected >= 0, expected - pad, expected)
    inputs = _indexer_inputs(indexer, x[:, pad:], q_resid[:, pad:])
    ours = lightning_indexer_topk(**inputs, kpool=KPOOL, topk=TOPK, select_tail=True, softmax_scale=HEAD_DIM**-0.5)
    assert_same_selection_modulo_ties(ours, expected, _pool_scores64(inputs))


def test_kpool_compress_equals_transformers_pooled_keys():
    seq_len = 30  # 7 complete pools and a tail of 2 tokens
    indexer = _hf_indexer(True, seed=5)
    torch.manual_seed(6)
    x, q_resid = torch.randn(1, seq_len, HIDDEN), torch.randn(1, seq_len, Q_LORA)
    inputs = _indexer_inputs(indexer, x, q_resid)
    packed = torch.cat([inputs["k"], inputs["gate_scores"], torch.ones(1, seq_len, 1)], dim=-1)
    with torch.no_grad():
        hf_keys, _, hf_valid = indexer.get_pooled_states(packed)
    ours = kpool_compress(inputs["k"], inputs["gate_scores"], inputs["ape"], KPOOL)
    dense = naive_kpool_compress(inputs["k"], inputs["gate_scores"], inputs["ape"], KPOOL)
    assert ours.shape == dense.shape == (1, 8, HEAD_DIM)
    assert hf_keys.shape[1] == 7 and bool(hf_valid.all())  # transformers drops the tail pool
    torch.testing.assert_close(ours[:, :7], hf_keys, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dense, ours, rtol=1e-5, atol=1e-6)


def test_equal_scores_are_won_by_the_lower_pool_index():
    """All-zero indexer queries give every visible pool score 0: the earliest pools win."""
    seq_len, dim, heads = 64, 8, 2
    torch.manual_seed(7)
    q = torch.zeros(1, seq_len, heads, dim)
    k, g = torch.randn(1, seq_len, dim), torch.randn(1, seq_len, dim)
    ape, w = torch.randn(KPOOL, dim), torch.randn(1, seq_len, heads)
    kwargs = dict(kpool=KPOOL, topk=8, select_tail=False, softmax_scale=1.0)
    for result in (lightning_indexer_topk(q, k, g, ape, w, **kwargs, block_size=16),
                   naive_lightning_indexer_topk(q, k, g, ape, w, **kwargs)):
        assert result[0, -1].tolist() == list(range(8))
        assert result[0, 10].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
        assert result[0, 5].tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
