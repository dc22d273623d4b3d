"""CI's check of the main command's report (scripts/check_report.py), on reports written here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("check_report", Path(__file__).parents[1] / "scripts/check_report.py")
check_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_report)

GOOD = """Running Execution on local.
megabase local-cpu: held-out evaluation /x/evaluate.json
  verify report /x/verify.json
held-out bits/base by prior-context bucket:
   base  overall 4.000  [0, 1,024): 4.000
    sft  overall 1.998  [0, 1,024): 1.896
     rl  overall 1.997  [0, 1,024): 1.895
  baseline markov-12 (fit on the train split; k=12 chosen on a validation split of the training chromosomes, add-one smoothing): overall 1.634
    its validation bits/base by k: 2: 1.906, 3: 1.902, 12: 1.815
verify legs: trainer = megatron; engine = vllm
verify trainer vs engine @ prior context [0, 1k): mean |diff| 1.00e-06 p99 2.00e-06 max 3.00e-06 (passed)
verify trainer vs engine @ prior context [8k, 16k): mean |diff| 1.00e-06 p99 2.00e-06 max 3.00e-06 (passed)
"""


def test_a_complete_report_passes():
    assert check_report.problems(GOOD) == []


@pytest.mark.parametrize("edit, problem", [
    (lambda r: r.replace("     rl  overall 1.997  [0, 1,024): 1.895\n", ""), "one held-out line for 'rl', found 0"),
    (lambda r: "\n".join(line for line in r.splitlines() if "baseline" not in line), "no baseline line"),
    (lambda r: r.replace("[8k, 16k): mean |diff| 1.00e-06 p99 2.00e-06 max 3.00e-06 (passed)",
                         "[8k, 16k): mean |diff| 1.00e-01 p99 2.00e-01 max 3.00e-01 (FAILED)"),
     "verify trainer vs engine @ prior context [8k, 16k): FAILED"),
    (lambda r: "\n".join(line for line in r.splitlines() if not line.startswith("verify trainer")), "no verify line"),
    (lambda r: "", "one held-out line for 'base', found 0"),
])
def test_a_report_missing_a_part_fails_naming_it(edit, problem):
    assert problem in " | ".join(check_report.problems(edit(GOOD)))


def test_exit_status(tmp_path):
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text(GOOD)
    bad.write_text(GOOD.replace("(passed)", "(FAILED)"))
    assert check_report.main([str(good)]) == 0
    assert check_report.main([str(bad)]) == 1
