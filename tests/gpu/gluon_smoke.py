"""First contact of the Gluon sparse MLA kernels with a GPU: small, fast, float64-checked. Run on an H100/H200:

    python tests/gpu/gluon_smoke.py            # session part gluonsmoke (150 s: every variant compiles cold)
    python tests/gpu/gluon_smoke.py --forward-only   # the forwards alone

At 256 queries, 64 and 128 heads, a 512-wide latent and 200 index slots per query (not a multiple of any
``BLOCK_K``; random keys with ``-1`` holes, one query with none valid), each configuration of
:func:`kernels.dsa.sparse_attention_gluon.sparse_mla_fwd_gluon_kernel` launched outside the autotuner, and
:func:`kernels.dsa.sparse_attention_gluon.gluon_sparse_mla_dkv` (in each of its ``ATOMIC_LAYOUTS``)
and :func:`kernels.dsa.sparse_attention_gluon.gluon_sparse_mla_dq` (each of its ``DQ_KERNELS``), against the float64 torch paths
(:mod:`kernels.dsa.sparse_attention`): relative Frobenius error of ``out``, ``dkv`` and ``dq`` <= 1e-2, ``lse``
within 5e-2, the empty query's output and ``dq`` 0 and its ``lse`` ``-inf``. Each launch is synchronized and reported before the next,
so a deadlock names its kernel; the paired-block forward (``schedule="pair"``) runs last, also on an odd number of
key blocks and on queries whose valid slots start late. Prints ``GLUON SMOKE OK: True/False``.
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from kernels.dsa import sparse_attention_gluon as sag  # noqa: E402
from kernels.dsa.sparse_attention import torch_sparse_mla_bwd, torch_sparse_mla_fwd  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def case(heads: int, n_q: int = 256, n_k: int = 1024, width: int = 200, dim: int = 512, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, n_q, heads, dim, generator=gen, device="cuda").bfloat16()
    kv = torch.randn(1, n_k, dim, generator=gen, device="cuda").bfloat16()
    idx = torch.stack([torch.randperm(n_k, generator=gen, device="cuda")[:width] for _ in range(n_q)])[None]
    idx = torch.where(torch.rand(idx.shape, generator=gen, device="cuda") < 0.1, -1, idx).to(torch.int32)
    idx[:, 3] = -1
    return q, kv, idx


def main() -> None:
    # the default kernels first, then again with the producer's INDICES_AHEAD the other way (and the forward with
    # its row sum per block, with its softmax under P V, and with lazy rescaling), then the ring forwards at other
    # numbers of key blocks, every forward with a rising row max, then the pair schedule: a hang in a variant
    # leaves the lines before it in the log. --forward-only: the forwards alone (no gradient kernels to compile)
    forward_only = "--forward-only" in sys.argv[1:]
    ok = ring_and_gradients(sag.GLUON_FWD_CONFIGS, indices_ahead=False, gradients=not forward_only)
    ok &= ring_and_gradients(sag.GLUON_FWD_AHEAD_FLIPPED + sag.GLUON_FWD_ROW_SUM_FLIPPED + sag.GLUON_FWD_UNDER_PV
                             + sag.GLUON_FWD_LAZY, indices_ahead=True, gradients=not forward_only)
    ok &= ring_block_counts()
    ok &= rising_max()
    ok &= pair_schedule()
    print(f"GLUON SMOKE OK: {ok}", flush=True)


def forward_check(q, kv, idx, scale, ref_out, ref_lse, cfg, schedule: str = "ring",
                  special: tuple[int, ...] = ()) -> tuple[bool, dict]:
    """One forward configuration of ``schedule`` against the float64 ``ref_out`` and ``ref_lse``: whether it
    passes, and its errors (query 3, with no valid slot, must give ``O = 0`` and ``lse = -inf``; each query of
    ``special`` must also be within the relative bound of ``O`` on its own)."""
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device="cuda")
    sag.launch_fwd(q, kv, idx, out, lse, scale, cfg, schedule)
    torch.cuda.synchronize()
    rows = torch.arange(q.shape[1], device="cuda") != 3   # the query with no valid slot apart
    res = dict(out_rel=rel(out, ref_out),
               lse_max=float((lse[:, rows].double() - ref_lse[:, rows]).abs().max()),
               empty_ok=bool((out[:, 3] == 0).all() and torch.isneginf(lse[:, 3]).all()))
    if special:
        res["special_rel"] = [round(rel(out[:, r], ref_out[:, r]), 5) for r in special]
    good = (res["out_rel"] <= 1e-2 and res["lse_max"] <= 5e-2 and res["empty_ok"]
            and max(res.get("special_rel", [0.0])) <= 1e-2)
    return good, res


def ring_block_counts() -> bool:
    """Every ring forward configuration at 64 heads with selections of one key block, exactly two, and two and one
    slot (``width`` 50, 128, 129: the loops' first and last iterations meet), against float64."""
    ok = True
    for width in (50, 128, 129):
        q, kv, idx = case(64, width=width, seed=width)
        scale = 1 / math.sqrt(256)
        ref_out, ref_lse = torch_sparse_mla_fwd(q.double(), kv.double(), idx, scale, q.shape[-1])
        for cfg in sag.GLUON_FWD_TRIALS["ring"]:
            good, res = forward_check(q, kv, idx, scale, ref_out, ref_lse, cfg)
            ok &= good
            print(f"fwd width {width} {cfg.kwargs}: {res} {'ok' if good else 'FAIL'}", flush=True)
    return ok


def rising_max() -> bool:
    """Every forward configuration of every schedule where a row's max rises far after the first key block: the
    latent rows of the 2nd and 4th 64-slot blocks of each selection scaled by 3 and 6 (row maxima about 10 and 25
    base-2 units above the first block's, past the rescaling slack of 8), so the conditional rescaling
    (``LAZY_RESCALE``) must rescale mid-row, and the 5th block's (scaled by 1/4) must not; against float64."""
    q, kv, idx = case(64, width=300, seed=7)
    kv = kv.clone()
    for block, factor in ((1, 3.0), (3, 6.0), (4, 0.25)):
        rows = idx[0, :, 64 * block:64 * (block + 1)].reshape(-1)
        rows = rows[rows >= 0].unique()
        kv[0, rows] = (kv[0, rows].float() * factor).bfloat16()   # a row in two blocks takes the later factor
    scale = 1 / math.sqrt(256)
    ref_out, ref_lse = torch_sparse_mla_fwd(q.double(), kv.double(), idx, scale, q.shape[-1])
    ok = True
    for schedule, configs in sag.GLUON_FWD_TRIALS.items():
        for cfg in configs:
            good, res = forward_check(q, kv, idx, scale, ref_out, ref_lse, cfg, schedule)
            ok &= good
            print(f"fwd {schedule} rising max {cfg.kwargs}: {res} {'ok' if good else 'FAIL'}", flush=True)
    return ok


def ring_and_gradients(fwd_configs, indices_ahead: bool, gradients: bool = True) -> bool:
    """Each of ``fwd_configs`` of the ring forward, then (with ``gradients``) the latent gradient and the query
    gradient with the producer's ``INDICES_AHEAD`` set to ``indices_ahead``, against float64, at 64 and 128
    heads."""
    ok = True
    for heads in (64, 128):
        q, kv, idx = case(heads)
        dim = q.shape[-1]
        scale = 1 / math.sqrt(256)
        ref_out, ref_lse = torch_sparse_mla_fwd(q.double(), kv.double(), idx, scale, dim)
        for cfg in fwd_configs:
            t0 = time.perf_counter()
            good, res = forward_check(q, kv, idx, scale, ref_out, ref_lse, cfg)
            ok &= good
            print(f"fwd {heads} heads {cfg.kwargs}: {res} {time.perf_counter() - t0:.1f}s {'ok' if good else 'FAIL'}",
                  flush=True)
        if not gradients:
            continue
        grad = torch.randn(q.shape, device="cuda").bfloat16()
        dq64, dkv64 = torch_sparse_mla_bwd(q.double(), kv.double(), idx, ref_out, ref_lse, grad.double(), scale, dim)
        lse = ref_lse.float()
        delta = (grad.float() * ref_out.float()).sum(-1)
        # the same gradient in each atomic layout, then in column pieces (the launcher's among them)
        # (with the next block's scores ahead of the last piece's atomics or not)
        # and with the atomics in their own partition (8 pieces, scores ahead)
        for layout, pieces, ahead, warps in ([(a, 1, False, 0) for a in sag.ATOMIC_LAYOUTS]
                                             + [(sag.DKV_ATOMIC_LAYOUT, n, a, 0) for n in (2, 4) for a in (False, True)]
                                             + [(sag.DKV_ATOMIC_LAYOUT, sag.DKV_STAGED_PIECES, True, 4)]):
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device="cuda")
            t0 = time.perf_counter()
            sag.gluon_sparse_mla_dkv(q, kv, idx, grad, lse, delta, scale, dkv, indices_ahead=indices_ahead,
                                     atomic_layout=layout, pieces=pieces, scores_ahead=ahead, atomic_warps=warps)
            torch.cuda.synchronize()
            err = rel(dkv, dkv64)
            good = err <= 1e-2
            ok &= good
            print(f"dkv {heads} heads, {layout} atomics, {pieces} pieces, scores ahead {ahead}, atomics warps {warps}, "
                  f"indices ahead {indices_ahead}: rel {err:.2e} {time.perf_counter() - t0:.1f}s "
                  f"{'ok' if good else 'FAIL'}", flush=True)
        for schedule in sag.DQ_KERNELS:   # each query gradient, the launcher's among them
            t0 = time.perf_counter()
            dq = sag.gluon_sparse_mla_dq(q, kv, idx, grad, lse, delta, scale, indices_ahead=indices_ahead,
                                         schedule=schedule)
            torch.cuda.synchronize()
            err = rel(dq, dq64)
            good = err <= 1e-2 and bool((dq[:, 3] == 0).all())
            ok &= good
            print(f"dq {heads} heads, {schedule} schedule, indices ahead {indices_ahead}: rel {err:.2e}, empty query "
                  f"zero {bool((dq[:, 3] == 0).all())} {time.perf_counter() - t0:.1f}s {'ok' if good else 'FAIL'}",
                  flush=True)
        # rowsum(dO O) formed in the "products" query gradient from the forward's output (bf16, as in training)
        t0 = time.perf_counter()
        out16 = ref_out.bfloat16()
        delta_k = torch.full_like(delta, float("nan"))
        dq = sag.gluon_sparse_mla_dq(q, kv, idx, grad, lse, delta_k, scale, indices_ahead=indices_ahead,
                                     schedule="products", out=out16)
        torch.cuda.synchronize()
        delta64 = (grad.double() * out16.double()).sum(-1)
        d_err = float((delta_k.double() - delta64).abs().max() / delta64.abs().max())
        err = rel(dq, dq64)
        good = err <= 1e-2 and d_err <= 1e-5 and bool((dq[:, 3] == 0).all())
        ok &= good
        print(f"dq {heads} heads, products schedule, rowsum(dO O) in the kernel, indices ahead {indices_ahead}: rel "
              f"{err:.2e}, delta rel {d_err:.1e} {time.perf_counter() - t0:.1f}s {'ok' if good else 'FAIL'}",
              flush=True)
    return ok


