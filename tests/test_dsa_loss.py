"""The pooled DSA indexer KL loss: a value computed by hand, the dense definition, packed
documents, and gradients reaching the indexer only."""

import math

import pytest
import torch

from kernels.dsa import DSAInputError, indexer_kl_loss, lightning_indexer_topk, sparse_mla_attention
from kernels.dsa.naive import naive_indexer_kl_loss


def test_loss_equals_hand_computed_value():
    # kpool 2, topk 4: query 4 attends pools {0,1}, {2,3} and its tail {4}; query 0 only its tail.
    kpool, topk = 2, 4
    indices = torch.tensor([[[-1, -1, -1, -1, 0], [0, 1, 2, 3, 4]]], dtype=torch.int32)
    # main attention, one head, Dqk 1, q = 1: probabilities proportional to exp(kv) = 1, 2, 1, 3, 4
    kv = torch.tensor([[[0.0], [math.log(2)], [0.0], [math.log(3)], [math.log(4)]]], dtype=torch.float64)
    q = torch.ones(1, 2, 1, 1, dtype=torch.float64)
    _, lse = sparse_mla_attention(q, kv, indices, 1.0, 1)
    # indexer, one head, D_I 1: gates 0 -> pool keys are token means 1 and 3; scores relu(1), relu(3)
    k_index = torch.tensor([[[1.0], [1.0], [3.0], [3.0], [0.0]]], dtype=torch.float64)
    loss = indexer_kl_loss(
        torch.ones(1, 2, 1, 1, dtype=torch.float64), k_index, torch.zeros_like(k_index),
        torch.zeros(kpool, 1, dtype=torch.float64), torch.ones(1, 2, 1, dtype=torch.float64),
        q, kv, lse, indices, kpool=kpool, topk=topk, index_softmax_scale=1.0, softmax_scale=1.0,
    )
    # pool masses 3/11 and 4/11 (the tail's 4/11 is left out) -> target 3/7, 4/7
    log_z = math.log(math.exp(1) + math.exp(3))
    expected = 3 / 7 * (math.log(3 / 7) - (1 - log_z)) + 4 / 7 * (math.log(4 / 7) - (3 - log_z))
    assert abs(loss.item() - expected) < 1e-6  # the only row with pools is query 4
    # the same target taken from the attention's own pool mass
    _, _, mass = sparse_mla_attention(q, kv, indices, 1.0, 1, pool_mass=(kpool, topk // kpool))
    from_mass = indexer_kl_loss(
        torch.ones(1, 2, 1, 1, dtype=torch.float64), k_index, torch.zeros_like(k_index),
        torch.zeros(kpool, 1, dtype=torch.float64), torch.ones(1, 2, 1, dtype=torch.float64),
        q, kv, lse, indices, kpool=kpool, topk=topk, index_softmax_scale=1.0, softmax_scale=1.0, pool_mass=mass,
    )
    assert abs(from_mass.item() - expected) < 1e-6


def _random_case(seq_len, seed, cu_seqlens=None):
    gen = torch.Generator().manual_seed(seed)
    heads_i, dim_i, heads, dqk, kpool, topk = 3, 8, 2, 12, 4, 16
    ind = dict(
        q=torch.randn(1, seq_len, heads_i, dim_i, generator=gen, dtype=torch.float64),
        k=torch.randn(1, seq_len, dim_i, generator=gen, dtype=torch.float64),
        gate_scores=torch.randn(1, seq_len, dim_i, generator=gen, dtype=torch.float64),
        ape=torch.randn(kpool, dim_i, generator=gen, dtype=torch.float64),
        weights=torch.randn(1, seq_len, heads_i, generator=gen, dtype=torch.float64),
    )
    indices = lightning_indexer_topk(
        **ind, kpool=kpool, topk=topk, select_tail=True, softmax_scale=dim_i**-0.5, cu_seqlens=cu_seqlens
    )
    q = torch.randn(1, seq_len, heads, dqk, generator=gen, dtype=torch.float64)
    kv = torch.randn(1, seq_len, dqk, generator=gen, dtype=torch.float64)
    _, lse = sparse_mla_attention(q, kv, indices, dqk**-0.5, dqk)
    for t in ind.values():
        t.requires_grad_(True)
    kw = dict(kpool=kpool, topk=topk, index_softmax_scale=dim_i**-0.5, softmax_scale=dqk**-0.5)
    return ind, q, kv, lse, indices, kw


def test_blockwise_loss_and_gradients_equal_dense_definition():
    ind, q, kv, lse, indices, kw = _random_case(90, seed=0)
    args = [ind[n] for n in ("q", "k", "gate_scores", "ape", "weights")]
    loss = indexer_kl_loss(*args, q, kv, lse, indices, **kw, block_size=16)
    grads = torch.autograd.grad(loss, args)
    dense = naive_indexer_kl_loss(*args, q, kv, indices, **kw)
    dense_grads = torch.autograd.grad(dense, args)
    assert loss.item() > 0.01  # selection is real: 22 pools, 4 selected
    torch.testing.assert_close(loss, dense, rtol=1e-5, atol=1e-7)
    for g, ref in zip(grads, dense_grads):
        torch.testing.assert_close(g.double(), ref, rtol=1e-4, atol=1e-7)
    # with the target from the attention's pool mass: the same loss and gradients
    _, _, mass = sparse_mla_attention(q, kv, indices, kw["softmax_scale"], q.shape[-1],
                                      pool_mass=(kw["kpool"], kw["topk"] // kw["kpool"]))
    from_mass = indexer_kl_loss(*args, q, kv, lse, indices, **kw, block_size=16, pool_mass=mass)
    torch.testing.assert_close(from_mass, dense, rtol=1e-5, atol=1e-7)
    for g, ref in zip(torch.autograd.grad(from_mass, args), dense_grads):
        torch.testing.assert_close(g.double(), ref, rtol=1e-4, atol=1e-7)
    with pytest.raises(DSAInputError, match="pool_mass"):
        indexer_kl_loss(*args, q, kv, lse, indices, **kw, pool_mass=mass[..., 1:])


def test_packed_loss_is_the_row_weighted_mean_of_per_document_losses():
    bounds = torch.tensor([0, 50, 110])
    ind, q, kv, lse, indices, kw = _random_case(110, seed=1, cu_seqlens=bounds)
    args = [ind[n] for n in ("q", "k", "gate_scores", "ape", "weights")]
    packed = indexer_kl_loss(*args, q, kv, lse, indices, **kw, cu_seqlens=bounds)
    total, rows = 0.0, 0
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        doc_indices = torch.where(indices[:, a:b] >= 0, indices[:, a:b] - a, -1)
        sliced = [t if t.ndim == 2 else t[:, a:b] for t in args]  # ape is [kpool, D]
        doc_loss = indexer_kl_loss(*sliced, q[:, a:b], kv[:, a:b], lse[:, a:b], doc_indices, **kw)
        n_rows = int((doc_indices[..., : kw["topk"]] >= 0).any(-1).sum())
        total, rows = total + doc_loss.item() * n_rows, rows + n_rows
    assert abs(packed.item() - total / rows) < 1e-6


def test_gradients_reach_the_indexer_only():
    ind, q, kv, lse, indices, kw = _random_case(40, seed=2)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    loss = indexer_kl_loss(*(ind[n] for n in ("q", "k", "gate_scores", "ape", "weights")), q, kv, lse, indices, **kw)
    loss.backward()
    assert q.grad is None and kv.grad is None
    assert all(ind[n].grad is not None and bool(ind[n].grad.abs().sum() > 0) for n in ind)


def test_batch_of_two_is_the_row_weighted_mean_of_each_sequence_with_its_gradients():
    # Two sequences of one batch gather their pool keys from their own rows only.
    cases = [_random_case(60, seed=s) for s in (3, 4)]
    names = ("q", "k", "gate_scores", "weights")
    ape = cases[0][0]["ape"]                                   # one ape for both, as in a batch
    per_seq, rows = [], []
    for ind, q, kv, lse, indices, kw in cases:
        per_seq.append(indexer_kl_loss(ind["q"], ind["k"], ind["gate_scores"], ape, ind["weights"], q, kv, lse,
                                       indices, **kw, block_size=16))
        rows.append(int((indices[..., : kw["topk"]] >= 0).any(-1).sum()))
    expected = (per_seq[0] * rows[0] + per_seq[1] * rows[1]) / sum(rows)
    (a, qa, kva, lsea, ia, kw), (b, qb, kvb, lseb, ib, _) = cases
    stacked = {n: torch.cat([a[n].detach(), b[n].detach()]).requires_grad_(True) for n in names}
    batched = indexer_kl_loss(stacked["q"], stacked["k"], stacked["gate_scores"], ape, stacked["weights"],
                              torch.cat([qa, qb]), torch.cat([kva, kvb]), torch.cat([lsea, lseb]),
                              torch.cat([ia, ib]), **kw, block_size=16)
    torch.testing.assert_close(batched, expected, rtol=1e-6, atol=1e-9)
    got = torch.autograd.grad(batched, [stacked["k"], stacked["gate_scores"]])
    want = torch.autograd.grad(expected, [a["k"], b["k"], a["gate_scores"], b["gate_scores"]])
    torch.testing.assert_close(got[0].double(), torch.cat(want[:2]), rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(got[1].double(), torch.cat(want[2:]), rtol=1e-4, atol=1e-9)
