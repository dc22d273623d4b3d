"""Where a kernel's time goes, from Nsight Compute's SASS table (``tests/gpu/ncu_indexer.sh``'s ``ncu_<i>.sass.csv``).

    python tests/benchmarks/ncu_sass.py ncu_1.sass.csv [--top 12]

Reads the per-instruction columns ``Instructions Executed`` (warp-level) and ``Warp Stall Sampling (All
Samples)`` (where warps were when sampled: the time) and prints, as markdown tables, the opcodes with the
largest shares of both, and the hottest instructions by stall samples with the opcode that stalls there (a
consumer waits on its producer: a ``SHFL.IDX`` after an ``ATOMG`` carries the atomic's latency).
"""

from __future__ import annotations

import argparse
import collections
import csv
import re


def read_sass(path: str) -> list[tuple[int, str, int, int]]:
    """``(address, SASS text, stall samples, warp-level executions)`` per instruction of the csv at ``path``.

    Raises:
        ValueError: the file has no ``Source`` / sampling / execution columns (not a ``--page source --csv`` export).
    """
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next((i for i, r in enumerate(rows) if "Source" in r and "Instructions Executed" in r), None)
    if header_at is None:
        raise ValueError(f"{path}: no 'Source' and 'Instructions Executed' columns (ncu --page source --csv)")
    header = rows[header_at]
    i_src, i_exec = header.index("Source"), header.index("Instructions Executed")
    i_samples = header.index("Warp Stall Sampling (All Samples)")
    out = []
    for r in rows[header_at + 1:]:
        if len(r) < len(header) or not r[0].startswith("0x"):
            continue
        out.append((int(r[0], 16), r[i_src].strip(), int(r[i_samples] or 0), int(r[i_exec] or 0)))
    return out


def opcode(sass: str) -> str:
    """The opcode of one SASS line, without its predicate (``@!P0 ATOMG.E.ADD ...`` -> ``ATOMG.E.ADD``)."""
    return re.sub(r"^@!?U?P\w+\s+", "", sass).split(" ")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    recs = read_sass(args.csv)
    samples = sum(r[2] for r in recs) or 1
    executed = sum(r[3] for r in recs) or 1
    by_exec, by_samples = collections.Counter(), collections.Counter()
    for _, sass, s, e in recs:
        by_exec[opcode(sass)] += e
        by_samples[opcode(sass)] += s
    print(f"{len(recs)} instructions, {executed:,} warp-level executions, {samples:,} stall samples\n")
    print("| opcode | % of stall samples | % of executions |\n|---|---|---|")
    for op, s in by_samples.most_common(args.top):
        print(f"| {op} | {100 * s / samples:.1f} | {100 * by_exec[op] / executed:.1f} |")
    print("\n| address offset | SASS | % of stall samples | executions |\n|---|---|---|---|")
    base = recs[0][0] if recs else 0
    for addr, sass, s, e in sorted(recs, key=lambda r: -r[2])[:args.top]:
        print(f"| {addr - base:#x} | `{sass[:70]}` | {100 * s / samples:.2f} | {e:,} |")


if __name__ == "__main__":
    main()
