"""Blockwise lightning indexer == its dense definition; packed documents, context-parallel
query offsets and the tail rule behave as specified."""

import pytest
import torch

from kernels.dsa import DSAInputError, lightning_indexer_topk
from kernels.dsa.naive import naive_lightning_indexer_topk

HEADS, DIM, KPOOL, TOPK = 4, 16, 4, 24


def _inputs(n_q: int, n_k: int, seed: int, batch: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(batch, n_q, HEADS, DIM, generator=gen),
        k=torch.randn(batch, n_k, DIM, generator=gen),
        gate_scores=torch.randn(batch, n_k, DIM, generator=gen),
        ape=torch.randn(KPOOL, DIM, generator=gen),
        weights=torch.randn(batch, n_q, HEADS, generator=gen) * HEADS**-0.5,
    )


def _select(fn, inputs, select_tail=True, **kw):
    return fn(**inputs, kpool=KPOOL, topk=TOPK, select_tail=select_tail, softmax_scale=DIM**-0.5, **kw)


@pytest.mark.parametrize("select_tail", [False, True])
@pytest.mark.parametrize("block_size", [1, 7, 64, 1000])
def test_blockwise_equals_dense(select_tail, block_size):
    inputs = _inputs(301, 301, seed=0, batch=2)
    expected = _select(naive_lightning_indexer_topk, inputs, select_tail)
    assert torch.equal(_select(lightning_indexer_topk, inputs, select_tail, block_size=block_size), expected)


def test_packed_documents_equal_separate_calls():
    lengths = [37, 130, 3, 90]  # a document shorter than one pool included
    bounds = torch.tensor([0, 37, 167, 170, 260])
    inputs = _inputs(260, 260, seed=1)
    packed = _select(lightning_indexer_topk, inputs, cu_seqlens=bounds, block_size=32)
    dense = _select(naive_lightning_indexer_topk, inputs, cu_seqlens=bounds)
    assert torch.equal(packed, dense)
    for start, length in zip(bounds[:-1].tolist(), lengths):
        doc = {name: (t if name == "ape" else t[:, start : start + length]) for name, t in inputs.items()}
        alone = _select(lightning_indexer_topk, doc, block_size=32)
        expected = torch.where(alone >= 0, alone + start, alone)
        assert torch.equal(packed[:, start : start + length], expected)
        rows = packed[:, start : start + length]
        assert bool(((rows == -1) | ((rows >= start) & (rows < start + length))).all())


@pytest.mark.parametrize("cu_seqlens", [None, torch.tensor([0, 100, 250])])
def test_query_offset_equals_slicing_the_full_result(cu_seqlens):
    """Context parallelism: a rank's local queries against all-gathered keys."""
    inputs = _inputs(250, 250, seed=2)
    full = _select(lightning_indexer_topk, inputs, cu_seqlens=cu_seqlens, block_size=40)
    for q_offset, n_local in [(0, 70), (70, 90), (160, 90)]:
        local = dict(inputs)
        local["q"] = inputs["q"][:, q_offset : q_offset + n_local]
        local["weights"] = inputs["weights"][:, q_offset : q_offset + n_local]
        got = _select(lightning_indexer_topk, local, q_offset=q_offset, cu_seqlens=cu_seqlens, block_size=16)
        assert torch.equal(got, full[:, q_offset : q_offset + n_local])
        dense = _select(naive_lightning_indexer_topk, local, q_offset=q_offset, cu_seqlens=cu_seqlens)
        assert torch.equal(dense, got)


def test_selection_is_causal_by_pool_end_and_tail_covers_the_current_pool():
    inputs = _inputs(200, 200, seed=3)
    result = _select(lightning_indexer_topk, inputs, block_size=33)
    positions = torch.arange(200)[:, None]
    pools, tail = result[0, :, :TOPK].long(), result[0, :, TOPK:].long()
    # a selected pool's last token is visible, so every selected token is
    assert bool(((pools == -1) | (pools <= positions)).all())
    pool_last = torch.where(pools >= 0, (pools // KPOOL) * KPOOL + KPOOL - 1, -1)
    assert bool((pool_last <= positions).all())
    # full budget once enough pools are visible
    n_visible = (torch.arange(200) + 1) // KPOOL
    assert torch.equal((pools >= 0).sum(-1), KPOOL * n_visible.clamp_max(TOPK // KPOOL))
    for t in (0, 2, 3, 4, 198, 199):
        expected_tail = list(range(t + 1 - (t + 1) % KPOOL, t + 1))
        assert [v for v in tail[t].tolist() if v >= 0] == expected_tail


def test_bad_arguments_raise_dsa_input_error():
    inputs = _inputs(10, 10, seed=4)
    with pytest.raises(DSAInputError, match="multiple of kpool"):
        lightning_indexer_topk(**inputs, kpool=KPOOL, topk=10, select_tail=True, softmax_scale=1.0)
    with pytest.raises(DSAInputError, match="do not lie within"):
        _select(lightning_indexer_topk, inputs, q_offset=5)
    with pytest.raises(DSAInputError, match="cu_seqlens"):
        _select(lightning_indexer_topk, inputs, cu_seqlens=torch.tensor([0, 4, 9]))