def pair_schedule() -> bool:
    """The paired-block forward (``schedule="pair"``) at an even and an odd number of 64-key blocks (200 and 150
    slots: four blocks, the last partly filled; three, the pair's second block empty), with queries whose valid
    slots lie only in the first block of a pair, only in the second, or not in the first pair at all (the two
    warpgroups' running maxima start at ``-inf`` at different times)."""
    ok = True
    for heads in (64, 128):
        for width in (200, 150):
            q, kv, idx = case(heads, width=width, seed=1)
            idx[:, 5, 64:] = -1                    # only the first block of the first pair
            idx[:, 6, :64] = -1                    # only the second block of the first pair and later ones
            idx[:, 6, 128:] = -1
            idx[:, 7, :128] = -1                   # nothing in the first pair
            dim = q.shape[-1]
            scale = 1 / math.sqrt(256)
            ref_out, ref_lse = torch_sparse_mla_fwd(q.double(), kv.double(), idx, scale, dim)
            for cfg in sag.GLUON_FWD_PAIR_CONFIGS:
                t0 = time.perf_counter()
                good, res = forward_check(q, kv, idx, scale, ref_out, ref_lse, cfg, "pair", special=(5, 6, 7))
                ok &= good
                print(f"fwd pair {heads} heads, {width} slots {cfg.kwargs}: {res} {time.perf_counter() - t0:.1f}s "
                      f"{'ok' if good else 'FAIL'}", flush=True)
    return ok


if __name__ == "__main__":
    main()
