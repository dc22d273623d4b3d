"""Check the report the README's main command printed (CI's last step).

    python scripts/check_report.py REPORT.txt

The report is the pipeline's stdout (``workflows.genome_pipeline.report``). It passes when it
has exactly one held-out line for each of the base, SFT and RL checkpoints, at least one baseline
line, and at least one verify line, every one of them ``passed``. Exit status 0 when it passes,
1 with one line per problem otherwise.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

CHECKPOINTS = ("base", "sft", "rl")
CHECKPOINT_LINE = re.compile(r"^\s*(?P<label>\w+)\s+overall (?P<bits>\d+\.\d+)\b")
BASELINE_LINE = re.compile(r"^\s*baseline (?P<name>\S+) .*overall (?P<bits>\d+\.\d+)")
VERIFY_LINE = re.compile(r"^verify (?P<pair>.+?) @ prior context (?P<context>\[[^)]+\)): .*\((?P<verdict>passed|FAILED)\)$")


def problems(report: str) -> list[str]:
    """Every way ``report`` falls short of the checks above (empty: it passes)."""
    lines = report.splitlines()
    found: list[str] = []
    labels = [m["label"] for m in map(CHECKPOINT_LINE.match, lines) if m]
    for label in CHECKPOINTS:
        if labels.count(label) != 1:
            found.append(f"expected one held-out line for {label!r}, found {labels.count(label)}")
    if not any(BASELINE_LINE.match(line) for line in lines):
        found.append("no baseline line ('baseline <name> ... overall <bits>')")
    verify = [m for m in map(VERIFY_LINE.match, lines) if m]
    if not verify:
        found.append("no verify line ('verify <pair> @ prior context [lo, hi): ... (passed)')")
    found += [f"verify {m['pair']} @ prior context {m['context']}: FAILED" for m in verify if m["verdict"] != "passed"]
    return found


def main(argv: list[str]) -> int:
    if argv in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if len(argv) != 1:
        print("usage: " + __doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    path = Path(argv[0])
    if not path.is_file():
        print(f"report check: {path}: no such file (give the file holding the pipeline's stdout)", file=sys.stderr)
        return 2
    found = problems(path.read_text())
    for problem in found:
        print(f"report check: {problem}", file=sys.stderr)
    if not found:
        print("report check: passed (base, sft, rl, baseline and verify lines present; every verify line passed)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
