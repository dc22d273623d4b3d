"""How the sparse MLA backward's two Gluon kernels scale with the SMs they are given, at the ``full`` shape: would
they run faster side by side on disjoint SMs than one after the other?

    python tests/benchmarks/sparse_mla_sm_share.py --out $OUT/sm_share.json     # session part smshare

The question: is the latent gradient (:func:`kernels.dsa.sparse_attention_gluon.gluon_sparse_mla_dkv`), bound by
the requests of its gathers and float32 atomic rows, limited by L2 (a resource of the whole GPU) while the query
gradient (:func:`kernels.dsa.sparse_attention_gluon.gluon_sparse_mla_dq`) is limited by its own pipeline (a
resource of each SM)? If the first lost little with fewer SMs and the second scaled with them, the two kernels side
by side on disjoint SMs (persistent grids, or one launch with both roles) would take ``max(T_dkv(n), T_dq(132 -
n))`` instead of ``T_dkv(132) + T_dq(132)``. Measured on one H100 (``docs/dsa_kernels.md``, 2026-12-06): both
take 132/n times as long on n SMs, so the atomics are a limit of each SM and the split cannot gain.

Each kernel runs alone on the whole GPU, then beside :func:`occupy_kernel`, which holds ``n`` SMs: one CTA per
SM (128 KiB of shared memory; the measured kernels' CTAs take 196-224 KiB, so none fits beside it) spinning on a
flag that a kernel queued after the measured one sets. The measured kernel's CUDA events bracket it alone on the
other SMs. Also timed: both kernels on two streams with their whole grids (the hardware's own interleaving).
The split's time ``max(...)`` is a projection from the separate runs: it leaves out how much the two slow each
other down in L2, which only a side-by-side build can measure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Every kernel loaded when its module is: with CUDA's lazy loading, the first launch of a kernel queued behind
# the measured one (the release, the sleep) loads its module while the occupier spins, and the load waits for it
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import torch  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from dsa_bench import SHAPES, WIDTH, backward_inputs, ceilings  # noqa: E402
from kernels.dsa import sparse_attention_gluon as sag  # noqa: E402
from kernels.dsa import sparse_attention_triton as sat  # noqa: E402

OCCUPY_ROWS = 256
"""Rows of 512 bytes each :func:`occupy_kernel` CTA holds in shared memory: 128 KiB, one CTA per SM."""


@gluon.jit
def occupy_kernel(FLAG, OUT, ROWS: gl.constexpr):
    """Hold one SM until ``FLAG`` (int32, global) is nonzero: ``ROWS x 512`` bytes of shared memory (written, then
    read back into ``OUT[program]`` so the allocation stays) keep every CTA needing more than the rest out."""
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [gl.num_warps(), 1], [1, 0])
    buf = gl.allocate_shared_memory(gl.int8, [ROWS, 512], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    buf.store(gl.zeros([ROWS, 512], gl.int8, layout))
    while gl.load(FLAG, volatile=True) == 0:
        pass
    held = buf.load(layout).to(gl.int32)
    gl.store(OUT + gl.program_id(0), gl.sum(gl.sum(held, axis=1), axis=0))


def time_on_free_sms(fn, held: int, reps: int) -> float:
    """Median seconds of ``fn`` (GPU work on the current stream) while :func:`occupy_kernel` holds ``held`` SMs
    (0: the whole GPU), both on streams of their own. Raises ValueError if ``held`` leaves no SM free."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if not 0 <= held < sms:
        raise ValueError(f"held={held}: 0 to {sms - 1} SMs of {sms}")
    # both on created streams: the legacy default stream would wait for the occupier, which waits for it
    side, main = torch.cuda.Stream(), torch.cuda.Stream()
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    sink = torch.zeros(max(held, 1), dtype=torch.int32, device="cuda")
    fn()   # compile and autotune outside the timing
    # the occupier (released at once), the sleep and the flag's fill each launched once before any occupier spins
    flag.fill_(1)
    occupy_kernel[(1,)](flag, sink, ROWS=OCCUPY_ROWS, num_warps=4)
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps + 1):
        flag.zero_()
        torch.cuda.synchronize()
        if held:
            with torch.cuda.stream(side):
                occupy_kernel[(held,)](flag, sink, ROWS=OCCUPY_ROWS, num_warps=4)
        with torch.cuda.stream(main):
            if held:
                torch.cuda._sleep(200_000)   # ~0.1 ms: the held SMs' CTAs are resident before the measured launch
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            flag.fill_(1)   # releases the held SMs once fn is done
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times[1:])[reps // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--held", type=int, nargs="+", default=[0, 33, 66, 99],
                        help="SMs held away from the measured kernel (0: all SMs free)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shape = SHAPES["full"]
    h, dqk, t = shape["heads"], shape["dqk"], args.seq_len
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ceil = ceilings()
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; matmul anchor {ceil['matmul_tflops']:.0f} TF/s", flush=True)
    q, kv, idx, grad, scale, out, lse = backward_inputs(t, shape)
    delta = sat.triton_sparse_mla_delta(out, grad)
    dq = torch.empty_like(q)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device="cuda")
    kernels = {
        "dq": lambda: sag.gluon_sparse_mla_dq(q, kv, idx, grad, lse, delta, scale, dq),
        "dkv": lambda: sag.gluon_sparse_mla_dkv(q, kv, idx, grad, lse, delta, scale, dkv),
    }
    rows = []
    for held in args.held:
        row = {"free_sms": sms - held}
        for name, fn in kernels.items():
            row[f"{name}_s"] = time_on_free_sms(fn, held, args.reps)
        rows.append(row)
        print(row, flush=True)

    other = torch.cuda.Stream()

    def two_streams():
        other.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(other):
            kernels["dq"]()
        kernels["dkv"]()
        torch.cuda.current_stream().wait_stream(other)

    t_streams = time_on_free_sms(two_streams, 0, args.reps)
    by_free = {r["free_sms"]: r for r in rows}
    whole = by_free.get(sms)
    bwd_flops = 2 * t * h * WIDTH * 5 * dqk
    print(f"\nfull shape, {t // 1024}k tokens, 64 heads; each kernel alone with n of {sms} SMs free (ms):\n")
    print("| free SMs | dq | dkv | dq x free/all | dkv x free/all |\n|---|---|---|---|---|")
    for r in rows:
        f = r["free_sms"] / sms
        print(f"| {r['free_sms']} | {1e3 * r['dq_s']:.1f} | {1e3 * r['dkv_s']:.1f} | {1e3 * r['dq_s'] * f:.1f} | "
              f"{1e3 * r['dkv_s'] * f:.1f} |")
    if whole:
        serial = whole["dq_s"] + whole["dkv_s"]
        print(f"\none after the other: {1e3 * serial:.1f} ms ({bwd_flops / serial / 1e12:.0f} TF/s of the backward's "
              f"products); two streams, whole grids: {1e3 * t_streams:.1f} ms")
        print("\n| dkv SMs + dq SMs | max(T_dkv, T_dq), projected ms |\n|---|---|")
        for r in rows:
            n = r["free_sms"]
            if n != sms and (sms - n) in by_free:
                split = max(r["dkv_s"], by_free[sms - n]["dq_s"])
                print(f"| {n} + {sms - n} | {1e3 * split:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"anchor": ceil, "sms": sms, "seq_len": t, "rows": rows, "two_streams_s": t_streams}, f,
                      indent=1)


if __name__ == "__main__":
    main()
