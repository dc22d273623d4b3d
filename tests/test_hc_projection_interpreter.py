"""The mHC projection's Triton kernels (kernels/hc/projection_triton.py) under Triton's CPU interpreter.

The interpreter has no bfloat16 (a bf16 tensor or cast comes out as garbage there), so the check runs a copy of
the kernels' source with ``tl.bfloat16`` replaced by ``tl.float32`` on float32 tensors: what it checks is the
kernels' indexing, masking and arithmetic (row and column tails, the RMS term, the mHC block's two added
gradients with column blocks that straddle streams), not the bf16 splits. Expected values: float64 autograd of
``rsqrt(mean(x^2) + eps) * (x @ w^T)`` plus the added terms written out. The bf16 kernels themselves are checked
on a GPU by tests/gpu/hc_projection_check.py.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import importlib.util, sys, torch, triton
    source = open("kernels/hc/projection_triton.py").read().replace("tl.bfloat16", "tl.float32")
    assert "tl.float32" in source
    path = sys.argv[1] + "/projection_triton_f32.py"
    open(path, "w").write(source)
    spec = importlib.util.spec_from_file_location("projection_triton_f32", path)
    pt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pt)

    g = torch.Generator().manual_seed(0)
    # 70 rows: a partial row block; h 48 with 32-column dx tiles: tiles straddle streams; p 24 padded to 32
    m, n, h, p, eps = 70, 4, 48, 24, 1e-6
    k = n * h
    x = torch.randn(m, k, generator=g)
    w = 0.02 * torch.randn(p, k, generator=g)
    grad, pre = torch.randn(m, p, generator=g), torch.rand(m, n, generator=g)
    block_grad, streams_grad = torch.randn(m, h, generator=g), torch.randn(m, k, generator=g)
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    want = (x64 @ w64.T) / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    dx64, dw64 = torch.autograd.grad(want, (x64, w64), grad.double())
    extra64 = streams_grad.double() + (pre.double()[:, :, None] * block_grad.double()[:, None, :]).flatten(1)

    bp = pt._block_p(p)
    wp = pt._padded_weight(w, bp)
    out, y, rstd = torch.empty(m, p), torch.empty(m, p), torch.empty(m, 1)
    pt.hc_projection_fwd_kernel[(triton.cdiv(m, pt.BLOCK_M),)](
        x, wp, out, y, rstd, m, k, p, eps, x.stride(0), wp.stride(0), out.stride(0), y.stride(0),
        W_PARTS=3, BLOCK_M=pt.BLOCK_M, BLOCK_K=pt.BLOCK_K, BLOCK_P=bp)
    assert torch.allclose(out.double(), want.detach(), rtol=1e-5, atol=1e-6), (out.double() - want).abs().max()
    # columns per program: the default (one program spans all 192), and 128 (two programs, the second a tail)
    for extra, columns in ((False, pt.DX_COLUMNS), (True, pt.DX_COLUMNS), (True, 2 * pt.DX_BLOCK_K)):
        dx = torch.full_like(x, float("nan"))
        terms = (pre, block_grad, streams_grad) if extra else (x, x, x)
        pt.launch_dx(grad, y, rstd, x, wp, dx, *terms, h if extra else k, 3, extra, columns)
        ref = dx64 + extra64 if extra else dx64
        assert torch.allclose(dx.double(), ref, rtol=1e-4, atol=1e-5), (extra, columns, (dx.double() - ref).abs().max())

    # h 64: every 32-column tile lies in one stream (the kernel's one-value-per-row pre); 3 streams, 3 programs
    n2, h2 = 3, 64
    k2 = n2 * h2
    x2, w2 = torch.randn(m, k2, generator=g), 0.02 * torch.randn(p, k2, generator=g)
    pre2, bg2, sg2 = torch.rand(m, n2, generator=g), torch.randn(m, h2, generator=g), torch.randn(m, k2, generator=g)
    x64, w64 = x2.double().requires_grad_(True), w2.double().requires_grad_(True)
    want = (x64 @ w64.T) / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    ref = torch.autograd.grad(want, x64, grad.double())[0] + sg2.double() + \
        (pre2.double()[:, :, None] * bg2.double()[:, None, :]).flatten(1)
    wp2 = pt._padded_weight(w2, bp)
    y2 = (x2 @ w2.T).contiguous()
    rstd2 = torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + eps)
    dx = torch.full_like(x2, float("nan"))
    pt.launch_dx(grad, y2, rstd2, x2, wp2, dx, pre2, bg2, sg2, h2, 3, True, 2 * pt.DX_BLOCK_K)
    assert torch.allclose(dx.double(), ref, rtol=1e-4, atol=1e-5), (dx.double() - ref).abs().max()
    part = torch.empty(2, p, k)
    pt.hc_projection_dw_kernel[(triton.cdiv(k, pt.BLOCK_K), 2)](
        grad, y, rstd, x, part, m, k, p, 64, grad.stride(0), y.stride(0), x.stride(0), part.stride(0),
        part.stride(1), BLOCK_M=pt.BLOCK_M, BLOCK_K=pt.BLOCK_K, BLOCK_P=bp)
    assert torch.allclose(part.sum(0).double(), dw64, rtol=1e-4, atol=1e-5), (part.sum(0).double() - dw64).abs().max()
    print("HC_INTERPRETER_OK")
    """
)


def test_hc_projection_kernels_under_the_interpreter_equal_float64(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=root, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0 and "HC_INTERPRETER_OK" in result.stdout, result.stderr[-3000:]
