"""Sparse MLA attention (absorbed form): forward, log-sum-exp and backward equal a float64
dense masked computation written here, and the autograd Function passes gradcheck."""

import math

import pytest
import torch

from kernels.dsa import DSAInputError, naive_sparse_mla_attention, sparse_mla_attention


def _case(batch, n_q, n_k, heads, dqk, n_idx, seed, dtype=torch.float64, q_offset=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_q, heads, dqk, generator=gen, dtype=dtype)
    kv = torch.randn(batch, n_k, dqk, generator=gen, dtype=dtype)
    q_offset = n_k - n_q if q_offset is None else q_offset
    indices = torch.full((batch, n_q, n_idx), -1, dtype=torch.int32)
    for b in range(batch):
        for t in range(n_q):
            visible = q_offset + t + 1
            take = torch.randperm(visible, generator=gen)[: min(n_idx, visible)]
            # leave some slots empty, and scatter the -1s among the valid ones
            keep = take[: max(1, len(take) - t % 3)]
            slots = torch.randperm(n_idx, generator=gen)[: len(keep)]
            indices[b, t, slots] = keep.to(torch.int32)
    return q, kv, indices


def _reference(q, kv, indices, scale, d_v):
    """Loop over queries in float64: softmax over the named keys only."""
    batch, n_q, heads, _ = q.shape
    out = torch.zeros(batch, n_q, heads, d_v, dtype=torch.float64)
    lse = torch.full((batch, n_q, heads), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for t in range(n_q):
            keys = indices[b, t][indices[b, t] >= 0].long()
            if keys.numel() == 0:
                continue
            scores = q[b, t].double() @ kv[b, keys].double().T * scale  # [H, k]
            lse[b, t] = torch.logsumexp(scores, -1)
            out[b, t] = scores.softmax(-1) @ kv[b, keys, :d_v].double()
    return out, lse


@pytest.mark.parametrize("d_v", [12, 16])
def test_forward_and_lse_equal_float64_reference(d_v):
    q, kv, idx = _case(2, 9, 20, 3, 16, 6, seed=0)
    out, lse = sparse_mla_attention(q, kv, idx, 0.3, d_v)
    ref_out, ref_lse = _reference(q, kv, idx, 0.3, d_v)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-6)  # lse is float32
    dense_out, dense_lse = naive_sparse_mla_attention(q, kv, idx, 0.3, d_v)
    torch.testing.assert_close(dense_out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dense_lse, lse)


@pytest.mark.parametrize("kpool, n_pools", [(2, 3), (3, 2), (1, 6)])
def test_pool_mass_sums_each_pools_probabilities_over_heads(kpool, n_pools):
    q, kv, idx = _case(2, 9, 20, 3, 16, 6, seed=11)
    out, lse, mass = sparse_mla_attention(q, kv, idx, 0.3, 16, pool_mass=(kpool, n_pools))
    ref_out, _ = _reference(q, kv, idx, 0.3, 16)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)   # the same forward
    want = torch.zeros(2, 9, n_pools, dtype=torch.float64)
    for b in range(2):
        for t in range(9):
            keys = idx[b, t].long()
            ok = keys >= 0
            if not ok.any():
                continue
            probs = (q[b, t].double() @ kv[b, keys[ok]].double().T * 0.3).softmax(-1).sum(0)  # [valid slots]
            per_slot = torch.zeros(idx.shape[2], dtype=torch.float64)
            per_slot[ok] = probs
            for j in range(n_pools):
                want[b, t, j] = per_slot[j * kpool:(j + 1) * kpool].sum()
    assert mass.dtype == torch.float32 and not mass.requires_grad
    torch.testing.assert_close(mass.double(), want, rtol=1e-6, atol=1e-7)
    # precomputed (a recompute's kept forward) gives the same mass from its own pass
    _, _, again = sparse_mla_attention(q, kv, idx, 0.3, 16, precomputed=(out, lse), pool_mass=(kpool, n_pools))
    torch.testing.assert_close(again, mass)


