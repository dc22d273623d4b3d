"""Two layout paths of the SFT step on a GPU: correctness, then time, each against the path it replaces.

1. KDA short convolution (``model.layers._depthwise_causal_conv``): fla's Triton ``causal_conv1d``
   (``backend="auto"``) against the cuDNN ``conv1d`` path (``backend="torch"``) and a float64 CPU
   reference, with a convolution history (context parallelism): outputs and the gradients of the
   input, the weight and the history.
2. MoE token permutation (``model.moe``): the gathers of :class:`model.moe.GatherTokenDispatcher`
   against megatron's ``permute`` / ``unpermute`` (``index_select`` + ``index_add_`` backward,
   ``scatter_add_``): the permuted rows, the combined tokens and the input gradient.

Times: forward + backward at the ``small`` preset's widths and ``--tokens`` tokens (the conv on one
of q/k/v, ``[1, T, 1024]`` bf16, times three per KDA layer; the permutation of ``T`` tokens of 1024
to 4 of 16 experts, times one per MoE layer), median of CUDA events.

    python tests/gpu/glue_paths_check.py --tokens 65536 --out $OUT/glue_paths.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from fused_check import _time as _time_s  # noqa: E402


def _time(fn) -> float:
    """Median milliseconds of ``fn()`` (CUDA events, after warm-ups; ``fused_check._time``)."""
    return 1e3 * _time_s(fn, reps=20)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def conv_check(tokens: int) -> dict:
    from model.layers import _depthwise_causal_conv

    gen = torch.Generator().manual_seed(0)
    b, s, c, k = 2, 1000, 96, 4
    x = torch.randn(b, s, c, generator=gen)
    w = torch.randn(c, k, generator=gen) * 0.5
    hist = torch.randn(b, k - 1, c, generator=gen)
    dy = torch.randn(b, s, c, generator=gen)
    leaves = [t.double().requires_grad_() for t in (x, w, hist)]
    ref = _depthwise_causal_conv(*leaves, backend="torch")
    ref_grads = torch.autograd.grad(ref, leaves, dy.double())
    row = {"case": "conv", "shape": [b, s, c, k]}
    for backend in ("auto", "torch"):
        leaves = [t.cuda().bfloat16().requires_grad_() if i != 1 else t.cuda().requires_grad_()
                  for i, t in enumerate((x, w, hist))]
        out = _depthwise_causal_conv(*leaves, backend=backend)
        grads = torch.autograd.grad(out, leaves, dy.cuda().bfloat16())
        row[backend] = {"out": _rel(out, ref), **{f"d{n}": _rel(g, r) for n, g, r in
                                                  zip(("x", "w", "history"), grads, ref_grads)}}
    ok = all(v < 2e-2 for v in row["auto"].values())
    row["ok"] = ok
    xb = torch.randn(1, tokens, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wb = torch.randn(1024, k, device="cuda", requires_grad=True)
    gy = torch.randn_like(xb)
    for backend in ("torch", "auto"):
        def step():
            y = _depthwise_causal_conv(xb, wb, None, backend=backend)
            torch.autograd.grad(y, (xb, wb), gy)
        row[f"ms_fwd_bwd_{backend}"] = _time(step)
    row["min_bytes_mb"] = 5 * xb.numel() * 2 / 1e6   # x, y, dy, dx, and x again in backward
    return row


def permute_check(tokens: int) -> dict:
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    from model.moe import _Permute, _Unpermute, permutation_maps

    gen = torch.Generator(device="cuda").manual_seed(1)

    def routing(n, e, k):
        chosen = torch.rand(n, e, generator=gen, device="cuda").topk(k, dim=1).indices
        return torch.zeros(n, e, dtype=torch.bool, device="cuda").scatter_(1, chosen, True)

    n, e, k, h = 3000, 16, 4, 64
    rmap = routing(n, e, k)
    x = torch.randn(n, h, generator=gen, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(n, h, generator=gen, device="cuda", dtype=torch.bfloat16)
    results = {}
    for path in ("megatron", "gather"):
        xi = x.clone().requires_grad_()
        if path == "megatron":
            perm, _, idx, _, _ = permute(xi, rmap, num_out_tokens=n * k)
            scaled = perm * (1 + torch.arange(n * k, device="cuda")[:, None] % 3)
            out = unpermute(scaled, idx, restore_shape=xi.shape)
        else:
            _, rows, inverse = permutation_maps(rmap, k)
            perm = _Permute.apply(xi, rows, inverse)
            scaled = perm * (1 + torch.arange(n * k, device="cuda")[:, None] % 3)
            out = _Unpermute.apply(scaled, rows, inverse)
        (dx,) = torch.autograd.grad(out, xi, dy)
        results[path] = (perm.detach(), out.detach(), dx)
    row = {"case": "permute", "shape": [n, e, k, h],
           "perm_equal": bool(torch.equal(results["megatron"][0], results["gather"][0]))}
    # float64 reference of the combine and its gradient: per token, the sum of its k scaled rows
    _, rows, _ = permutation_maps(rmap, k)
    scale = (1 + torch.arange(n * k, device="cuda") % 3).double()
    want_out = torch.zeros(n, h, dtype=torch.float64, device="cuda").index_add_(
        0, rows, x.double()[rows] * scale[:, None])
    want_dx = torch.zeros(n, h, dtype=torch.float64, device="cuda").index_add_(
        0, rows, dy.double()[rows] * scale[:, None])
    for path in ("megatron", "gather"):
        row[path] = {"out": _rel(results[path][1], want_out), "dx": _rel(results[path][2], want_dx)}
    row["ok"] = row["perm_equal"] and all(v < 1e-2 for v in row["gather"].values())
    n, h = tokens, 1024
    rmap = routing(n, e, k)
    xb = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)

    def megatron_path():
        perm, _, idx, _, _ = permute(xb, rmap, num_out_tokens=int(rmap.sum().item()))
        torch.autograd.grad(unpermute(perm, idx, restore_shape=xb.shape), xb, gy)

    def gather_path():
        _, rows, inverse = permutation_maps(rmap, k)
        torch.autograd.grad(_Unpermute.apply(_Permute.apply(xb, rows, inverse), rows, inverse), xb, gy)

    row["ms_fwd_bwd_megatron"] = _time(megatron_path)
    row["ms_fwd_bwd_gather"] = _time(gather_path)
    row["min_bytes_mb"] = 4 * (n * k * h * 2 + n * h * 2) / 1e6   # four passes over the routed rows
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = [conv_check(args.tokens), permute_check(args.tokens)]
    Path(args.out).write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(json.dumps(r))
    print(f"\n| path ({args.tokens} tokens) | before (ms, fwd+bwd) | after (ms) | min bytes (MB) |")
    print("|---|---|---|---|")
    print(f"| KDA short conv, one of q/k/v: cuDNN -> fla | {rows[0]['ms_fwd_bwd_torch']:.3f} | "
          f"{rows[0]['ms_fwd_bwd_auto']:.3f} | {rows[0]['min_bytes_mb']:.0f} |")
    print(f"| MoE permute + unpermute: megatron -> gathers | {rows[1]['ms_fwd_bwd_megatron']:.3f} | "
          f"{rows[1]['ms_fwd_bwd_gather']:.3f} | {rows[1]['min_bytes_mb']:.0f} |")
    print("ALL OK" if all(r["ok"] for r in rows) else "FAILED")
    if not all(r["ok"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
