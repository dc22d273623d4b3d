"""GPU check of the activation offload: same gradients on and off the copy stream, and the time it saves.

    python tests/gpu/offload_check.py [--hidden 8192] [--tokens 16384] [--layers 6] [--offloaded 4] [--out f.json]

A stack of MLP blocks (``h -> 4h -> GELU -> h``, bf16, residual), the first ``--offloaded`` of
them under activation offload, trained one forward + backward per timed step in three modes:

* ``none``: no offload (the reference gradients, and the time without copies);
* ``same stream``: :class:`model.offload.OffloadActivations` without a copy stream (the copies
  on the compute stream, as before :class:`model.offload.OffloadChain`);
* ``copy stream``: :class:`model.offload.OffloadChain` (copies on a side stream, each offloaded
  layer's backward prefetching the one before).

Every mode's gradients must equal the reference bit for bit (deterministic cuBLAS; the copies
move bytes, they must not change them) and finite; the input is fresh random each step. Prints a table: ms per step, peak
GiB, pinned GiB, offloaded GiB per step, and the copy overhead over ``none``; exits non-zero on
any mismatch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from model.offload import OffloadActivations, OffloadChain  # noqa: E402


def step(x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor]], offloaded: int, mode: str):
    """One forward + backward; returns the gradients (input first, then every weight)."""
    chain = OffloadChain() if mode == "copy stream" else None
    h = x
    for i, (w_in, w_out) in enumerate(weights):
        if i < offloaded and mode != "none":
            ctx = chain.context() if chain is not None else OffloadActivations()
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            h = h + torch.nn.functional.gelu(h @ w_in) @ w_out
    for t in [x] + [w for pair in weights for w in pair]:
        t.grad = None
    h.float().square().mean().backward()
    return [x.grad] + [w.grad for pair in weights for w in pair]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--offloaded", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    h, n = args.hidden, args.tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [tuple((torch.randn(a, b, device="cuda", generator=gen) * a**-0.5).to(torch.bfloat16).requires_grad_()
                     for a, b in ((h, 4 * h), (4 * h, h))) for _ in range(args.layers)]
    # saved per offloaded block: its input h, the pre-GELU 4h and the GELU output 4h (bf16)
    offloaded_gib = args.offloaded * n * 9 * h * 2 / 2**30
    modes = ["none", "same stream", "copy stream"]
    times = {m: [] for m in modes}
    peaks = {m: 0.0 for m in modes}
    ok = True
    for s in range(args.steps + 1):   # step 0: warm-up (cuBLAS handles, pinned blocks)
        x = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
        reference = None
        for mode in modes:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            grads = step(x, weights, args.offloaded, mode)
            end.record()
            torch.cuda.synchronize()
            if s:
                times[mode].append(start.elapsed_time(end))
                peaks[mode] = max(peaks[mode], torch.cuda.max_memory_allocated() / 2**30)
            if reference is None:
                reference = [g.clone() for g in grads]
            else:
                same = all(torch.equal(a, b) for a, b in zip(grads, reference))
                finite = all(bool(torch.isfinite(g).all()) for g in grads)
                if not (same and finite):
                    ok = False
                    print(json.dumps(dict(step=s, mode=mode, gradients_equal=same, finite=finite)), flush=True)
    stats = getattr(torch.cuda, "host_memory_stats", None)
    pinned = stats().get("allocated_bytes.peak", 0) / 2**30 if stats is not None else float("nan")
    rows = []
    base = min(times["none"])
    for mode in modes:
        ms = min(times[mode])
        rows.append(dict(mode=mode, ms_per_step=ms, peak_gib=peaks[mode], overhead_pct=100 * (ms / base - 1),
                         offloaded_gib=0.0 if mode == "none" else offloaded_gib))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nMLP blocks h={h}, {n} tokens, {args.layers} layers, first {args.offloaded} offloaded "
          f"({offloaded_gib:.2f} GiB per step); pinned peak {pinned:.2f} GiB; gradients equal: {ok}")
    print("| mode | ms/step (best of %d) | overhead vs none | peak GiB |" % args.steps)
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['ms_per_step']:.1f} | {r['overhead_pct']:+.0f}% | {r['peak_gib']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows, gradients_equal=ok, pinned_peak_gib=pinned, args=vars(args)), f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
