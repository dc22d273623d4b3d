"""The mHC maps' and merge-backward Triton kernels (kernels/hc/maps_triton.py, merge_triton.py) under Triton's CPU
interpreter, and the layer's wiring of them.

The maps are float32 throughout, so the interpreter runs exactly the arithmetic a GPU runs; the merge backward
has no bf16 arithmetic of its own and runs here on float32 tensors. Expected values: autograd of the torch
definitions (:func:`model.fused.hc_maps_of_logits`, :func:`model.fused.hc_merge`) in float64. The interpreter must
be chosen before the kernels are defined, so the checks run in a subprocess with ``TRITON_INTERPRET=1``.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

KERNELS = textwrap.dedent(
    """
    import torch
    from kernels.hc.maps_triton import triton_hc_maps_bwd, triton_hc_maps_fwd
    from model.fused import hc_maps_of_logits

    g = torch.Generator().manual_seed(0)
    # n 4 (the presets), 3 (padded to 4 inside the kernel), 2; 20 Sinkhorn iterations, 5, 2 and 1 (the first
    # column normalisation only); 150 tokens: a partial last block of 64; leading dims [5, 30]
    for n, iters in ((4, 20), (3, 5), (2, 2), (4, 1)):
        p = (2 + n) * n
        mixed = 2 * torch.randn(5, 30, p, generator=g)
        base, scale = 0.3 * torch.randn(p, generator=g), 1 + 0.2 * torch.randn(3, generator=g)
        leaves = [t.double().requires_grad_(True) for t in (mixed, base, scale)]
        want = hc_maps_of_logits(*leaves, n, iters, 1e-6)
        got = triton_hc_maps_fwd(mixed, base, scale, n, iters, 1e-6)
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == torch.float32
            assert torch.allclose(a.double(), b, rtol=1e-5, atol=1e-6), (n, iters, (a.double() - b).abs().max())
        cot = [torch.randn(w.shape, generator=g) for w in want]
        for used in ((0, 1, 2), (2,), (0, 1)):   # an unused output's gradient is None
            grads = [cot[i] if i in used else None for i in range(3)]
            ref = torch.autograd.grad([want[i] for i in used], leaves, [cot[i].double() for i in used],
                                      retain_graph=True)
            *got_grads, pre = triton_hc_maps_bwd(mixed, base, scale, n, iters, 1e-6, *grads)
            assert pre.shape == want[0].shape and torch.allclose(pre.double(), want[0], rtol=1e-5, atol=1e-6)
            for name, a, b in zip(("mixed", "base", "scale"), got_grads, ref):
                assert a.shape == b.shape, (name, a.shape, b.shape)
                err = (a.double() - b).abs().max().item()
                assert err <= 1e-5 * max(1.0, b.abs().max().item()), (n, iters, used, name, err)
    try:
        triton_hc_maps_fwd(torch.zeros(3, 23), torch.zeros(24), torch.ones(3), 4, 20, 1e-6)
        raise AssertionError("a wrong width passed")
    except ValueError as e:
        assert "[..., (2+n)n]" in str(e)
    print("MAPS_OK")
    """
)

MERGE = textwrap.dedent(
    """
    import itertools
    import torch
    import kernels.hc.merge_triton as mt
    from kernels.hc.merge_triton import triton_hc_merge_bwd
    from model.fused import hc_merge

    g = torch.Generator().manual_seed(0)
    # every autotuned tile, one at a time (the interpreter has no benchmarker). h 200: a partial last column
    # chunk; n 3: the fourth stream slot masked; 21, 9 and 17 tokens: partial token blocks
    cases = ((4, 200, 21), (3, 64, 9), (4, 1024, 17))
    for cfg, (n, h, tokens) in itertools.product(mt.MERGE_BWD_CONFIGS, cases):
        mt.hc_merge_bwd_kernel.configs = [cfg]
        post = 2 * torch.rand(tokens, 1, n, generator=g)
        comb = torch.softmax(torch.randn(tokens, 1, n, n, generator=g), -1)
        out, streams = torch.randn(tokens, 1, h, generator=g), torch.randn(tokens, 1, n, h, generator=g)
        grad = torch.randn(tokens, 1, n, h, generator=g)
        leaves = [x.double().requires_grad_(True) for x in (post, comb, out, streams)]
        want = torch.autograd.grad(hc_merge(*leaves), leaves, grad.double())
        for name, a, b in zip(("post", "comb", "out", "streams"), triton_hc_merge_bwd(grad, post, comb, out, streams),
                              want):
            assert a.shape == b.shape and a.dtype == torch.float32, (name, a.shape, b.shape)
            err = (a.double() - b).abs().max().item()
            assert err <= 2e-6 * max(1.0, b.abs().max().item()), (cfg, n, h, name, err)
    try:
        triton_hc_merge_bwd(torch.zeros(3, 4, 8), torch.zeros(3, 4), torch.zeros(3, 4, 4), torch.zeros(3, 7),
                            torch.zeros(3, 4, 8))
        raise AssertionError("a wrong block-output width passed")
    except ValueError as e:
        assert "do not fit" in str(e)
    print("MERGE_OK")
    """
)

WIRING = textwrap.dedent(
    """
    import torch
    import kernels.hc.merge_triton as mt
    import model.layers as layers
    from model.config import preset

    mt.hc_merge_bwd_kernel.configs = mt.MERGE_BWD_CONFIGS[:1]   # one tile: the interpreter has no benchmarker

    # the block and its merge with the Triton kernels (forced on the CPU, run by the interpreter) against the torch
    # maps and merge backward, both through the float32 projection: the same values and gradients
    cfg = preset("tiny")
    torch.manual_seed(0)   # the projection's other parameters are initialized from the global generator
    hc = layers.HyperConnection(cfg)
    with torch.no_grad():
        hc.base.normal_(std=0.2, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    streams = torch.randn(70, 1, cfg.hc_mult, cfg.hidden_size, generator=g)
    block = torch.randn(70, 1, cfg.hidden_size, generator=g)
    cot = torch.randn(70, 1, cfg.hc_mult, cfg.hidden_size, generator=g)
    results = []
    for triton in (False, True):
        layers._triton_mhc = lambda t, on=triton: on
        s = streams.clone().requires_grad_(True)
        post, comb, collapsed, handed = hc(s)
        loss = (layers.merge_streams(post, comb, torch.tanh(collapsed) * block, handed, False) * cot).sum()
        grads = torch.autograd.grad(loss, [s, hc.fn, hc.base, hc.scale])
        results.append((post, comb, collapsed, *grads))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item()), (a - b).abs().max()
    print("WIRING_OK")
    """
)


def _run(script: str, marker: str):
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0 and marker in result.stdout, result.stderr[-3000:]


def test_hc_maps_kernels_under_the_interpreter_equal_float64_autograd():
    _run(KERNELS, "MAPS_OK")


def test_hc_merge_backward_kernel_under_the_interpreter_equals_float64_autograd():
    _run(MERGE, "MERGE_OK")


def test_hyper_connection_and_merge_with_the_triton_kernels_equal_the_torch_paths():
    _run(WIRING, "WIRING_OK")