def test_row_without_indices_gives_zero_output_and_minus_inf_lse():
    q, kv, idx = _case(1, 4, 8, 2, 8, 3, seed=1)
    idx[0, 2] = -1
    out, lse = sparse_mla_attention(q, kv, idx, 1.0, 8)
    assert bool((out[0, 2] == 0).all()) and bool(torch.isneginf(lse[0, 2]).all())
    q.requires_grad_(True)
    kv.requires_grad_(True)
    out, _ = sparse_mla_attention(q, kv, idx, 1.0, 8)
    out.square().sum().backward()
    assert bool(torch.isfinite(q.grad).all()) and bool((q.grad[0, 2] == 0).all())
    assert bool(torch.isfinite(kv.grad).all())


def test_backward_equals_float64_reference_gradients():
    q, kv, idx = _case(2, 11, 24, 4, 16, 7, seed=2)
    d_v, scale = 12, 0.25
    grad = torch.randn(2, 11, 4, d_v, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    q1, kv1 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, _ = sparse_mla_attention(q1, kv1, idx, scale, d_v)
    out.backward(grad)
    q2, kv2 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    ref_out, _ = _reference(q2, kv2, idx, scale, d_v)
    ref_out.backward(grad)
    torch.testing.assert_close(q1.grad, q2.grad, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(kv1.grad, kv2.grad, rtol=1e-9, atol=1e-11)


def test_gradcheck():
    q, kv, idx = _case(1, 5, 9, 2, 6, 4, seed=4)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: sparse_mla_attention(a, b, idx, 0.7, 4)[0], (q, kv))


def test_float32_inputs_keep_their_dtype_and_match_float64():
    q, kv, idx = _case(1, 16, 40, 4, 32, 10, seed=5, dtype=torch.float32)
    out, lse = sparse_mla_attention(q, kv, idx, 32**-0.5, 32)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    ref_out, _ = _reference(q, kv, idx, 32**-0.5, 32)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise_dsa_input_error():
    q, kv, idx = _case(1, 4, 8, 2, 8, 3, seed=6)
    with pytest.raises(DSAInputError, match="d_v"):
        sparse_mla_attention(q, kv, idx, 1.0, 9)
    with pytest.raises(DSAInputError, match="indices"):
        sparse_mla_attention(q, kv, idx.float(), 1.0, 8)
    with pytest.raises(DSAInputError, match="Dqk"):
        sparse_mla_attention(q, kv[..., :4], idx, 1.0, 4)
    for runs in (0, idx.shape[2] + 1):
        with pytest.raises(DSAInputError, match="runs"):
            sparse_mla_attention(q, kv, idx, 1.0, 8, runs=runs)
    with pytest.raises(DSAInputError, match="fwd_kernel='cuda'"):
        sparse_mla_attention(q, kv, idx, 1.0, 8, fwd_kernel="cuda")
    with pytest.raises(DSAInputError, match="dkv_kernel='cuda'"):
        sparse_mla_attention(q, kv, idx, 1.0, 8, dkv_kernel="cuda")
    with pytest.raises(DSAInputError, match="runs must be None"):
        sparse_mla_attention(q, kv, idx, 1.0, 8, runs=2, dkv_kernel="gluon")
    for pool_mass in ((0, 2), (2, 0), (2, 2)):   # idx has 3 slots: 2 pools of 2 pass its end
        with pytest.raises(DSAInputError, match="pool_mass"):
            sparse_mla_attention(q, kv, idx, 1.0, 8, pool_mass=pool_mass)


def test_gluon_dq_needs_the_gluon_dkv():
    """``dq_kernel="gluon"`` reads the ``rowsum(dO O)`` the all-Gluon backward computes; with the Triton latent
    gradient (whose ``dq`` pass writes it) or an unknown name it is refused before any launch."""
    pytest.importorskip("triton")
    from kernels.dsa.sparse_attention_triton import triton_sparse_mla_bwd

    q, kv, idx = _case(1, 4, 8, 2, 8, 3, seed=9)
    out, lse = sparse_mla_attention(q, kv, idx, 1.0, 8)
    for dq_kernel, dkv_kernel in (("gluon", "triton"), ("cuda", "gluon"), ("cuda", "triton")):
        with pytest.raises(DSAInputError, match="dq_kernel"):
            triton_sparse_mla_bwd(q, kv, idx, out, lse, torch.ones_like(out), 1.0, 8, dkv_kernel=dkv_kernel,
                                  dq_kernel=dq_kernel)


def test_gluon_latent_gradient_takes_the_gluon_dq_by_default(monkeypatch):
    """``dq_kernel="auto"`` with the Gluon latent gradient is the Gluon ``dq``: given the forward's output to form
    ``rowsum(dO O)`` itself with ``DQ_FUSED_DELTA`` (the default), fed by the ``rowsum(dO O)`` kernel without;
    ``dq_kernel="triton"`` keeps the ``dq`` pass (checked here up to its launch, which needs a GPU)."""
    pytest.importorskip("triton")
    import kernels.dsa.sparse_attention_gluon as sag
    import kernels.dsa.sparse_attention_triton as sat

    calls = []
    monkeypatch.setattr(sag, "DQ_FUSED_DELTA", False)
    monkeypatch.setattr(sat, "triton_sparse_mla_delta", lambda out, grad: calls.append("delta") or out.sum(-1).float())
    monkeypatch.setattr(sag, "gluon_sparse_mla_dq", lambda *a, out: calls.append("dq" if out is None else "dq, out"))
    monkeypatch.setattr(sag, "gluon_sparse_mla_dkv", lambda *a: calls.append("dkv"))
    monkeypatch.setattr(sat.sparse_mla_bwd_kernel, "run", lambda *a, **k: calls.append("dq pass"))
    q, kv, idx = _case(1, 4, 8, 2, 8, 3, seed=9)
    out, lse = sparse_mla_attention(q, kv, idx, 1.0, 8)
    sat.triton_sparse_mla_bwd(q, kv, idx, out, lse, torch.ones_like(out), 1.0, 8, dkv_kernel="gluon")
    assert calls == ["delta", "dq", "dkv"]
    calls.clear()
    sat.triton_sparse_mla_bwd(q, kv, idx, out, lse, torch.ones_like(out), 1.0, 8, dkv_kernel="gluon",
                              dq_kernel="triton")
    assert calls == ["dq pass", "dkv"]
    # with DQ_FUSED_DELTA (the default) the query gradient forms rowsum(dO O) from the forward's output: no pass
    calls.clear()
    monkeypatch.undo()
    assert sag.DQ_FUSED_DELTA
    monkeypatch.setattr(sat, "triton_sparse_mla_delta", lambda out, grad: calls.append("delta") or out.sum(-1).float())
    monkeypatch.setattr(sag, "gluon_sparse_mla_dkv", lambda *a: calls.append("dkv"))
    monkeypatch.setattr(sag, "gluon_sparse_mla_dq",
                        lambda *a, out=None: calls.append(("dq", out is not None and out.shape == q.shape[:3] + (8,))))
    sat.triton_sparse_mla_bwd(q, kv, idx, out, lse, torch.ones_like(out), 1.0, 8, dkv_kernel="gluon")
    assert calls == [("dq", True), "dkv"]


def test_gluon_forward_names_what_it_cannot_run():
    """The Gluon forward's preconditions, each named in its error (no silent fallback to the Triton kernel)."""
    pytest.importorskip("triton")
    from kernels.dsa.sparse_attention_gluon import (
        gluon_sparse_mla_dkv,
        gluon_sparse_mla_dq,
        gluon_sparse_mla_fwd,
        gluon_supported,
    )

    def inputs(heads, dqk, dtype=torch.bfloat16):
        return torch.zeros(1, 2, heads, dqk, dtype=dtype), torch.zeros(1, 4, dqk, dtype=dtype)

    assert "multiple of 64" in gluon_supported(*inputs(8, 512), 512)
    assert "d_v == Dqk" in gluon_supported(*inputs(64, 576), 512)
    assert "bf16 or fp16" in gluon_supported(*inputs(64, 512, torch.float32), 512)
    assert "Hopper" in gluon_supported(*inputs(64, 512), 512)   # CPU tensors
    assert "index slot" in gluon_supported(*inputs(64, 512), 512, torch.zeros(1, 2, 0, dtype=torch.int32))
    q, kv = inputs(64, 512)
    with pytest.raises(DSAInputError, match="Hopper"):
        gluon_sparse_mla_fwd(q, kv, torch.zeros(1, 2, 16, dtype=torch.int32), 1.0, 512)
    with pytest.raises(DSAInputError, match="query gradient needs a Hopper"):
        gluon_sparse_mla_dq(q, kv, torch.zeros(1, 2, 16, dtype=torch.int32), q, torch.zeros(1, 2, 64),
                            torch.zeros(1, 2, 64), 1.0)
    lse = torch.zeros(1, 2, 64)
    with pytest.raises(DSAInputError, match="latent gradient needs a Hopper"):
        gluon_sparse_mla_dkv(q, kv, torch.zeros(1, 2, 16, dtype=torch.int32), q, lse, lse, 1.0, kv.float())


def test_query_gradient_names_a_bad_output_for_rowsum():
    """The query gradient that forms ``rowsum(dO O)`` itself names what is wrong with its ``out`` or ``delta``
    before it launches anything (no GPU needed for these checks)."""
    pytest.importorskip("triton")
    from kernels.dsa.sparse_attention_gluon import gluon_sparse_mla_dq

    q, kv = torch.zeros(1, 2, 64, 512, dtype=torch.bfloat16), torch.zeros(1, 4, 512, dtype=torch.bfloat16)
    idx, lse = torch.zeros(1, 2, 16, dtype=torch.int32), torch.zeros(1, 2, 64)
    with pytest.raises(ValueError, match="needs schedule 'products'"):
        gluon_sparse_mla_dq(q, kv, idx, q, lse, lse.clone(), 1.0, schedule="keys", out=q)
    with pytest.raises(DSAInputError, match="out must match grad_out"):
        gluon_sparse_mla_dq(q, kv, idx, q, lse, lse.clone(), 1.0, schedule="products", out=q.float())
    with pytest.raises(DSAInputError, match="delta must be a contiguous float32"):
        gluon_sparse_mla_dq(q, kv, idx, q, lse, lse.double(), 1.0, schedule="products", out=q)
    with pytest.raises(DSAInputError, match="delta must be a contiguous float32"):
        gluon_sparse_mla_dq(q, kv, idx, q, lse, torch.zeros(1, 64, 2).transpose(1, 2), 1.0, schedule="products",
                            out=q)


@pytest.mark.parametrize("fwd, dkv, runs, why, expected", [
    ("auto", "auto", None, None, ("gluon", "gluon")),
    ("auto", "auto", 4, None, ("gluon", "triton")),           # the per-pool sum is Triton's alone
    ("auto", "auto", None, "a Hopper GPU", ("triton", "triton")),
    ("auto", "auto", 4, "a multiple of 64 heads", ("triton", "triton")),
    ("triton", "auto", None, None, ("triton", "gluon")),
    ("auto", "triton", None, None, ("gluon", "triton")),
    ("gluon", "gluon", None, "a Hopper GPU", ("gluon", "gluon")),  # explicit: kept, so the kernel raises
    ("triton", "triton", None, None, ("triton", "triton")),
])
def test_auto_takes_gluon_only_where_it_runs(fwd, dkv, runs, why, expected):
    from kernels.dsa.sparse_attention import choose_kernels

    assert choose_kernels(fwd, dkv, runs, why) == expected


def test_auto_on_the_cpu_asks_no_gluon_kernel(monkeypatch):
    """``"auto"`` (the default) resolves before the autograd function: on CPU tensors to Triton, whose CPU path is
    the torch reference; a resolution that asked the Gluon module here would fail the spy."""
    import kernels.dsa.sparse_attention as sa

    seen = []
    real = sa._SparseMLAAttention.apply
    monkeypatch.setattr(sa._SparseMLAAttention, "apply",
                        lambda *args: seen.append(args[7:9]) or real(*args))
    q, kv, idx = _case(1, 4, 8, 2, 8, 3, seed=8)
    sparse_mla_attention(q, kv, idx, 1.0, 8)
    sparse_mla_attention(q, kv, idx, 1.0, 8, runs=2, fwd_kernel="gluon")
    assert seen == [("triton", "triton"), ("gluon", "triton")]


def test_cpu_path_does_not_depend_on_the_kernel_choices():
    q, kv, idx = _case(1, 6, 10, 2, 8, 4, seed=7)
    grads = []
    for kernels in ({}, {"fwd_kernel": "gluon", "dkv_kernel": "gluon"}):
        qq, kk = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out, lse = sparse_mla_attention(qq, kk, idx, 0.3, 8, **kernels)
        out.sum().backward()
        grads.append((out.detach(), lse, qq.grad, kk.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
