"""The grouped-GEMM routed experts (model/moe.py) compute what one MLP per expert computes."""

import torch
import torch.nn.functional as F

from model.config import preset
from model.glm5_next import build_model
from model.moe import GroupedMLP, grouped_swiglu_experts

from test_model_features import _assert_same, _ids, _loss_and_grads


def _per_expert_loop_float64(x, tokens_per_expert, fc1, fc2, probs, clamp):
    """Expert by expert, in float64: ``fc2_e(silu(min(g, c)) * clip(u, -c, c) * p)`` with ``[g | u] = fc1_e x``."""
    x, fc1, fc2, probs = (t.double() for t in (x, fc1, fc2, probs))
    outs, start = [], 0
    for e, n in enumerate(tokens_per_expert.tolist()):
        rows = x[start:start + n]
        gate, up = (rows @ fc1[e].T).split(fc1.shape[1] // 2, dim=-1)
        inner = F.silu(gate.clamp(max=clamp)) * up.clamp(-clamp, clamp) * probs[start:start + n, None]
        outs.append(inner @ fc2[e].T)
        start += n
    return torch.cat(outs)


def test_grouped_experts_match_a_per_expert_float64_loop_with_an_empty_expert():
    gen = torch.Generator().manual_seed(0)
    h, f = 24, 16
    tokens_per_expert = torch.tensor([5, 0, 9, 1, 13])         # an expert without tokens, odd counts
    total, experts = int(tokens_per_expert.sum()), len(tokens_per_expert)
    x = torch.randn(total, h, generator=gen, requires_grad=True)
    fc1 = (torch.randn(experts, 2 * f, h, generator=gen) * 0.5).requires_grad_()
    fc2 = (torch.randn(experts, h, f, generator=gen) * 0.5).requires_grad_()
    probs = torch.rand(total, generator=gen, requires_grad=True)
    clamp = 1.5                                                 # binds: fc1 rows reach |.| ~ 3
    out = grouped_swiglu_experts(x, tokens_per_expert, list(fc1.unbind(0)), list(fc2.unbind(0)), probs, clamp)
    ref = _per_expert_loop_float64(x, tokens_per_expert, fc1, fc2, probs, clamp)
    assert out.dtype == torch.float32 and out.shape == (total, h)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6
    upstream = torch.randn(total, h, generator=gen)
    grads = torch.autograd.grad(out, (x, fc1, fc2, probs), upstream)
    ref_grads = torch.autograd.grad(ref, (x, fc1, fc2, probs), upstream.double())
    for name, got, want in zip(("x", "fc1", "fc2", "probs"), grads, ref_grads):
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-6, name
    assert grads[1][1].abs().max() == 0 and grads[2][1].abs().max() == 0   # the empty expert learns nothing


def test_moe_experts_switch_picks_the_expert_module_and_keeps_parameter_names():
    grouped = build_model(preset("tiny"), seed=1)
    sequential = build_model(preset("tiny", moe_experts="sequential"), seed=1)
    moe = [layer for layer in grouped.layers if layer.is_moe]
    assert moe and all(isinstance(layer.mlp.experts, GroupedMLP) for layer in moe)
    assert not any(isinstance(layer.mlp.experts, GroupedMLP) for layer in sequential.layers if layer.is_moe)
    assert [k for k, _ in grouped.named_parameters()] == [k for k, _ in sequential.named_parameters()]


def test_grouped_and_sequential_experts_train_alike():
    # index_topk >= the sequence selects every pool: a reordered float32 sum cannot flip a DSA selection.
    ids = _ids()
    _assert_same(_loss_and_grads(preset("tiny", index_topk=512), ids),
                 _loss_and_grads(preset("tiny", index_topk=512, moe_experts="sequential"), ids))


def test_permutation_maps_follow_megatrons_order_and_invert_it():
    from model.moe import permutation_maps

    gen = torch.Generator().manual_seed(4)
    n, e, k = 37, 6, 3
    chosen = torch.rand(n, e, generator=gen).topk(k, dim=1).indices
    routing_map = torch.zeros(n, e, dtype=torch.bool).scatter_(1, chosen, True)
    order, rows, inverse = permutation_maps(routing_map, k)
    # expected, by a loop: expert by expert, its tokens in ascending order
    want = [(x, t) for x in range(e) for t in range(n) if routing_map[t, x]]
    assert rows.tolist() == [t for _, t in want]
    assert order.tolist() == [x * n + t for x, t in want]
    assert inverse.shape == (n, k)
    for t in range(n):
        got = sorted(inverse[t].tolist())
        assert got == [i for i, (_, tok) in enumerate(want) if tok == t]


def test_gather_dispatcher_matches_megatrons_allgather_dispatcher():
    # the same MoE layer, megatron's permutation vs gathers: equal outputs and gradients
    ids = _ids()
    _assert_same(_loss_and_grads(preset("tiny", index_topk=512, moe_permute="megatron"), ids),
                 _loss_and_grads(preset("tiny", index_topk=512, moe_permute="gather"), ids))


def test_moe_permute_switch_picks_the_dispatcher():
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    from model.moe import GatherTokenDispatcher

    gather = [layer.mlp for layer in build_model(preset("tiny"), seed=1).layers if layer.is_moe]
    stock = [layer.mlp for layer in build_model(preset("tiny", moe_permute="megatron"), seed=1).layers
             if layer.is_moe]
    assert gather and all(type(m.token_dispatcher) is GatherTokenDispatcher for m in gather)
    assert stock and all(type(m.token_dispatcher) is MoEAllGatherTokenDispatcher for m in stock)


def test_gather_permutation_backward_sums_each_tokens_rows():
    from model.moe import _Permute, _Unpermute, permutation_maps

    gen = torch.Generator().manual_seed(5)
    n, e, k, h = 11, 4, 2, 5
    chosen = torch.rand(n, e, generator=gen).topk(k, dim=1).indices
    routing_map = torch.zeros(n, e, dtype=torch.bool).scatter_(1, chosen, True)
    _, rows, inverse = permutation_maps(routing_map, k)
    x = torch.randn(n, h, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randn(n * k, h, generator=gen, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a: _Permute.apply(a, rows, inverse), (x,))
    torch.autograd.gradcheck(lambda a: _Unpermute.apply(a, rows, inverse), (y,))
    # unpermute(permute(x)) == k * x: every token comes back from its k experts
    assert torch.allclose(_Unpermute.apply(_Permute.apply(x, rows, inverse), rows, inverse), k * x)


def test_every_mlp_runs_the_clamped_swiglu_module_and_matches_float64():
    from megatron.core.transformer.mlp import MLP

    from model.moe import SwiGLUActivation

    for experts in ("grouped", "sequential"):
        model = build_model(preset("tiny", moe_experts=experts), seed=1)
        mlps = [m for m in model.modules() if isinstance(m, MLP)]   # dense, shared experts, sequential experts
        assert len(mlps) > sum(layer.is_moe for layer in model.layers)
        assert all(isinstance(m.activation_func, SwiGLUActivation) for m in mlps), experts
    dense = next(layer.mlp for layer in model.layers if not layer.is_moe)
    clamp = dense.config.activation_func_clamp_value
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 1, dense.config.hidden_size, generator=gen) * 40   # wide enough that both clamps bind
    out, _ = dense(x)
    fc1, fc2 = dense.linear_fc1.weight.double(), dense.linear_fc2.weight.double()
    gate, up = (x.double() @ fc1.T).chunk(2, dim=-1)
    assert (gate > clamp).any() and (up.abs() > clamp).any()
    ref = (F.silu(gate.clamp(max=clamp)) * up.clamp(-clamp, clamp)) @ fc2.T
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
