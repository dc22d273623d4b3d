"""The layer glue of model.fused: the functions against float64 definitions written out here, and each
traced whole by torch.compile (dynamo + AOT autograd, fullgraph) with the same values and gradients.

On a GPU ``model.fused.glue`` runs these functions through inductor; here the ``aot_eager`` backend
traces them the same way without generating code, so a graph break or an untraceable op fails on the
CPU. ``tests/gpu/fused_check.py`` runs inductor's kernels on an H200 against the same definitions. The
mHC projection is compiled by inductor itself here (its CPU code needs a C++ compiler): inductor's own
fusion of casts is what it must be kept out of.
"""

import shutil

import pytest
import torch
import torch.nn.functional as F

from kernels.hc import projection as fused_proj
from model import fused

N, H, T = 4, 32, 37


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _hc_maps_float64(streams, fn, base, scale, n, iters, hc_eps, norm_eps):
    # transformers' order: normalise the flattened streams, then project
    flat = streams.flatten(-2).double()
    flat = flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
    return _maps_of_logits_float64(flat @ fn.double().T, base, scale, n, iters, hc_eps)


def _maps_of_logits_float64(mixed, base, scale, n, iters, hc_eps):
    mixed, base, scale = mixed.double(), base.double(), scale.double()
    pre = torch.sigmoid(mixed[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mixed[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = torch.softmax(mixed[..., 2 * n:].unflatten(-1, (n, n)) * scale[2] + base[2 * n:].view(n, n), -1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def _streams_grad_args(streams, fn):
    flat = streams.flatten(-2).float()
    y = flat @ fn.T
    rstd = torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
    return (_rand(T, 1, (2 + N) * N, seed=23), y, rstd, streams, fn, torch.rand(T, 1, N),
            _rand(T, 1, H, seed=24), _rand(T, 1, N, H, seed=25))


def _streams_grad_float64(mixed_grad, y, rstd, streams, fn, pre, block_grad, streams_grad):
    # autograd through the float64 definition mixed = rsqrt(mean(flat^2) + eps) * flat @ fn^T, plus the two
    # other terms written out; rstd and y come from the float32 inputs, so eps is recovered from rstd
    flat = streams.flatten(-2).double().requires_grad_(True)
    fn64 = fn.double().requires_grad_(True)
    eps = (1 / rstd.double().square() - flat.detach().pow(2).mean(-1, keepdim=True)).mean().item()
    mixed = (flat @ fn64.T) / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
    d_flat, d_fn = torch.autograd.grad(mixed, (flat, fn64), mixed_grad.double())
    d_streams = d_flat.unflatten(-1, streams.shape[-2:]) + streams_grad.double() \
        + pre.double().unsqueeze(-1) * block_grad.double().unsqueeze(-2)
    return d_streams, d_fn


def _merge_backward_float64(grad, post, comb, out, streams):
    leaves = [t.double().requires_grad_(True) for t in (post, comb, out, streams)]
    mixed = leaves[0].unsqueeze(-1) * leaves[2].unsqueeze(-2) + leaves[1].transpose(-1, -2) @ leaves[3]
    return torch.autograd.grad(mixed, leaves, grad.double())


def _cases():
    streams = _rand(T, 1, N, H, seed=1)
    maps_args = (streams, 0.02 * _rand((2 + N) * N, N * H, seed=2), 0.1 * _rand((2 + N) * N, seed=3),
                 1 + 0.1 * _rand(3, seed=4), N, 20, 1e-6, 1e-6)
    post, comb = torch.rand(T, 1, N).double().float() * 2, torch.softmax(_rand(T, 1, N, N, seed=5), -1)
    x, w = _rand(T, H, seed=6), 1 + 0.1 * _rand(H, seed=7)
    hidden = 4 * _rand(T, 2 * H, seed=8)
    # bf16 streams with the tensor-core projection asked for: on CUDA (tests/gpu/fused_check.py)
    # model.fused.hc_projection, on the CPU the float32 GEMM; the same float64 definition either way.
    maps_bf16_args = (streams.to(torch.bfloat16), *maps_args[1:], "auto")
    return {
        "hc_maps": (fused.hc_maps, maps_args, lambda *a: _hc_maps_float64(*a)),
        "hc_maps_bf16_gemm": (fused.hc_maps, maps_bf16_args, lambda *a: _hc_maps_float64(*a[:8])),
        "hc_maps_of_logits": (fused.hc_maps_of_logits, (_rand(T, 1, (2 + N) * N, seed=21), *maps_args[2:7]),
                              lambda m, b, s, n, it, e: _maps_of_logits_float64(m, b, s, n, it, e)),
        "hc_collapse_weight_grad": (fused.hc_collapse_weight_grad, (_rand(T, 1, H, seed=22), streams),
                                    lambda g, s: torch.einsum("tbh,tbih->tbi", g.double(), s.double())),
        "hc_streams_grad_float32": (fused.hc_streams_grad_float32, _streams_grad_args(streams, maps_args[1]),
                                    _streams_grad_float64),
        "hc_merge_backward": (fused.hc_merge_backward, (_rand(T, 1, N, H, seed=26), post, comb, _rand(T, 1, H, seed=27),
                                                        streams), _merge_backward_float64),
        "hc_collapse": (fused.hc_collapse, (torch.rand(T, 1, N), streams),
                        lambda pre, s: (pre.double().unsqueeze(-1) * s.double()).sum(-2)),
        "hc_merge": (fused.hc_merge, (post, comb, _rand(T, 1, H, seed=9), streams),
                     lambda p, c, o, s: p.double().unsqueeze(-1) * o.double().unsqueeze(-2)
                     + c.double().transpose(-1, -2) @ s.double()),
        "rms_norm": (lambda x, w, eps: fused.rms_norm(x, w, eps)[0], (x, w, 1e-6),
                     lambda x, w, eps: w.double() * x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)),
        "kda_gate": (fused.kda_gate, (_rand(T, 2 * H, seed=10), _rand(2 * H, seed=11), _rand(2, seed=12), 2, H, -5.0),
                     lambda f, b, a, h, d, lb: lb * torch.sigmoid(a.double().exp().view(h, 1)
                                                                  * (f.double() + b.double()).unflatten(-1, (h, d)))),
        "gated_rms_norm": (fused.gated_rms_norm, (_rand(T, 2, H, seed=13), _rand(T, 2, H, seed=14), w, 1e-6,
                                                  torch.float32),
                           lambda o, g, w, eps, _: w.double() * o.double() / torch.sqrt(
                               o.double().pow(2).mean(-1, keepdim=True) + eps) * torch.sigmoid(g.double())),
        "swiglu_probs": (fused.swiglu_probs, (hidden, torch.rand(T), 7.0, 0.0),
                         lambda h, p, c, off: F.silu(h[:, :H].double().clamp(max=c))
                         * (h[:, H:].double().clamp(-c, c) + off) * p.double().unsqueeze(-1)),
    }


def _leaves(args):
    return [a.clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args]


def _outputs(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("name", list(_cases()))
def test_glue_function_equals_its_float64_definition(name):
    fn, args, reference = _cases()[name]
    got, want = _outputs(fn(*args)), _outputs(reference(*args))
    assert len(got) == len(want)
    for g, r in zip(got, want):
        assert torch.allclose(g.double(), r, rtol=2e-5, atol=2e-6), (name, (g.double() - r).abs().max().item())


@pytest.mark.parametrize("name", list(_cases()))
def test_glue_function_traces_whole_and_the_traced_gradients_equal_eager(name):
    fn, args, _ = _cases()[name]
    torch._dynamo.reset()
    traced = torch.compile(fn, fullgraph=True, backend="aot_eager")
    results = []
    for call in (fn, traced):
        leaves = _leaves(args)
        outs = _outputs(call(*leaves))
        # a fixed random cotangent per output, so every output's backward is exercised
        loss = sum((o.float() * _rand(*o.shape, seed=20 + i)).sum() for i, o in enumerate(outs))
        loss.backward()
        results.append((outs, [a.grad for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]))
    (outs_e, grads_e), (outs_t, grads_t) = results
    for a, b in zip(outs_e + grads_e, outs_t + grads_t):
        assert a is not None and b is not None
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6), (name, (a - b).abs().max().item())


def test_rms_norm_backward_equals_autograd_in_bfloat16():
    x, w = _rand(T, H, dtype=torch.bfloat16, seed=15), (1 + 0.1 * _rand(H, seed=16)).to(torch.bfloat16)
    grad = _rand(T, H, dtype=torch.bfloat16, seed=17)
    xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out, _ = fused.rms_norm(xl, wl, 1e-6)
    out.backward(grad)
    _, rstd = fused.rms_norm(x, w, 1e-6)
    grad_x, grad_w = fused.rms_norm_backward(grad, x, w, rstd)
    assert torch.allclose(grad_x.float(), xl.grad.float(), rtol=1e-2, atol=1e-2)
    assert torch.allclose(grad_w.float(), wl.grad.float(), rtol=1e-2, atol=1e-2)


def test_glue_stays_eager_for_cpu_tensors(monkeypatch):
    monkeypatch.setattr(fused, "_compiled", lambda fn: pytest.fail("compiled a CPU call"))
    x = _rand(3, H)
    assert torch.equal(fused.glue(fused.rms_norm, True, x, torch.ones(H), 1e-6)[0], fused.rms_norm(x, torch.ones(H), 1e-6)[0])


def test_a_glue_function_serves_more_variants_than_dynamos_default_recompile_limit():
    """RL, verify and evaluate in one GPU process called rms_norm with more than 8 (dtype, width,
    rank, requires_grad, length) variants; with fullgraph=True the ninth failed. ``eager`` backend:
    the limit is dynamo's, whatever compiles the graph."""
    torch._dynamo.reset()
    compiled = fused._compiled(fused.rms_norm, backend="eager")
    variants = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shape in ((5, 64), (1, 9, 96), (7, 1, 2, 128)):
            for requires_grad in (False, True):
                x = _rand(*shape, dtype=dtype, seed=variants).requires_grad_(requires_grad)
                weight = torch.ones(shape[-1], dtype=dtype)
                assert torch.equal(compiled(x, weight, 1e-6)[0], fused.rms_norm(x, weight, 1e-6)[0])
                variants += 1
    assert variants == 18


def test_bf16_parts_sum_to_float32_exactly_with_three_parts():
    x = _rand(4096, seed=30) * torch.logspace(-30, 30, 4096, dtype=torch.float64)
    x = x.float()
    three, two = fused.bf16_parts(x, 3), fused.bf16_parts(x, 2)
    assert three.dtype == torch.bfloat16 and three.shape == (3, 4096)
    assert torch.equal(three.double().sum(0), x.double())
    # two parts: about 16 mantissa bits (each part rounds to nearest, so 2^-17 of the value)
    assert ((two.double().sum(0) - x.double()).abs() <= 2.0 ** -16 * x.double().abs()).all()


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_hc_projection_equals_its_float64_definition_with_bf16_level_gradients(weight_dtype):
    # rsqrt(mean(x^2) + eps) * (x @ w^T) and its gradients in float64 from the same bf16 / float32 values
    m, k, p, eps = 300, 4 * H, (2 + N) * N, 1e-6
    x = _rand(m, k, dtype=torch.bfloat16, seed=31)
    w = (0.02 * _rand(p, k, seed=32)).to(weight_dtype)
    cotangent = _rand(m, p, seed=33)
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    want = (x64 @ w64.T) / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    want.backward(cotangent.double())
    xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    got = fused.hc_projection(xl, wl, eps)
    got.backward(cotangent)
    assert got.dtype == torch.float32 and xl.grad.dtype == torch.bfloat16 and wl.grad.dtype == weight_dtype
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
    # dx: one bf16 rounding (2^-9 of each value) plus the ~2^-16 of the split operands
    dx64 = x64.grad
    assert ((xl.grad.double() - dx64).abs() <= 2.0 ** -8 * dx64.abs() + 1e-5 * dx64.abs().max()).all()
    dw64 = w64.grad
    if weight_dtype == torch.float32:
        assert torch.allclose(wl.grad.double(), dw64, rtol=0, atol=2e-5 * dw64.abs().max().item())
    else:
        assert ((wl.grad.double() - dw64).abs() <= 2.0 ** -8 * dw64.abs() + 1e-5 * dw64.abs().max()).all()
    with pytest.raises(ValueError, match="bf16 streams"):
        fused.hc_projection(x.float(), w, eps)


@pytest.mark.skipif(shutil.which("c++") is None, reason="inductor's CPU code generation needs a C++ compiler")
def test_hc_projection_compiled_by_inductor_keeps_its_low_parts():
    # Inductor fuses part.float() of rest.to(bf16) without the rounding: traced into a graph, the
    # split's low parts came out zero and the gradients bf16-level (dx, dw ~2e-3 from eager). The
    # custom ops keep the projection whole under torch.compile: the same values and gradients.
    x = _rand(5, 7, 4 * H, dtype=torch.bfloat16, seed=34)
    w = 0.02 * _rand((2 + N) * N, 4 * H, seed=35)
    torch._dynamo.reset()
    traced = torch.compile(fused.hc_projection, fullgraph=True, backend="inductor")
    results = []
    for call in (fused.hc_projection, traced):
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = call(xl, wl, 1e-6)
        (out * _rand(*out.shape, seed=36)).sum().backward()
        results.append((out, xl.grad, wl.grad))
    assert results[0][0].shape == (5, 7, (2 + N) * N)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_hyper_connection_block_gradients_equal_autograd_of_its_parts(dtype):
    """The block's one autograd node (maps, collapse and the streams handed to the merge) against plain
    autograd through ``hc_maps``, ``hc_collapse`` and ``hc_merge`` of the same streams, in float64."""
    from model.config import preset
    from model.layers import HyperConnection

    cfg = preset("tiny")
    hc = HyperConnection(cfg)
    with torch.no_grad():
        hc.base.copy_(0.1 * _rand(*hc.base.shape, seed=40))
        hc.scale.add_(0.1 * _rand(3, seed=41))
    streams = _rand(9, 2, cfg.hc_mult, cfg.hidden_size, seed=42).to(dtype)
    block_out = _rand(9, 2, cfg.hidden_size, seed=43)
    cot = _rand(9, 2, cfg.hc_mult, cfg.hidden_size, seed=44)

    def loss(post, comb, collapsed, s):
        merged = fused.hc_merge(post, comb, (torch.tanh(collapsed.double()) * block_out).to(s.dtype), s)
        return (merged.double() * cot).sum() + (collapsed.double() * block_out).sum()

    params = [hc.fn, hc.base, hc.scale]
    s_node = streams.clone().requires_grad_(True)
    post, comb, collapsed, handed = hc(s_node)
    assert handed.data_ptr() == s_node.data_ptr() and handed.grad_fn is not None
    got = torch.autograd.grad(loss(post, comb, collapsed, handed), [s_node, *params])
    # the reference: the same float64 math as separate autograd nodes
    s64 = streams.double().requires_grad_(True)
    p64 = [p.detach().double().requires_grad_(True) for p in params]
    pre, post, comb = _hc_maps_float64(s64, *p64, hc.n, hc.iters, hc.hc_eps, hc.norm_eps)
    want = torch.autograd.grad(loss(post, comb, (pre.unsqueeze(-1) * s64).sum(-2), s64), [s64, *p64])
    assert got[0].dtype == dtype and got[1].dtype == hc.fn.dtype
    tol = {torch.float64: 1e-4, torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype]   # float32 maps in every case
    for name, g, w in zip(("streams", "fn", "base", "scale"), got, want):
        err = (g.double() - w).abs().max().item()
        assert err <= tol * w.abs().max().item(), (name, err, w.abs().max().item())
    # only the collapsed input used: the maps' and the merge's gradients are absent, the streams' comes from pre
    s_node = streams.clone().requires_grad_(True)
    _, _, collapsed, _ = hc(s_node)
    (g_only,) = torch.autograd.grad((collapsed.double() * block_out).sum(), [s_node])
    s64 = streams.double().requires_grad_(True)
    pre = _hc_maps_float64(s64, *p64, hc.n, hc.iters, hc.hc_eps, hc.norm_eps)[0]
    (w_only,) = torch.autograd.grad(((pre.unsqueeze(-1) * s64).sum(-2) * block_out).sum(), [s64])
    assert (g_only.double() - w_only).abs().max().item() <= tol * w_only.abs().max().item()


def test_projection_backward_reference_adds_the_streams_other_gradients():
    # the tensor-core path's reference with the collapse's and the merge's terms, against float64 autograd of the
    # projection plus those terms written out (tests/gpu/hc_projection_check.py holds the GPU kernel to the same)
    m, n, h, p, eps = 50, N, H, (2 + N) * N, 1e-6
    x = _rand(m, n * h, dtype=torch.bfloat16, seed=50)
    w = 0.02 * _rand(p, n * h, seed=51)
    _, y, rstd = fused_proj.torch_hc_projection_fwd(x, w, eps)
    grad, pre = _rand(m, p, seed=52), torch.rand(m, n, generator=torch.Generator().manual_seed(53))
    block_grad = _rand(m, h, dtype=torch.bfloat16, seed=54)
    streams_grad = _rand(m, n * h, dtype=torch.bfloat16, seed=55)
    dx, dw = fused_proj.hc_projection_streams_grad(grad, x, w, y, rstd, pre, block_grad, streams_grad)
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    mixed = (x64 @ w64.T) / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    dx64, dw64 = torch.autograd.grad(mixed, (x64, w64), grad.double())
    collapse = (pre.double()[:, :, None] * block_grad.double()[:, None, :]).flatten(1)
    want = dx64 + streams_grad.double() + collapse
    assert dx.dtype == torch.bfloat16 and dw.dtype == w.dtype
    # dx: one bf16 rounding (2^-9 of each value) plus the ~2^-16 of the split operands, as the plain backward's test
    assert ((dx.double() - want).abs() <= 2.0 ** -8 * want.abs() + 1e-5 * want.abs().max()).all()
    assert torch.allclose(dw.double(), dw64, rtol=0, atol=2e-5 * dw64.abs().max().item())
    # and the terms are there: without them the result is far off
    assert ((dx64 - want).abs() > 0.1).any()


def test_per_head_matmul_is_the_einsum_token_major_with_its_gradients():
    from model.layers import per_head_matmul

    gen = torch.Generator().manual_seed(0)
    kv_b = torch.randn(3, 4 + 6, 7, generator=gen, dtype=torch.float64)   # [H, nope + v, c] as kv_b_proj's view
    # q W_UK (a slice of kv_b) and o_lat W_UV^T (a transposed slice), as DSAMixer forms them
    for width, absorb in ((4, lambda w: w[:, :4]), (7, lambda w: w[:, 4:].transpose(1, 2))):
        x = torch.randn(2, 5, 3, width, generator=gen, dtype=torch.float64)
        want_x, want_w = x.clone().requires_grad_(), kv_b.clone().requires_grad_()
        want = torch.einsum("bshi,hij->bshj", want_x, absorb(want_w))
        target = torch.randn(want.shape, generator=gen, dtype=torch.float64)
        want.backward(target)
        for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
            got_x, got_w = (t.to(dtype, copy=True).requires_grad_() for t in (x, kv_b))
            got = per_head_matmul(got_x, absorb(got_w))
            assert got.is_contiguous() and got.shape == want.shape
            got.backward(target.to(dtype))
            assert got_x.grad.is_contiguous()
            for a, b in ((got, want), (got_x.grad, want_x.grad), (got_w.grad, want_w.grad)):
                assert ((a.double() - b).norm() / b.norm()).item() < tol
    with pytest.raises(ValueError, match="per_head_matmul"):
        per_head_matmul(x, kv_b[:2, :4])
