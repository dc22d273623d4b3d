"""The mHC projection's Triton kernels (kernels/hc/projection_triton.py) on a GPU: float64 checks and timings.

For bf16 and float32 weights, eager (twice) and under ``torch.compile``, all three bitwise the same: ``out``,
``dx`` and ``dw`` of :func:`kernels.hc.projection.hc_projection` against the float64 definition from the same
bf16 / float32 values (:func:`_errors`: ``out`` and a float32 ``dw`` within the bound of their float32 sums
and a relative RMS error that a lost low part of a split would exceed, ``dx`` and a bf16 ``dw`` within one bf16
rounding), beside the float32 path's own errors (the anchor); then forward + backward times at 64k and 256k
rows beside the float32 path it replaces (``F.linear`` of float32 copies, as ``model.fused.hc_maps`` runs it
with ``hc_gemm="float32"``) and the bytes it must move (``x`` read forward, ``x`` read twice and ``dx`` written
backward).

    python tests/gpu/hc_projection_check.py --out $OUT/hc_projection.json   # session part: hcproj
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fused_check import _time  # noqa: E402  (this folder: CUDA-event medians)
from kernels.hc.projection import hc_projection  # noqa: E402

N_STREAMS = 4
P = (2 + N_STREAMS) * N_STREAMS


def _float32_path(x, w, eps):
    """The projection as ``hc_gemm="float32"`` computes it: ``F.linear`` of float32 copies (the anchor)."""
    flat = x.float()
    return F.linear(flat, w.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def _gamma(n: int) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``, ``u = 2^-24``: the relative bound on ``n`` float32 roundings of a sum
    ("Accuracy and Stability of Numerical Algorithms", 2nd ed., section 3.1)."""
    u = 2.0 ** -24
    return n * u / (1 - n * u)


REL_RMS_LIMIT = 2.0 ** -11
"""The largest relative RMS error of ``out`` (and of a float32 weight's ``dw``). Products with a bf16-level
operand (a split's low part lost) give 2^-9.2 (the torch reference with the low part of ``w`` or of ``dy``
dropped, on the CPU); exact products summed in float32 give 2^-18 to 2^-22 on the CPU. The H200's tensor
cores round their float32 sums more coarsely: its largest ``out`` error in the first check, 6.1e-4 at k 16,384
(``y``'s RMS about 2.6), bounds the relative RMS by 2^-12 even if every element erred that much."""


