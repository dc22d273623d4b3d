"""The mHC projection's Triton forward, case by case: ``y`` against float64 for 300 / 4,096 / 65,536 rows, each
weight dtype (bf16, float32, bf16 widened to float32) and ``num_stages`` 1 and 3, with the largest error, the
elements past ``1e-5 |y| + 1e-6 max |y|`` (how many, in which rows, 64-row blocks and columns) and whether two
calls give the same bits. Where ``hc_projection_check`` says that a case fails, this says where: it located the
wrong, run-to-run different ``y`` of a bf16 weight loaded straight into ``tl.dot`` with 3 stages
(``docs/measurements.md``). Since that fix the launcher widens every weight to float32
(``projection_triton._padded_weight``), so the ``bf16`` and ``bf16->f32`` rows run the same kernel on the same
values: they must agree bit for bit.

    python tests/gpu/hc_projection_diag.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import kernels.hc.projection_triton as pt  # noqa: E402

P = 24
for k in (4096, 16384):
    for m in (300, 4096, 65_536):
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        w32 = 0.02 * torch.randn(P, k, generator=g, device="cuda")
        for wname, w in (("bf16", w32.to(torch.bfloat16)), ("f32", w32), ("bf16->f32", w32.to(torch.bfloat16).float())):
            want = x.double() @ w.double().T
            for stages in (1, 3):
                pt.STAGES = stages
                _, y, _ = pt.triton_hc_projection_fwd(x, w, 1e-6)
                _, y2, _ = pt.triton_hc_projection_fwd(x, w, 1e-6)
                err = (y.double() - want).abs()
                bad = err > (1e-5 * want.abs() + 1e-6 * want.abs().max())
                rows = bad.any(1).nonzero().flatten()
                cols = bad.any(0).nonzero().flatten()
                blocks = torch.unique(rows // pt.BLOCK_M)
                print(f"k={k:>5} m={m:>6} w={wname:<9} stages={stages} max err {err.max().item():.3e} "
                      f"(|y| max {want.abs().max().item():.2f}) bad {int(bad.sum())} in {len(rows)} rows / "
                      f"{len(blocks)} blocks {blocks[:6].tolist()} cols {cols.tolist()[:8]} repeat bitwise "
                      f"{torch.equal(y, y2)}", flush=True)
pt.STAGES = 3
