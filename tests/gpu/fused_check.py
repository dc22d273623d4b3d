"""model.fused on a GPU: inductor's fused glue against the eager functions and float64, then their times.

1. Correctness: every case of ``tests/test_model_fused.py`` moved to CUDA, run through
   :func:`model.fused.glue` with ``compile=True`` (inductor) and eagerly: outputs and gradients
   compared with the float64 definition of the test (outputs) and with eager (gradients).
2. Times at the ``small`` preset's widths and ``--tokens`` tokens (bf16 streams ``[T, 1, 4, 1024]``,
   the MoE glue on ``4 T`` routed rows of ``2 x 512``), forward + backward, median of CUDA events,
   eager vs fused, with the bytes each call must move at least and the rate that implies.

    python tests/gpu/fused_check.py --tokens 65536 --out $OUT/fused_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from model import fused  # noqa: E402
from test_model_fused import _cases, _leaves, _outputs  # noqa: E402


def _cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


def correctness() -> list[dict]:
    rows = []
    for name, (fn, args, reference) in _cases().items():
        args = _cuda(args)
        want = _outputs(reference(*args))
        results = []
        for compile in (False, True):
            leaves = _leaves(args)
            outs = _outputs(fused.glue(fn, compile, *leaves))
            loss = sum((o.float() * torch.ones_like(o, dtype=torch.float32).cumsum(-1).sin()).sum() for o in outs)
            loss.backward()
            results.append((outs, [a.grad for a in leaves if isinstance(a, torch.Tensor) and a.requires_grad]))
        (outs_e, grads_e), (outs_c, grads_c) = results
        out_err = max(((o.double() - r).norm() / r.norm()).item() for o, r in zip(outs_c, want))
        grad_err = max(((c.double() - e.double()).norm() / e.double().norm().clamp_min(1e-30)).item()
                       for c, e in zip(grads_c, grads_e))
        ok = out_err < 1e-5 and grad_err < 1e-5
        rows.append({"case": name, "fused_vs_float64": out_err, "fused_vs_eager_grads": grad_err, "ok": ok})
        print(f"{name:<16} fused vs float64 {out_err:.2e}  grads fused vs eager {grad_err:.2e}  {'ok' if ok else 'FAIL'}",
              flush=True)
    return rows


def _time(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def timings(tokens: int) -> list[dict]:
    n, h, f, bf = 4, 1024, 512, torch.bfloat16
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device=dev)).to(dtype)

    streams = rnd(tokens, 1, n, h, dtype=bf)
    pre, post = torch.rand(tokens, 1, n, device=dev), 2 * torch.rand(tokens, 1, n, device=dev)
    comb = torch.softmax(rnd(tokens, 1, n, n), -1)
    routed = 4 * tokens
    cases = {
        # name: (fn, args, bytes at least: inputs read once + outputs written once, forward + backward)
        "hc_maps": (fused.hc_maps, (streams, rnd((2 + n) * n, n * h, scale=0.02), rnd((2 + n) * n), 1 + rnd(3),
                                    n, 20, 1e-6, 1e-6), 3 * streams.numel() * 2),
        # the model's bf16 weight, projected on bf16 tensor cores (model.fused.hc_projection)
        "hc_maps_bf16_gemm": (fused.hc_maps, (streams, rnd((2 + n) * n, n * h, dtype=bf, scale=0.02), rnd((2 + n) * n),
                                              1 + rnd(3), n, 20, 1e-6, 1e-6, "auto"), 3 * streams.numel() * 2),
        "hc_collapse": (fused.hc_collapse, (pre, streams), 3 * streams.numel() * 2 + 2 * tokens * h * 2),
        "hc_merge": (fused.hc_merge, (post, comb, rnd(tokens, 1, h, dtype=bf), streams), 4 * streams.numel() * 2),
        "rms_norm": (lambda x, w, e: fused.rms_norm(x, w, e)[0], (rnd(tokens, h, dtype=bf), 1 + rnd(h, dtype=bf), 1e-6),
                     5 * tokens * h * 2),
        "kda_gate": (fused.kda_gate, (rnd(tokens, 1, h, dtype=bf), rnd(h), rnd(8), 8, 128, -5.0),
                     3 * tokens * h * 2 + 2 * tokens * h * 4),
        "gated_rms_norm": (fused.gated_rms_norm, (rnd(tokens, 1, 8, 128, dtype=bf), rnd(tokens, 1, 8, 128, dtype=bf),
                                                  1 + rnd(128), 1e-6, bf), 6 * tokens * h * 2),
        "swiglu_probs": (fused.swiglu_probs, (rnd(routed, 2 * f, dtype=bf), torch.rand(routed, device=dev), 7.0, 0.0),
                         3 * routed * 2 * f * 2 + 2 * routed * f * 2),
    }
    rows = []
    for name, (fn, args, nbytes) in cases.items():
        row = {"case": name, "tokens": tokens, "min_bytes": nbytes}
        for compile in (False, True):
            leaves = _leaves(args)

            def step():
                for a in leaves:
                    if isinstance(a, torch.Tensor) and a.grad is not None:
                        a.grad = None
                outs = _outputs(fused.glue(fn, compile, *leaves))
                torch.autograd.backward([o for o in outs if o.requires_grad],
                                        [torch.ones_like(o) for o in outs if o.requires_grad])

            row["fused_s" if compile else "eager_s"] = _time(step)
        row["speedup"] = row["eager_s"] / row["fused_s"]
        row["fused_tb_s"] = nbytes / row["fused_s"] / 1e12
        rows.append(row)
        print(f"{name:<16} eager {1e3 * row['eager_s']:8.2f} ms  fused {1e3 * row['fused_s']:8.2f} ms  "
              f"x{row['speedup']:5.1f}  fused {row['fused_tb_s']:.2f} TB/s of the bytes it must move", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    checks = correctness()
    times = timings(args.tokens)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"correctness": checks, "timings": times, "gpu": torch.cuda.get_device_name()}, fh, indent=1)
    print("\n| glue (fwd+bwd) | eager ms | fused ms | speedup | fused TB/s (min bytes) |\n|---|---|---|---|---|")
    for r in times:
        print(f"| {r['case']} | {1e3 * r['eager_s']:.2f} | {1e3 * r['fused_s']:.2f} | {r['speedup']:.1f}x | "
              f"{r['fused_tb_s']:.2f} |")
    if not all(c["ok"] for c in checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
