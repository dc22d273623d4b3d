"""Lightning indexer + top-k: the current Triton selection against an earlier version, same run (issue 4).

    python tests/benchmarks/indexer_versions.py [--anchor .bench/indexer_v4.py] [--seq-lens ...] [--profile]
        [--out f.json]

``--anchor`` is an earlier copy of ``kernels/dsa/indexer_triton.py`` (e.g. ``git show
<rev>:kernels/dsa/indexer_triton.py``). For the ``small`` and ``full`` DSA shapes it times
:func:`kernels.dsa.lightning_indexer_topk` end to end with each version's k-pool compression,
``triton_pool_topk`` and expansion (:data:`STAGES`) on the same bf16 inputs, checks that both select
identical indices (both are exact with the same tie rule), and reports the achieved score TFLOP/s against a bf16 matmul measured in the
same run. ``--profile`` adds, per shape and length, the CUDA time per kernel of one call of the
current version (and of each ``--also`` version) and the device's idle time inside it (host syncs, launches); ``--memory``, per
version, the peak memory of ``triton_pool_topk`` alone (pooled keys made beforehand); ``--also``
adds the current version with some of its module constants set (e.g. ``v13cols:COLUMNS_PER_SELECTED=4,GROUP_N=32``);
``--host``, per shape and length, the host time of one call of the current version and where it
goes (``cProfile``); ``--blocks``, per run of consecutive query blocks, the score and selection kernels'
milliseconds and the score kernel's share of the matmul rate; ``--rounds N`` times every version N times,
the versions taking turns, and reports the median. One JSON line per row and a table.
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import importlib.util
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import kernels.dsa.indexer_triton as current  # noqa: E402
from kernels.dsa import lightning_indexer_topk  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from dsa_bench import SHAPES, ceilings, indexer_inputs, timed  # noqa: E402
from indexer_score_variants import block_profile, profile_call  # noqa: E402


def load_anchor(path: str):
    spec = importlib.util.spec_from_file_location("indexer_anchor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STAGES = ("triton_kpool_compress", "triton_pool_topk", "triton_expand_selection")
"""The CUDA stages of :func:`kernels.dsa.lightning_indexer_topk`, looked up in :mod:`kernels.dsa.indexer_triton`
per call: a version is one function per stage."""


def stages_of(module) -> dict:
    """A version's stages from an ``indexer_triton.py`` module; one before v27 has no
    ``triton_kpool_compress``: its calls compressed with the torch path."""
    from kernels.dsa.indexer import _compress_on_grid

    fns = {stage: getattr(module, stage, None) for stage in STAGES}
    fns["triton_kpool_compress"] = fns["triton_kpool_compress"] or _compress_on_grid
    return fns


def use(fns: dict) -> None:
    """Make ``fns`` (:func:`stages_of`) the stages :func:`kernels.dsa.lightning_indexer_topk` calls."""
    for stage, fn in fns.items():
        setattr(current, stage, fn)


def with_constants(fn, constants: dict):
    """``fn`` run with the module constants ``constants`` of :mod:`kernels.dsa.indexer_triton` set
    (restored after each call)."""
    for attr in constants:
        if not hasattr(current, attr):
            raise SystemExit(f"kernels/dsa/indexer_triton.py has no constant {attr}")

    def run(*args, **kwargs):
        saved = {attr: getattr(current, attr) for attr in constants}
        for attr, value in constants.items():
            setattr(current, attr, value)
        try:
            return fn(*args, **kwargs)
        finally:
            for attr, value in saved.items():
                setattr(current, attr, value)
    return run


def host_time(call, label: str, calls: int = 10, top: int = 12) -> list[dict]:
    """Host seconds per ``call`` (``calls`` calls issued back to back, timed before the device
    finishes: the call never waits for the device) and the ``top`` functions by their own host time
    under ``cProfile``, one row each."""
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    rows = [dict(host=label, host_ms_per_call=1e3 * host)]
    stats = pstats.Stats(profiler).stats
    for (path, line, func), (_, n, own, cumulative, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
        rows.append(dict(host=label, function=f"{os.path.basename(path)}:{line}:{func}", calls_per_call=n / calls,
                         own_ms_per_call=1e3 * own / calls, cumulative_ms_per_call=1e3 * cumulative / calls))
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def selection_memory(fn, inputs, kw, label: str) -> dict:
    """Peak GiB allocated by one call of ``fn`` (a ``triton_pool_topk``) alone, above what was
    allocated before it, at the inputs of :func:`dsa_bench.indexer_inputs` (pooled keys made beforehand)."""
    from kernels.dsa.indexer import _compress_on_grid, kpool_grid

    q, k, gate_scores, ape, weights = inputs
    kpool, n_select = kw["kpool"], kw["topk"] // kw["kpool"]
    grid = kpool_grid(k.shape[1], kpool, None, q.device)
    pool_keys = _compress_on_grid(k, gate_scores, ape, grid)
    fn(q, pool_keys, weights, grid, n_select, kw["softmax_scale"], 0)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(q, pool_keys, weights, grid, n_select, kw["softmax_scale"], 0)
    torch.cuda.synchronize()
    row = dict(memory=label, selection_peak_gib=(torch.cuda.max_memory_allocated() - base) / 2**30)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--anchor", default=None, help="an earlier indexer_triton.py (default: none; the "
                        "--also versions are then checked against the current one)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[65536, 262144, 1048576])
    parser.add_argument("--shapes", nargs="+", default=["full", "small"], choices=list(SHAPES))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-calls", type=int, default=1, help="calls per --profile, issued back to back "
                        "(as the timing issues them)")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--host", action="store_true")
    parser.add_argument("--blocks", action="store_true", help="per run of query blocks: score and selection "
                        "kernel milliseconds and the score kernel's share of the matmul rate (current and --also "
                        "versions)")
    parser.add_argument("--also", nargs="+", default=[], metavar="NAME:ATTR=VALUE[,ATTR=VALUE]",
                        help="also time the current version with module constants of kernels/dsa/indexer_triton.py "
                             "set, e.g. v13cols:COLUMNS_PER_SELECTED=4,GROUP_N=32")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per version after a warm-up "
                        "(default: 2 above 256k tokens, else 5)")
    parser.add_argument("--rounds", type=int, default=1, help="timings of each version, the versions taking "
                        "turns; the table gives the median")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    versions = {"anchor": stages_of(load_anchor(args.anchor))} if args.anchor else {}
    versions["current"] = stages_of(current)
    for spec in args.also:
        name, settings = spec.split(":", 1)
        constants = {attr: ast.literal_eval(value)
                     for attr, value in (item.split("=", 1) for item in settings.split(","))}
        versions[name] = {stage: with_constants(fn, constants) for stage, fn in versions["current"].items()}
    ceil = ceilings()
    print(json.dumps(dict(ceilings=ceil)), flush=True)
    rows = []
    for name in args.shapes:
        for seq_len in args.seq_lens:
            inputs, kw, flops = indexer_inputs(seq_len, SHAPES[name], seed=seq_len)
            selected, times, peaks, failed = {}, {v: [] for v in versions}, {}, {}
            # the versions take turns, round after round: a drift of the clocks over the run (power, heat)
            # falls on all of them alike
            for _ in range(args.rounds):
                for version, fn in versions.items():
                    if version in failed:
                        continue
                    use(fn)   # lightning_indexer_topk looks the stages up at call time
                    try:
                        if version not in selected:   # kept on the host: the other version's peak must not include it
                            selected[version] = lightning_indexer_topk(*inputs, **kw).cpu()
                        t, peak = timed(lambda: lightning_indexer_topk(*inputs, **kw),
                                        args.reps or (2 if seq_len > 262144 else 5))
                        times[version].append(t)
                        peaks[version] = max(peak, peaks.get(version, 0.0))
                    except Exception as err:  # report and go on
                        failed[version] = repr(err)[:300]
            for version in versions:
                if version in failed:
                    row = dict(shape=name, seq_len=seq_len, version=version, error=failed[version])
                else:
                    t = statistics.median(times[version])
                    row = dict(shape=name, seq_len=seq_len, version=version, seconds=t,
                               seconds_per_round=times[version], peak_gib=peaks[version], tflops=flops / t / 1e12,
                               pct_of_matmul=100 * flops / t / 1e12 / ceil["matmul_tflops"])
                print(json.dumps(row), flush=True)
                rows.append(row)
            use(versions["current"])
            if args.memory:
                for version, fn in versions.items():
                    rows.append(selection_memory(fn["triton_pool_topk"], inputs, kw,
                                                 f"{name} {seq_len // 1024}k {version}"))
            if args.host:
                rows.extend(host_time(lambda: lightning_indexer_topk(*inputs, **kw), f"{name} {seq_len // 1024}k"))
            # per-call profiles of the current version and each --also version, labelled by version
            shape = SHAPES[name]
            profiles = ([lambda call, label: profile_call(call, label, calls=args.profile_calls)]
                        if args.profile else []) + (
                [(lambda call, label: block_profile(call, label, seq_len, kw["kpool"], shape["index_heads"],
                                                    shape["index_dim"], ceil["matmul_tflops"]))] if args.blocks else [])
            for profile in profiles:
                for version, fn in versions.items():
                    if version == "anchor":
                        continue
                    use(fn)
                    label = f"{name} {seq_len // 1024}k" + ("" if version == "current" else f" {version}")
                    for row in profile(lambda: lightning_indexer_topk(*inputs, **kw), label):
                        print(json.dumps(row), flush=True)
                        rows.append(row)
                use(versions["current"])
            reference = "anchor" if args.anchor else "current"
            for version in [v for v in selected if v != reference] if reference in selected else []:
                same = torch.equal(selected[reference], selected[version])
                differing = int((selected[reference] != selected[version]).any(-1).sum())
                row = dict(shape=name, seq_len=seq_len, version=version, identical=same, differing_rows=differing)
                print(json.dumps(row), flush=True)
                rows.append(row)
            inputs = selected = None   # freed before the next length
            torch.cuda.empty_cache()
    print("\n| shape | T | version | s | TFLOP/s | % of matmul | peak GiB |\n|---|---|---|---|---|---|---|")
    for r in rows:
        if "seconds" in r:
            print(f"| {r['shape']} | {r['seq_len'] // 1024}k | {r['version']} | {r['seconds']:.4f} | {r['tflops']:.0f} "
                  f"| {r['pct_of_matmul']:.0f}% | {r['peak_gib']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(ceilings=ceil, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
