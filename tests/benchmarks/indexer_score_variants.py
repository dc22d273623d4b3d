"""Lightning indexer kernels, variant by variant, on the largest query block of a 1M-token sequence.

    python tests/benchmarks/indexer_score_variants.py [--shapes full small] [--quick] [--profile] [--crossover]
        [--out f.json]

One block of 8192 queries against 65,536 visible pools (the last block at 1M tokens, kpool 16)
per DSA shape (``dsa_bench.SHAPES``). Times, in the same run and on the same bf16 inputs:

* :func:`kernels.dsa.indexer_triton._pool_scores_kernel` for every tile x ``MAXIMA`` (whether
  it folds the column-group maxima) x ``PAIR`` (two heads' products issued back to back) x ``SEG``
  (segment maxima kept, v11) x ``TMA`` (tensor-descriptor loads, v12) variant, called directly
  (``.fn``, no autotuner; ``MAXIMA`` False: the v8 split), and the v5 score kernel (no maxima;
  ``--anchor .bench/indexer_v5.py``, an earlier copy of the file) as the no-fold baseline;
* :func:`kernels.dsa.indexer_triton._select_kernel` for every ``CHUNK`` x warps x
  ``SPLIT_SORT`` x ``LOOP_STAGES`` x ``BOUND_PASS`` x ``SEG`` variant on the scores of the first variant;
* end to end (:func:`end_to_end`): v6b against the fastest v7 (bound from the score kernel),
  v8 (bound from the selection's own pass), v9 and v11 (segment skip), each with and without
  tensor descriptors, at 256k and 1M tokens; ``--crossover`` adds v11 from the pool count where
  one query block gains (:func:`crossover`).

Every score variant must write the same scores as the first and the maxima of its own column
groups and segments (recomputed here with torch from the scores); every selection variant the same indices,
equal to ``torch.topk`` over the composite keys. ``--profile`` adds the CUDA time per kernel of
one end-to-end :func:`kernels.dsa.lightning_indexer_topk` call at 1M tokens (full shape).
Score TFLOP/s are quoted against a bf16 matmul measured in the same run. Prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

import kernels.dsa.indexer_triton as it  # noqa: E402
from dsa_bench import KPOOL, SHAPES, TOPK, ceilings, indexer_inputs, timed  # noqa: E402
from kernels.dsa.indexer import _selection_keys, decode_selection_keys, kpool_grid  # noqa: E402

ROWS, POOLS, DEVICE = 8192, 65536, "cuda"
REPORTED: list[dict] = []   # every row printed, in order
N_SELECT = TOPK // KPOOL
# (BLOCK_M, BLOCK_N, warps, stages, MAXIMA, PAIR): the tile the autotuner chose in v5/v6b with
# and without maxima and pairing, and one warpgroup per 64-query tile (two CTAs per SM at 255
# registers, tests/benchmarks/sm90_resources.py: one CTA's ReLU-weighted epilogue can run beside
# the other's MMA; PAIR with 2 stages to fit two CTAs' shared memory)
# (..., SEG, TMA): the segment width of the v11 maxima (0: none); queries and pool keys through
# tensor descriptors (v12); (..., TMA_STORE): score tiles stored through a tensor descriptor (v13)
SCORE_VARIANTS = {
    "full": [(128, 128, 8, 3, m, p, 0, t, False) for m in (True, False) for p in (False, True)
             for t in (False, True)] + [
        (64, 128, 4, st, m, p, 0, True, False) for m in (True, False) for st, p in [(3, False), (2, True)]] + [
        (128, 128, 8, 3, True, p, seg, t, False) for p in (True, False) for seg in (64, 128)
        for t in (False, True)],
    "small": [(128, 128, 8, 3, m, p, 0, t, False) for m in (True, False) for p in (False, True)
              for t in (False, True)] + [
        (64, 128, 4, 3, True, False, 0, True, False), (128, 128, 8, 3, True, True, 64, True, False)],
}
# (PAIR with 3 stages and descriptor stores needs 288 KiB of shared memory for the full shape: 2
# stages); 64x128 tiles with one warpgroup: two CTAs per SM (the autotuner's v13 choice)
QUICK_SCORE_VARIANTS = [(bm, bn, w, st, True, pair, seg, tma, store)
                        for bm, bn, w, st, pair, seg, tma, store in [
    (128, 128, 8, 3, True, 0, False, False), (128, 128, 8, 3, True, 64, True, False),
    (128, 128, 8, 2, True, 64, True, True), (64, 128, 4, 3, False, 64, True, False),
    (64, 128, 4, 3, False, 64, True, True), (64, 128, 4, 3, False, 0, True, True),
    (64, 128, 4, 3, False, 64, False, False)]]
# (CHUNK, warps, SPLIT_SORT, LOOP_STAGES, BOUND_PASS, COMPACT, SEG)
SELECT_VARIANTS = [(4096, 4, False, 1, False, "atomic", 0), (1024, 4, True, 3, False, "atomic", 0)] + [
                  (c, 4, True, st, bound, "relaxed", 0) for bound in (False, True)
                  for c, st in [(512, 3), (1024, 3), (1024, 4), (2048, 3)]] + [
                  (c, 4, True, st, False, "relaxed", seg) for seg in (128, 64)
                  for c, st in [(512, 2), (512, 3), (1024, 3), (2048, 3)]]
QUICK_SELECT_VARIANTS = [(c, 4, True, st, bound, "relaxed", seg) for c, st, bound, seg in [
    (512, 3, False, 0), (1024, 3, False, 0), (1024, 3, True, 0), (512, 2, False, 64), (512, 3, False, 64)]]
CROSSOVER_POOLS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
CROSSOVER = False   # --crossover: v11 also from the crossover pool count (crossover())
DEFAULT_MIN_POOLS = it.SEGMENT_MIN_POOLS


def bound_source(maxima_or_bound_pass: bool, seg: int, selection: bool = False) -> str:
    """End-to-end variant a score or selection variant belongs to: ``"v9"`` (bound from the score
    kernel's maxima, whole rows read), ``"v11 SEG=<seg>"`` (and only the segments above the bound)
    or ``"v8"`` (bound from the selection's own pass; score kernel without maxima)."""
    in_selection = maxima_or_bound_pass if selection else not maxima_or_bound_pass
    return "v8" if in_selection else (f"v11 SEG={seg}" if seg else "v9")


def plain_source(source: str) -> str:
    """An end-to-end variant's name without its load/store suffix (:func:`score_suffix`)."""
    return source.split(" T")[0]


def score_suffix(tma: bool, store: bool) -> str:
    """The name suffix of a score variant's load and store switches in :func:`end_to_end` (v12, v13)."""
    return "".join(f" {n}" for n, on in [("TMA", tma), ("TMA_STORE", store)] if on)


def cuda_ms(fn, reps: int = 5) -> float:
    """Mean milliseconds of ``fn`` over ``reps`` runs after one warm-up (:func:`dsa_bench.timed`)."""
    if DEVICE == "cpu":   # the interpreter check of this script (--device cpu): one timed run
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return timed(fn, reps)[0] * 1e3


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def group_maxima(scores: torch.Tensor, block_n: int) -> torch.Tensor:
    """``[ROWS, N_COLUMNS]`` row maxima of the score kernel's column groups (pool ``c`` of tile
    ``n`` in group ``(n mod programs) * GROUP_N + c mod GROUP_N``)."""
    columns, group_n = it._n_columns(N_SELECT), it.GROUP_N
    n_prog = columns // group_n
    pool = torch.arange(scores.shape[-1], device=scores.device)
    tile, c = pool // block_n, pool % block_n
    group = (tile % n_prog) * group_n + c % group_n
    out = torch.full((scores.shape[0], columns), float("-inf"), device=scores.device)
    return out.scatter_reduce(1, group.expand_as(scores), scores, "amax")


def end_to_end(shape, best, best_sel, ceil, report) -> None:
    """:func:`kernels.dsa.lightning_indexer_topk` at 256k and 1M tokens, same run, same inputs, with
    the v6b kernels (the bound from the score kernel's maxima, no PAIR; selection CHUNK 4096, 4 warps,
    no SPLIT_SORT, no loop pipelining, acquire-release slot atomics; the torch expansion to token
    indices), v7 (the fastest v9 score variant; selection CHUNK 1024, 3 stages, split sort,
    acquire-release atomics) and the fastest variants with the bound from the score kernel ("v9"),
    from the selection's own pass ("v9, bound in selection") and with the segment skip ("v11"),
    with the one-kernel expansion (``triton_expand_selection``). ``best``/``best_sel`` map
    :func:`bound_source` to the fastest variant; all select identical indices."""
    from kernels.dsa import lightning_indexer_topk

    first = best["v9"]
    # name -> (bound in selection, segment width, SEGMENT_MIN_POOLS, score config, selection config, expansion,
    # (tensor-descriptor loads, tensor-descriptor stores))
    plain_loops = (False, False)
    variants = {"v6b": (False, 0, 0, (dict(first[2], PAIR=False), first[3], first[4]),
                        (dict(CHUNK=4096, SPLIT_SORT=False, LOOP_STAGES=1, COMPACT="atomic"), 4), "torch", plain_loops),
                "v7": (False, 0, 0, first[2:5], (dict(CHUNK=1024, SPLIT_SORT=True, LOOP_STAGES=3, COMPACT="atomic"), 4),
                       "triton", plain_loops)}
    for source in sorted(best):   # v11 once per segment width, each with its load/store/loop switches
        plain = plain_source(source)
        if plain in best_sel:
            name = {"v8": "v9, bound in selection"}.get(plain, plain) + source[len(plain):]
            variants[name] = (plain == "v8", best[source][5], DEFAULT_MIN_POOLS, best[source][2:5],
                              best_sel[plain][2:4], "triton", best[source][6])
    one_kernel = it.triton_expand_selection
    for name in [n for n in variants if n.startswith("v11") and CROSSOVER]:   # from the block size where it pays
        whole = variants.get("v9" + name[len(plain_source(name)):], variants.get("v9"))
        try:
            pools = crossover(shape, whole, variants[name], report)
        except Exception as err:  # the end-to-end rows stand without it
            report(dict(shape=shape, crossover_error=repr(err)[:400]))
            pools = None
        if pools is not None:
            variants[f"{name} from {pools} pools"] = variants[name][:2] + (pools,) + variants[name][3:]
    for seq_len in (262144, 1048576):
        inputs, kw, flops = indexer_inputs(seq_len, SHAPES[shape], seed=seq_len)
        picked = {}
        for name, variant in variants.items():
            use_variant(variant, one_kernel)
            picked[name] = lightning_indexer_topk(*inputs, **kw).cpu()
            t, peak = timed(lambda: lightning_indexer_topk(*inputs, **kw), 2 if seq_len > 262144 else 3)
            report(dict(shape=shape, seq_len=seq_len, end_to_end=name, seconds=t, peak_gib=peak,
                        pct_of_matmul=100 * flops / t / 1e12 / ceil["matmul_tflops"]))
        report(dict(shape=shape, seq_len=seq_len, identical=all(torch.equal(picked["v6b"], v) for v in picked.values())))
        del inputs
        torch.cuda.empty_cache()
    # leave the fastest end-to-end variant pinned (for --profile)
    fastest = min((r for r in REPORTED if r.get("end_to_end") and r["shape"] == shape and r["seq_len"] == 1048576),
                  key=lambda r: r["seconds"])["end_to_end"]
    use_variant(variants[fastest], one_kernel)
    report(dict(shape=shape, profiled_variant=fastest))


def crossover(shape: str, whole, segmented, report) -> int | None:
    """The smallest pool count of :data:`CROSSOVER_POOLS` from which one query block (8192 queries,
    the last of a sequence, :func:`kernels.dsa.indexer_triton.triton_pool_topk`) is faster with
    the ``segmented`` variant (v11: segment maxima, the selection reads the segments above its
    bound) than with ``whole`` (v9: whole rows) at every larger count; None if never. Both
    variants are :func:`end_to_end` tuples; their indices must be equal."""
    h, d = SHAPES[shape]["index_heads"], SHAPES[shape]["index_dim"]
    times = {}
    for pools in CROSSOVER_POOLS:
        n_keys = (pools + ROWS // KPOOL) * KPOOL   # the block's last query sees pools + 512 pools
        gen = torch.Generator(device=DEVICE).manual_seed(pools)
        q = torch.randn(1, ROWS, h, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        pk = torch.randn(1, n_keys // KPOOL, d, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        w = torch.randn(1, ROWS, h, device=DEVICE, generator=gen) * h**-0.5
        grid = kpool_grid(n_keys, KPOOL, device=DEVICE)
        got = {}
        for name, variant in [("v9", whole), ("v11", segmented)]:
            use_variant(variant, it.triton_expand_selection, min_pools=0)

            def call():
                return it.triton_pool_topk(q, pk, w, grid, N_SELECT, d**-0.5, n_keys - ROWS)
            got[name] = call()
            times[pools, name] = cuda_ms(call)
        report(dict(shape=shape, crossover_pools=pools, v9_ms=times[pools, "v9"], v11_ms=times[pools, "v11"],
                    segment=segmented[1], identical=bool(torch.equal(got["v9"], got["v11"]))))
    faster = [times[p, "v11"] < times[p, "v9"] for p in CROSSOVER_POOLS]
    for i, pools in enumerate(CROSSOVER_POOLS):
        if all(faster[i:]):
            return pools
    return None


def profiled(call, calls: int = 1):
    """The CUDA profile (``torch.profiler``) of ``calls`` calls of ``call`` issued back to back, after a
    warm-up call."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return prof


def cuda_launches(prof) -> list[tuple[float, float, str]]:
    """``(start us, end us, name)`` of every device event of a profile (kernels, copies), in start order."""
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)


def profile_call(call, label: str, top: int = 10, calls: int = 1) -> list[dict]:
    """CUDA milliseconds of the ``top`` kernels of ``calls`` back-to-back calls of ``call`` (after a
    warm-up) and the device's idle time in their span (:func:`device_idle`), as rows labelled ``label``."""
    prof = profiled(call, calls)
    rows = [dict(profile=label, kernel=e.key[:90], calls=e.count, ms=e.device_time_total / 1e3)
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]]
    try:
        rows.append(dict(profile=label, **device_idle(prof)))
    except Exception as err:  # the kernel rows stand without it
        rows.append(dict(profile=label, device_idle_error=repr(err)[:300]))
    return rows


def block_profile(call, label: str, seq_len: int, kpool: int, heads: int, dim: int, matmul_tflops: float,
                  bins: int = 8) -> list[dict]:
    """Per query block of one ``call`` (after a warm-up) of the indexer on one ``seq_len``-token sequence
    (no documents, ``kpool``-token pools): the CUDA milliseconds of its score and selection kernels, in
    launch order, summed over ``bins`` runs of consecutive blocks, with each run's score FLOPs as a share of
    ``matmul_tflops`` (``2 * heads * dim`` per query and visible pool; the query at position ``t`` sees
    ``(t + 1) // kpool`` pools; blocks of :func:`kernels.dsa.indexer_triton._query_block` queries). A last
    row compares the score kernel's total with its total at the rate of the last run (the largest blocks):
    the difference is what smaller blocks cost beyond their FLOPs (fixed costs per program and launch)."""
    launches = cuda_launches(profiled(call))
    score = [(end - start) / 1e3 for start, end, name in launches if "pool_scores" in name]
    select = [(end - start) / 1e3 for start, end, name in launches if "_select_kernel" in name]
    return binned_blocks(label, score, select, seq_len, kpool, heads, dim, matmul_tflops, bins)


def binned_blocks(label: str, score: list, select: list, seq_len: int, kpool: int, heads: int, dim: int,
                  matmul_tflops: float, bins: int) -> list[dict]:
    """:func:`block_profile`'s rows from the per-launch milliseconds ``score`` and ``select`` (launch order)."""
    import kernels.dsa.indexer_triton as it

    block = it._query_block(1, seq_len // kpool, it._block_unit(torch.device("cuda")))
    bounds = [(t0, min(t0 + block, seq_len)) for t0 in range(0, seq_len, block) if min(t0 + block, seq_len) > kpool - 1]
    if not (len(score) == len(select) == len(bounds)):
        return [dict(blocks=label, error=f"{len(score)} score and {len(select)} selection launches, "
                                         f"{len(bounds)} blocks expected")]

    def visible(t: int) -> int:   # sum over queries [0, t) of (q + 1) // kpool = sum over u in [1, t] of u // kpool
        full, rest = divmod(t, kpool)
        return kpool * full * (full - 1) // 2 + full * (rest + 1)

    flops = [2 * heads * dim * (visible(t1) - visible(t0)) for t0, t1 in bounds]
    rows, per_bin = [], -(-len(bounds) // bins)
    runs = range(0, len(bounds), per_bin)
    for b0 in runs:
        b1 = min(b0 + per_bin, len(bounds))
        s_ms, f = sum(score[b0:b1]), sum(flops[b0:b1])
        rows.append(dict(blocks=label, first_block=b0, last_block=b1 - 1, pools_last=bounds[b1 - 1][1] // kpool,
                         score_ms=s_ms, score_pct=100 * f / (s_ms / 1e3) / 1e12 / matmul_tflops,
                         select_ms=sum(select[b0:b1]), select_ns_per_row=1e6 * sum(select[b0:b1]) /
                         (bounds[b1 - 1][1] - bounds[b0][0])))
    last_rate = sum(flops[runs[-1]:]) / sum(score[runs[-1]:])   # the last run: the largest blocks
    rows.append(dict(blocks=label, score_ms=sum(score), score_ms_at_last_rate=sum(flops) / last_rate,
                     select_ms=sum(select)))
    return rows


def device_idle(prof, bins: int = 10) -> dict:
    """Device busy and idle milliseconds of one profile: the kernels' union against the span from the
    first kernel's start to the last one's end, the five longest idle gaps with the kernels on either
    side (host syncs and launch overhead show up here, not in kernel times) and the idle milliseconds
    in each of ``bins`` equal parts of the span (where in the call the device waits)."""
    kernels = cuda_launches(prof)
    first = kernels[0][0]
    busy, gaps, reach, before = 0.0, [], first, kernels[0][2]
    for start, end, name in kernels:
        if start > reach:
            gaps.append((start - reach, before, name, reach))
        busy += max(0.0, end - max(start, reach))
        if end > reach:
            reach, before = end, name
    width = max(reach - first, 1e-9) / bins
    by_bin = [0.0] * bins
    for length, _, _, at in gaps:   # split each gap over the parts it covers
        lo, hi = at - first, at - first + length
        for i in range(int(lo // width), min(bins - 1, int(hi // width)) + 1):
            by_bin[i] += max(0.0, min(hi, (i + 1) * width) - max(lo, i * width)) / 1e3
    gaps.sort(reverse=True)
    return dict(span_ms=(reach - first) / 1e3, busy_ms=busy / 1e3, idle_ms=sum(g[0] for g in gaps) / 1e3,
                idle_gaps=len(gaps), idle_ms_by_part=[round(x, 3) for x in by_bin],
                longest_gaps=[(round(g / 1e3, 3), a[:40], b[:40]) for g, a, b, _ in gaps[:5]])


def use_variant(variant: tuple, one_kernel, min_pools: int | None = None) -> None:
    """Make :func:`kernels.dsa.lightning_indexer_topk` run an :func:`end_to_end` variant: the
    module switches of :mod:`kernels.dsa.indexer_triton` (``min_pools`` overrides the variant's
    ``SEGMENT_MIN_POOLS``), its expansion (``one_kernel`` for ``"triton"``, else the torch one;
    the indexer looks it up per call) and both kernels' pinned configurations."""
    from kernels.dsa.indexer import _expand_selection

    bound_pass, seg, variant_min_pools, (skw, sw, sst), (selkw, selw), expand, (tma, store) = variant
    it.BOUND_IN_SELECTION, it.SEGMENT, it.TENSOR_DESCRIPTORS, it.STORE_DESCRIPTOR = bound_pass, seg, tma, store
    it.SEGMENT_MIN_POOLS = variant_min_pools if min_pools is None else min_pools
    it.triton_expand_selection = one_kernel if expand == "triton" else _expand_selection
    pin_configs(skw, sw, sst, selkw, selw)


def pin_configs(score_kw: dict, score_warps: int, score_stages: int, select_kw: dict, select_warps: int) -> None:
    """Give both autotuned kernels one configuration (no tuning, no other compiles)."""
    it._pool_scores_kernel.configs = [triton.Config(score_kw, num_warps=score_warps, num_stages=score_stages)]
    it._select_kernel.configs = [triton.Config(select_kw, num_warps=select_warps)]
    it._pool_scores_kernel.cache.clear()
    it._select_kernel.cache.clear()


def main() -> None:
    global ROWS, POOLS, DEVICE, CROSSOVER
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["full", "small"], choices=list(SHAPES))
    parser.add_argument("--anchor", default=".bench/indexer_v5.py")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="the 128x128 tile with and without maxima and PAIR only, no v5 baseline")
    parser.add_argument("--out", default=None)
    parser.add_argument("--crossover", action="store_true",
                        help="time one query block per pool count, whole rows against segments (v11)")
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--pools", type=int, default=POOLS)
    parser.add_argument("--device", default="cuda",
                        help="cpu: check the script under TRITON_INTERPRET=1 (float32, small --rows/--pools)")
    args = parser.parse_args()
    ROWS, POOLS, DEVICE, CROSSOVER = args.rows, args.pools, args.device, args.crossover
    it._set_descriptor_allocator(torch.device(DEVICE))   # the TMA variants' descriptors
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    v5 = None
    if not args.quick:   # --quick skips the v5 baseline: the anchor file need not be there
        spec = importlib.util.spec_from_file_location("indexer_anchor", args.anchor)
        v5 = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(v5)
    ceil = ceilings() if DEVICE == "cuda" else dict(matmul_tflops=float("nan"), copy_tbps=float("nan"))
    print(json.dumps(dict(ceilings=ceil)), flush=True)
    rows = REPORTED

    def report(row):
        print(json.dumps(row), flush=True)
        rows.append(row)

    columns, capacity = it._n_columns(N_SELECT), it._capacity(N_SELECT)
    for shape in args.shapes:
        h, d = SHAPES[shape]["index_heads"], SHAPES[shape]["index_dim"]
        gen = torch.Generator(device=DEVICE).manual_seed(h * d)
        q = torch.randn(1, ROWS, h, d, device=DEVICE, dtype=dtype, generator=gen)
        pk = torch.randn(1, POOLS, d, device=DEVICE, dtype=dtype, generator=gen)
        w = (torch.randn(1, ROWS, h, device=DEVICE, generator=gen) * h**-0.5 * d**-0.5).contiguous()
        # every pool visible to every query: [lo, hi) = [0, POOLS) (the v5 anchor gets pool ends and documents)
        q_lo = torch.zeros(ROWS, dtype=torch.int32, device=DEVICE)
        q_hi = torch.full((ROWS,), POOLS, dtype=torch.int32, device=DEVICE)
        flops = 2 * ROWS * POOLS * h * d
        scores = torch.empty(1, ROWS, POOLS, device=DEVICE)
        col_max = torch.empty(1, ROWS, columns, device=DEVICE)
        seg_max = torch.empty(1, ROWS, POOLS // 64, device=DEVICE)   # room for the narrowest segments
        size_class = it._size_class(POOLS)
        ref_scores = None

        def score_args(out, cmax, smax):
            return (q, pk, w, out, cmax, smax, q_lo, q_hi,
                    q.stride(0), q.stride(1), q.stride(2), pk.stride(0), pk.stride(1), w.stride(0), w.stride(1),
                    out.stride(0), out.stride(1), cmax.stride(0), cmax.stride(1), smax.stride(0), smax.stride(1),
                    ROWS, POOLS, 0, size_class)

        best = {}   # bound_source -> the fastest score variant
        for bm, bn, warps, stages, maxima, pair, seg, tma, store in (
                QUICK_SCORE_VARIANTS if args.quick else SCORE_VARIANTS[shape]):
                    name = (f"scores {bm}x{bn} w{warps} s{stages} MAXIMA={int(maxima)} PAIR={int(pair)} SEG={seg} "
                            f"TMA={int(tma)} TMA_STORE={int(store)}")
                    seg_out = seg_max[..., :POOLS // seg] if seg else seg_max

                    def run(bm=bm, bn=bn, warps=warps, stages=stages, maxima=maxima, pair=pair, seg=seg, seg_out=seg_out,
                            tma=tma, store=store):
                        it._pool_scores_kernel.fn[(columns // it.GROUP_N, triton.cdiv(ROWS, bm), 1)](
                            *score_args(scores, col_max, seg_out), H=h, D=d, N_COLUMNS=columns, GROUP_N=it.GROUP_N,
                            BLOCK_M=bm, BLOCK_N=bn, MAXIMA=maxima, PAIR=pair, SEG=seg, TMA=tma, TMA_STORE=store,
                            num_warps=warps, num_stages=stages)
                    try:
                        scores.fill_(float("nan"))
                        col_max.fill_(float("nan"))
                        seg_max.fill_(float("nan"))
                        run()
                        sync()
                        if ref_scores is None:
                            ref_scores = scores.clone()
                        same = bool(torch.equal(scores, ref_scores))
                        maxima_ok = not maxima or bool(torch.equal(col_max[0], group_maxima(ref_scores[0], bn)))
                        if seg:
                            maxima_ok &= bool(torch.equal(seg_out[0], ref_scores[0].view(ROWS, -1, seg).amax(-1)))
                        ms = cuda_ms(run)
                        row = dict(shape=shape, kernel=name, ms=ms, tflops=flops / ms / 1e9,
                                   pct_of_matmul=100 * flops / ms / 1e9 / ceil["matmul_tflops"],
                                   scores_equal=same, maxima_equal=maxima_ok)
                        source = bound_source(maxima, seg) + score_suffix(tma, store)
                        if same and maxima_ok and (source not in best or ms < best[source][0]):
                            best[source] = (ms, name, dict(BLOCK_M=bm, BLOCK_N=bn, PAIR=pair), warps, stages, seg,
                                            (tma, store))
                    except Exception as err:  # report and go on
                        row = dict(shape=shape, kernel=name, error=repr(err)[:400])
                    report(row)
        # the v5 score kernel: one tile per program, no column maxima
        v5_scores = torch.empty_like(scores)
        v5_ints = [(torch.arange(1, POOLS + 1, device=DEVICE) * KPOOL), torch.zeros(POOLS, dtype=torch.long, device=DEVICE),
                   POOLS * KPOOL + torch.arange(ROWS, device=DEVICE), torch.zeros(ROWS, dtype=torch.long, device=DEVICE)]

        def run_v5():
            v5._pool_scores_kernel.fn[(triton.cdiv(POOLS, 128), triton.cdiv(ROWS, 128), 1)](
                q, pk, w, v5_scores, *v5_ints,
                q.stride(0), q.stride(1), q.stride(2), pk.stride(0), pk.stride(1), w.stride(0), w.stride(1),
                v5_scores.stride(0), v5_scores.stride(1), ROWS, POOLS, 0, size_class, H=h, D=d,
                BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)
        try:
            if args.quick:
                raise RuntimeError("skipped (--quick)")
            run_v5()
            ms = cuda_ms(run_v5)
            report(dict(shape=shape, kernel="scores v5 128x128 w8 s3 (no maxima)", ms=ms, tflops=flops / ms / 1e9,
                        pct_of_matmul=100 * flops / ms / 1e9 / ceil["matmul_tflops"],
                        scores_equal=bool(torch.equal(v5_scores, ref_scores))))
        except Exception as err:
            report(dict(shape=shape, kernel="scores v5", error=repr(err)[:400]))
        del v5_scores
        if ref_scores is None:
            continue
        # selection on the reference scores with the maxima of a 128x128 tiling (the first variant)
        col_ref = group_maxima(ref_scores[0], SCORE_VARIANTS[shape][0][1])[None].contiguous()
        keys = _selection_keys(ref_scores[0], torch.arange(POOLS, device=DEVICE), torch.isfinite(ref_scores[0]))
        want, _ = decode_selection_keys(keys.topk(N_SELECT, dim=-1).values)
        counts = torch.zeros(1, ROWS, dtype=torch.int32, device=DEVICE)
        slots = torch.empty(ROWS, capacity, dtype=torch.long, device=DEVICE)
        selected = torch.empty(1, ROWS, N_SELECT, dtype=torch.long, device=DEVICE)
        read_gb = ROWS * POOLS * 4 / 1e9
        best_sel = {}
        # the segment maxima of every width, the selection's bound and the share of segments above it
        seg_ref = {seg: ref_scores.view(1, ROWS, -1, seg).amax(-1).contiguous() for seg in (64, 128)}
        bound = col_ref[0].topk(N_SELECT, dim=-1).values[:, -1:]
        read_share = {seg: float((m[0] >= bound).float().mean()) for seg, m in seg_ref.items()}
        hits = torch.empty(ROWS * (POOLS // 64), dtype=torch.int32, device=DEVICE)
        for chunk, warps, split, loop_stages, bound_pass, compact, seg in (
                QUICK_SELECT_VARIANTS if args.quick else SELECT_VARIANTS):
                    name = (f"select CHUNK={chunk} w{warps} SPLIT_SORT={int(split)} LOOP_STAGES={loop_stages} "
                            f"BOUND_PASS={int(bound_pass)} COMPACT={compact} SEG={seg}")
                    seg_in = seg_ref[seg] if seg else col_ref

                    def run_sel(chunk=chunk, warps=warps, split=split, loop_stages=loop_stages, bound_pass=bound_pass,
                                compact=compact, seg=seg, seg_in=seg_in):
                        counts.zero_()
                        it._select_kernel.fn[(ROWS,)](
                            ref_scores, col_ref, seg_in, hits, counts, slots, selected, q_lo, q_hi,
                            ref_scores.stride(0), ref_scores.stride(1), col_ref.stride(0), col_ref.stride(1),
                            seg_in.stride(0), seg_in.stride(1),
                            counts.stride(0), selected.stride(0), selected.stride(1), ROWS, POOLS, 0, size_class,
                            N_SELECT=N_SELECT, N_COLUMNS=columns, CAPACITY=capacity, CHUNK=chunk,
                            SPLIT_SORT=split, LOOP_STAGES=loop_stages, BOUND_PASS=bound_pass, COMPACT=compact,
                            SEG=seg, **it.select_constants(), num_warps=warps)
                    try:
                        selected.fill_(-7)
                        run_sel()
                        sync()
                        ok = bool(torch.equal(selected[0], want)) and int(counts.max()) <= capacity
                        ms = cuda_ms(run_sel)
                        row = dict(shape=shape, kernel=name, ms=ms, read_tbps=read_gb / ms,
                                   pct_of_copy=100 * read_gb / ms / ceil["copy_tbps"],
                                   indices_equal=ok, candidates_mean=float(counts.float().mean()),
                                   candidates_max=int(counts.max()), row_share_read=read_share[seg] if seg else 1.0)
                        source = bound_source(bound_pass, seg, selection=True)
                        if ok and (source not in best_sel or ms < best_sel[source][0]):
                            best_sel[source] = (ms, name, dict(CHUNK=chunk, SPLIT_SORT=split,
                                                               LOOP_STAGES=loop_stages, COMPACT=compact), warps)
                    except Exception as err:
                        row = dict(shape=shape, kernel=name, error=repr(err)[:400])
                    report(row)
        del ref_scores, scores, col_max, seg_max, seg_ref, hits, keys, want
        torch.cuda.empty_cache()
        for source in sorted(best):
            plain = plain_source(source)
            if plain in best_sel:
                report(dict(shape=shape, bound_source=source, fastest_scores=best[source][1], ms=best[source][0],
                            fastest_select=best_sel[plain][1], select_ms=best_sel[plain][0]))
        if "v9" in best and "v9" in best_sel:
            if DEVICE == "cuda":
                end_to_end(shape, best, best_sel, ceil, report)

    if args.profile:   # with the last shape's fastest configurations pinned (end_to_end leaves them)
        from kernels.dsa import lightning_indexer_topk

        inputs, kw, _ = indexer_inputs(1 << 20, SHAPES["full"])
        for row in profile_call(lambda: lightning_indexer_topk(*inputs, **kw), "full 1M", top=14):
            report(row)

    for r in rows:
        if "end_to_end" in r:
            print(f"end to end {r['shape']} {r['seq_len']} {r['end_to_end']}: {r['seconds']:.4f} s "
                  f"({r['pct_of_matmul']:.0f}% of matmul), peak {r['peak_gib']:.1f} GiB")
    print("\n| shape | kernel | ms | TFLOP/s or TB/s | % of ceiling | equal |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "ms" in r and "shape" in r and "kernel" in r:
            rate = r.get("tflops", r.get("read_tbps", 0))
            pct = r.get("pct_of_matmul", r.get("pct_of_copy", 0))
            eq = r.get("scores_equal", r.get("indices_equal"))
            eq = f"{eq}/{r['maxima_equal']}" if "maxima_equal" in r else eq
            print(f"| {r['shape']} | {r['kernel']} | {r['ms']:.2f} | {rate:.1f} | {pct:.0f}% | {eq} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
