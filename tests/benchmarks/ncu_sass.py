"""Where a kernel's time goes, from Nsight Compute's SASS table (``tests/gpu/ncu_indexer.sh``'s ``ncu_<i>.sass.csv``).

    python tests/benchmarks/ncu_sass.py ncu_1.sass.csv [--top 12] [--reasons]

Reads the per-instruction columns ``Instructions Executed`` (warp-level) and ``Warp Stall Sampling (All
Samples)`` (where warps were when sampled: the time) and prints, as markdown tables, the opcodes with the
largest shares of both, and the hottest instructions by stall samples with the opcode that stalls there (a
consumer waits on its producer: a ``SHFL.IDX`` after an ``ATOMG`` carries the atomic's latency). ``--reasons``
adds the stall reasons (``stall_*`` columns: dispatch, long scoreboard, ...), each with the opcodes it hit.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re


def _instruction_rows(path: str) -> tuple[list[str], list[list[str]]]:
    """The header and the per-instruction rows of an ncu ``--page source --csv`` export.

    Raises:
        ValueError: the file has no ``Source`` / ``Instructions Executed`` columns (not such an export).
    """
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next((i for i, r in enumerate(rows) if "Source" in r and "Instructions Executed" in r), None)
    if header_at is None:
        raise ValueError(f"{path}: no 'Source' and 'Instructions Executed' columns (ncu --page source --csv)")
    header = rows[header_at]
    return header, [r for r in rows[header_at + 1:] if len(r) >= len(header) and r[0].startswith("0x")]


def read_sass(path: str) -> list[tuple[int, str, int, int]]:
    """``(address, SASS text, stall samples, warp-level executions)`` per instruction of the csv at ``path``.

    Raises:
        ValueError: the file has no ``Source`` / sampling / execution columns (not a ``--page source --csv`` export).
    """
    header, rows = _instruction_rows(path)
    i_src, i_exec = header.index("Source"), header.index("Instructions Executed")
    i_samples = header.index("Warp Stall Sampling (All Samples)")
    return [(int(r[0], 16), r[i_src].strip(), int(r[i_samples] or 0), int(r[i_exec] or 0)) for r in rows]


def stall_reasons(path: str) -> dict[str, collections.Counter]:
    """Stall samples per reason (the ``stall_*`` columns, issued and not issued together), each a counter of the
    opcodes the sampled warps were at (``opcode -> samples``)."""
    header, rows = _instruction_rows(path)
    i_src = header.index("Source")
    columns = [(i, n) for i, n in enumerate(header) if n.startswith("stall_") and "Not Issued" not in n]
    out = {n: collections.Counter() for _, n in columns}
    for r in rows:
        op = opcode(r[i_src].strip())
        for i, n in columns:
            out[n][op] += int(r[i] or 0)
    return out


def opcode(sass: str) -> str:
    """The opcode of one SASS line, without its predicate (``@!P0 ATOMG.E.ADD ...`` -> ``ATOMG.E.ADD``)."""
    return re.sub(r"^@!?U?P\w+\s+", "", sass).split(" ")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--reasons", action="store_true", help="also the stall reasons, each with its top opcodes")
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
    if args.reasons:
        reasons = stall_reasons(args.csv)
        total = sum(sum(c.values()) for c in reasons.values()) or 1
        print("\n| stall reason | % of samples | top opcodes (points) |\n|---|---|---|")
        for name, ops in sorted(reasons.items(), key=lambda kv: -sum(kv[1].values()))[:args.top]:
            top = ", ".join(f"{op} {100 * v / total:.1f}" for op, v in ops.most_common(5))
            print(f"| {name} | {100 * sum(ops.values()) / total:.1f} | {top} |")


if __name__ == "__main__":
    main()
