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