def _rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` (Frobenius), in float64."""
    return ((got.double() - want).norm() / want.norm()).item()


def _errors(x, w, eps, call) -> dict:
    """``call``'s out / dx / dw against float64: the worst element over its allowance (<= 1 passes), and the row of
    out's worst element.

    Allowances, each the bound of the arithmetic the kernels do, from the same operands:
    * ``out``: a float32 dot product of ``k`` terms accumulated in 16-wide tensor-core steps rounds at most
      ``k / 16 + 16`` times, so ``|err| <= gamma_(k/16+16) * (|x| @ |w|^T) * rstd``, plus ``2^-22 |out|`` for
      ``rstd`` and the product (the float32 path's FFMA GEMM is held to the same bound).
    * ``dx``: one bf16 rounding, ``2^-8 |dx|`` plus ``1e-5`` of the largest.
    * ``dw``: bf16 rounding for a bf16 weight; for a float32 one the two-part split of ``dy`` (``2^-16``
      relative per product) and the float32 sum over ``m`` rows in 16-row steps and 64-row slices:
      ``(2^-16 + gamma_(m/16+m/64+16)) * (|dy|^T @ |x|)``.
    And the relative RMS error of ``out`` (and of a float32 weight's ``dw``), at most :data:`REL_RMS_LIMIT`.
    """
    m, k = x.shape
    g = torch.Generator(device="cuda").manual_seed(1)
    cotangent = torch.randn(m, w.shape[0], generator=g, device="cuda")
    x64, w64 = x.double().requires_grad_(True), w.double().requires_grad_(True)
    rstd64 = 1 / torch.sqrt(x64.detach().pow(2).mean(-1, keepdim=True) + eps)
    want = (x64 @ w64.T) / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    want.backward(cotangent.double())
    xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    got = call(xl, wl, eps)
    got.backward(cotangent)
    want = want.detach()
    out_allow = _gamma(k // 16 + 16) * (x64.detach().abs() @ w64.detach().abs().T) * rstd64 + 2.0 ** -22 * want.abs()
    out_ratio = (got.double() - want).abs() / out_allow
    dx64, dw64 = x64.grad, w64.grad
    dx_ratio = ((xl.grad.double() - dx64).abs() / (2.0 ** -8 * dx64.abs() + 1e-5 * dx64.abs().max())).max().item()
    if w.dtype == torch.float32:
        dy_abs = (cotangent.double() * rstd64).abs()
        dw_allow = (2.0 ** -16 + _gamma(m // 16 + m // 64 + 16)) * (dy_abs.T @ x64.detach().abs())
        dw_ratio = ((wl.grad.double() - dw64).abs() / dw_allow).max().item()
    else:
        dw_ratio = ((wl.grad.double() - dw64).abs() / (2.0 ** -8 * dw64.abs() + 1e-5 * dw64.abs().max())).max().item()
    # the bounds above are worst cases: they catch wrong values, not lost low parts of a split (a bf16-rounded
    # weight, or dy without its low part, leaves relative RMS errors near 2^-9 / sqrt(3) = 2^-9.8)
    rel_rms = {"out_rel_rms": _rel_rms(got, want)}
    if w.dtype == torch.float32:
        rel_rms["dw_rel_rms"] = _rel_rms(wl.grad, dw64)
    return {"out_over_allowance": out_ratio.max().item(), "worst_row": int(out_ratio.argmax()) // w.shape[0],
            "dx_over_allowance": dx_ratio, "dw_over_allowance": dw_ratio, **rel_rms,
            "outputs": (got, xl.grad, wl.grad)}


def correctness(k: int) -> list[dict]:
    """Each case eager, again eager and compiled (bitwise the same: the kernels are deterministic), and the float32
    path beside them: the projection passes at or below the allowance, or at or below the float32 path's own
    error where that path exceeds it (the default is then no better)."""
    rows = []
    compiled = torch.compile(hc_projection, fullgraph=True)
    for m in (300, 65_536):
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        for dtype in (torch.bfloat16, torch.float32):
            w = (0.02 * torch.randn(P, k, generator=g, device="cuda")).to(dtype)
            anchor = _errors(x, w, 1e-6, _float32_path)
            anchor.pop("outputs")
            bound = {key: max(1.0, anchor[key]) for key in ("out_over_allowance", "dx_over_allowance",
                                                             "dw_over_allowance")}
            eager = None
            for name, call in (("eager", hc_projection), ("eager again", hc_projection), ("compiled", compiled),
                               ("float32 path", _float32_path)):
                e = dict(anchor) if call is _float32_path else _errors(x, w, 1e-6, call)
                outputs = e.pop("outputs", None)
                same = None
                if call is not _float32_path:   # the same kernels on the same operands, compiled or not
                    eager = eager or outputs
                    same = all(torch.equal(a, b) for a, b in zip(eager, outputs))
                ok = (all(e[key] <= bound[key] for key in bound) and same is not False
                      and all(e[key] <= REL_RMS_LIMIT for key in ("out_rel_rms", "dw_rel_rms") if key in e))
                r = {"rows": m, "k": k, "weight": str(dtype).removeprefix("torch."), "call": name,
                     "bitwise_as_first_eager": same, **e, "ok": ok}
                rows.append(r)
                print(f"{m:>7} rows k={k} {r['weight']:<8} {name:<12} out {e['out_over_allowance']:8.2f} (row "
                      f"{e['worst_row']:>6})  dx {e['dx_over_allowance']:6.2f}  dw {e['dw_over_allowance']:6.2f} of "
                      f"allowance, relative RMS out 2^{math.log2(max(e['out_rel_rms'], 1e-300)):.1f}"
                      + (f" dw 2^{math.log2(max(e['dw_rel_rms'], 1e-300)):.1f}" if "dw_rel_rms" in e else "")
                      + f"{'' if same is None else '  repeat bitwise ' + str(same)}  {'ok' if ok else 'FAIL'}",
                      flush=True)
    return rows


def streams_grad_check(k: int) -> list[dict]:
    """:func:`kernels.hc.projection.hc_projection_streams_grad` (the ``dx`` kernel with an mHC block's other two
    stream gradients added, ``EXTRA``) against float64: ``dx + pre[:, i] * block_grad + streams_grad`` within one
    bf16 rounding (``2^-8`` of each element plus ``1e-5`` of the largest), ``dw`` bitwise the plain backward's."""
    from kernels.hc.projection import _bwd, hc_projection_parts, hc_projection_streams_grad

    rows, n = [], N_STREAMS
    h = k // n
    for m in (300, 65_536):
        g = torch.Generator(device="cuda").manual_seed(m + 7)
        x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
        for dtype in (torch.bfloat16, torch.float32):
            w = (0.02 * torch.randn(P, k, generator=g, device="cuda")).to(dtype)
            grad = torch.randn(m, P, generator=g, device="cuda")
            pre = torch.rand(m, n, generator=g, device="cuda") + 1e-6
            block_grad = torch.randn(m, h, generator=g, device="cuda").to(torch.bfloat16)
            streams_grad = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
            y, rstd = hc_projection_parts(x, w, 1e-6)
            dx, dw = hc_projection_streams_grad(grad, x, w, y, rstd, pre, block_grad, streams_grad)
            _, plain_dw = _bwd(grad, x, w, y, rstd)
            x64, w64 = x.double().requires_grad_(True), w.double()
            mixed = (x64 @ w64.T) / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
            (dx64,) = torch.autograd.grad(mixed, x64, grad.double())
            collapse = (pre.double()[:, :, None] * block_grad.double()[:, None, :]).flatten(1)
            want = dx64 + streams_grad.double() + collapse
            ratio = ((dx.double() - want).abs() / (2.0 ** -8 * want.abs() + 1e-5 * want.abs().max())).max().item()
            ok = ratio <= 1 and torch.equal(dw, plain_dw)
            r = {"rows": m, "k": k, "weight": str(dtype).removeprefix("torch."), "call": "streams grad",
                 "dx_over_allowance": ratio, "dw_bitwise_plain": torch.equal(dw, plain_dw), "ok": ok}
            rows.append(r)
            print(f"{m:>7} rows k={k} {r['weight']:<8} streams grad  dx {ratio:6.2f} of allowance, dw bitwise "
                  f"{r['dw_bitwise_plain']}  {'ok' if ok else 'FAIL'}", flush=True)
    return rows


def maps_check(tokens: int = 65_536) -> list[dict]:
    """The mHC maps' Triton kernels (:mod:`kernels.hc.maps_triton`) on the GPU against the compiled torch definition
    (:func:`model.fused.hc_maps_of_logits` through ``torch.compile``, as the layer ran them before): values and
    gradients within float32 rounding (relative ``1e-4``), and forward + backward times. The kernels' own numerics
    are checked on the CPU under Triton's interpreter (float32, the same arithmetic)."""
    from kernels.hc.maps_triton import triton_hc_maps_bwd, triton_hc_maps_fwd
    from model.fused import hc_maps_of_logits

    n, iters, eps = N_STREAMS, 20, 1e-6
    g = torch.Generator(device="cuda").manual_seed(3)
    mixed = 2 * torch.randn(tokens, 1, P, generator=g, device="cuda")
    base, scale = 0.3 * torch.randn(P, generator=g, device="cuda"), 1 + 0.2 * torch.randn(3, generator=g, device="cuda")
    cot = [torch.randn(tokens, 1, *shape, generator=g, device="cuda") for shape in ((n,), (n,), (n, n))]
    compiled = torch.compile(hc_maps_of_logits, fullgraph=True)
    leaves = [t.clone().requires_grad_(True) for t in (mixed, base, scale)]

    def glue_path():
        outs = compiled(*leaves, n, iters, eps)
        return outs, torch.autograd.grad(outs, leaves, cot)

    def triton_path():
        outs = triton_hc_maps_fwd(mixed, base, scale, n, iters, eps)
        return outs, triton_hc_maps_bwd(mixed, base, scale, n, iters, eps, *cot)[:3]

    (want, want_g), (got, got_g) = glue_path(), triton_path()
    errs = [((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip([*got, *got_g],
                                                                                         [*want, *want_g])]
    t_glue, t_triton = _time(glue_path), _time(triton_path)
    ok = max(errs) <= 1e-4
    print(f"mHC maps, {tokens} tokens: compiled torch {1e3 * t_glue:.2f} ms, Triton {1e3 * t_triton:.2f} ms "
          f"(forward + backward); largest relative difference {max(errs):.1e}  {'ok' if ok else 'FAIL'}", flush=True)
    return [{"call": "mhc maps", "tokens": tokens, "compiled_s": t_glue, "triton_s": t_triton,
             "max_rel_diff": max(errs), "ok": ok}]


def timings(k: int) -> list[dict]:
    rows = []
    for m in (65_536, 262_144):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16).requires_grad_(True)
        w = (0.02 * torch.randn(P, k, device="cuda")).requires_grad_(True)
        cotangent = torch.randn(m, P, device="cuda")

        def float32_path():
            _float32_path(x, w, 1e-6).backward(cotangent)

        def triton_path():
            hc_projection(x, w, 1e-6).backward(cotangent)

        try:
            t32, tt = _time(float32_path), _time(triton_path)
        except torch.OutOfMemoryError:    # 262,144 x 16,384 needs more than an 80 GB card: say so, time the rest
            t32 = tt = None
        if t32 is None:                   # outside the handler: its traceback no longer holds the tensors
            del x, w, cotangent
            torch.cuda.empty_cache()
            gib = torch.cuda.get_device_properties(0).total_memory / 2**30
            print(f"{m:>7} rows k={k}: skipped, does not fit in {gib:.0f} GiB", flush=True)
            continue
        nbytes = 4 * m * k * 2          # x read forward, x read twice and dx written backward (bf16)
        r = {"rows": m, "k": k, "float32_s": t32, "triton_s": tt, "speedup": t32 / tt,
             "triton_tb_s": nbytes / tt / 1e12}
        rows.append(r)
        print(f"{m:>7} rows k={k}: float32 path {1e3 * t32:7.2f} ms, Triton {1e3 * tt:6.2f} ms (x {t32 / tt:.1f}), "
              f"{r['triton_tb_s']:.2f} TB/s of the bytes it must move", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[4096, 16384], help="k = n * h (small, full)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    checks = [r for k in args.widths for r in correctness(k) + streams_grad_check(k)] + maps_check()
    times = [r for k in args.widths for r in timings(k)]
    print("\n| rows | k | float32 path ms | Triton ms | speedup | Triton TB/s (min bytes) |\n|---|---|---|---|---|---|")
    for r in times:
        print(f"| {r['rows']:,} | {r['k']:,} | {1e3 * r['float32_s']:.2f} | {1e3 * r['triton_s']:.2f} | "
              f"{r['speedup']:.1f}x | {r['triton_tb_s']:.2f} |")
    Path(args.out).write_text(json.dumps({"correctness": checks, "timings": times}, indent=1))
    failed = [r for r in checks if not r["ok"]]
    print("ALL OK" if not failed else f"{len(failed)} FAILED")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
