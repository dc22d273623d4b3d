"""The project's chunked plain-torch KDA equals transformers' plain-torch KDA (and the float64 recurrence)."""

import pytest
import torch

from model.ops.kda import chunk_kda_torch, naive_recurrent_kda


def _inputs(T, H=4, K=16, V=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, T, H, d, generator=g, dtype=dtype) for d in (K, K, V))
    gate = -5.0 * torch.sigmoid(torch.randn(1, T, H, K, generator=g, dtype=dtype))  # linear_lower_bound form
    beta = torch.sigmoid(torch.randn(1, T, H, generator=g, dtype=dtype))
    s0 = 0.5 * torch.randn(1, H, K, V, generator=g, dtype=dtype)
    return q, k, v, gate, beta, s0


def test_chunk_kda_matches_transformers_chunk_at_4k_with_initial_state(plain_torch_transformers):
    from transformers.models.glm5_next.modeling_glm5_next import chunk_kimi_delta_attention

    q, k, v, g, beta, s0 = _inputs(4096)
    ref, ref_state = chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    out, state = chunk_kda_torch(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, chunk_size=32)
    out_diff, state_diff = (out - ref).abs().max(), (state - ref_state).abs().max()
    print(f"KDA 4k vs transformers chunk: out {out_diff:.2e}, state {state_diff:.2e}")
    assert (out - ref).abs().max() <= 1e-4
    assert (state - ref_state).abs().max() <= 1e-4


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_kda_matches_transformers_recurrence_and_float64(plain_torch_transformers, chunk_size):
    from transformers.models.glm5_next.modeling_glm5_next import recurrent_kimi_delta_attention

    q, k, v, g, beta, s0 = _inputs(203, seed=1, dtype=torch.float64)  # not a multiple of the chunk size
    exact, exact_state = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)
    f = [t.float() for t in (q, k, v, g, beta, s0)]
    ref, ref_state = recurrent_kimi_delta_attention(*f[:5], initial_state=f[5], output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    out, state = chunk_kda_torch(*f[:5], initial_state=f[5], output_final_state=True, use_qk_l2norm_in_kernel=True,
                                 chunk_size=chunk_size)
    assert (ref.double() - exact).abs().max() <= 1e-5  # the references agree with each other
    assert (out.double() - exact).abs().max() <= 1e-5
    assert (state.double() - exact_state).abs().max() <= 1e-5


def test_state_hand_off_equals_one_pass():
    """Two segments with the first one's final state carried equal one pass (the CP contract)."""
    q, k, v, g, beta, _ = _inputs(1000, seed=2)
    full, full_state = chunk_kda_torch(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    a, sa = chunk_kda_torch(*(t[:, :437] for t in (q, k, v, g, beta)), output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
    b, sb = chunk_kda_torch(*(t[:, 437:] for t in (q, k, v, g, beta)), initial_state=sa, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
    assert (torch.cat([a, b], 1) - full).abs().max() <= 1e-5
    assert (sb - full_state).abs().max() <= 1e-5


def test_chunk_kda_gradients_match_float64_recurrence():
    q, k, v, g, beta, s0 = _inputs(70, H=2, K=8, V=8, seed=3, dtype=torch.float64)
    args = [t.clone().requires_grad_() for t in (q, k, v, g, beta, s0)]
    out, st = chunk_kda_torch(*args[:5], initial_state=args[5], output_final_state=True, use_qk_l2norm_in_kernel=True,
                              chunk_size=16)
    (out.pow(2).sum() + st.sum()).backward()
    args2 = [t.clone().requires_grad_() for t in (q, k, v, g, beta, s0)]
    out2, st2 = naive_recurrent_kda(*args2[:5], initial_state=args2[5], output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
    (out2.pow(2).sum() + st2.sum()).backward()
    for a, b in zip(args, args2):
        assert torch.allclose(a.grad, b.grad, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("rank", [0, 1, 5])
def test_cp_state_fold_matches_a_per_rank_recurrence_in_value_and_gradient(rank):
    """model.layers.fold_cp_states against S <- M_j S + L_j over separate float64 leaves per rank."""
    from model.layers import fold_cp_states

    b, ranks, h, k, v = 1, 6, 2, 4, 3
    gen = torch.Generator().manual_seed(rank)
    local = [torch.randn(b, h, k, v, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(ranks)]
    trans = [(0.5 * torch.randn(b, h, k, k, generator=gen, dtype=torch.float64)).requires_grad_() for _ in range(ranks)]
    weight = torch.randn(b, h, k, v, generator=gen, dtype=torch.float64)
    state = torch.zeros(b, h, k, v, dtype=torch.float64)
    for j in range(rank):
        state = torch.einsum("bhij,bhjv->bhiv", trans[j], state) + local[j]
    if rank:   # rank 0's incoming state is zeros, with no graph to differentiate
        (state * weight).sum().backward()

    gathered = torch.stack([torch.cat([local[j].detach(), trans[j].detach()], dim=-1) for j in range(ranks)], dim=1)
    gathered = gathered.float().requires_grad_()
    folded = fold_cp_states(gathered, rank, v)
    (folded * weight.float()).sum().backward()

    assert folded.shape == (b, h, k, v)
    torch.testing.assert_close(folded.double(), state.detach(), atol=1e-5, rtol=1e-5)
    for j in range(ranks):
        want_l = local[j].grad if local[j].grad is not None else torch.zeros_like(local[j])
        want_m = trans[j].grad if trans[j].grad is not None else torch.zeros_like(trans[j])
        torch.testing.assert_close(gathered.grad[:, j, ..., :v].double(), want_l, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gathered.grad[:, j, ..., v:].double(), want_m, atol=1e-5, rtol=1e-5)
