"""A failed run reads as one paragraph on stderr (stage, cause, advice), the traceback in a log file,
and stdout keeps only pyflyte's first line: through the real ``pyflyte run`` on a missing FASTA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tasks.failures import cause_text, failed_stage, report_failure, root_cause

ROOT = Path(__file__).resolve().parents[1]


class GenomeInputError(ValueError):
    """Stands for the project error (its module is set below to look like the project's)."""


GenomeInputError.__module__ = "tasks.ingest"


def chained_failure() -> Exception:
    try:
        try:
            raise GenomeInputError("/data/g.fa, record chr1, line 3: 'U' is RNA; expected A/C/G/T/N")
        except GenomeInputError as inner:
            raise RuntimeError("Error encountered while executing 'tasks.ingest.ingest_task':\n  wrapped") from inner
    except RuntimeError as outer:
        return outer


def test_the_paragraph_names_stage_cause_and_advice_and_the_log_holds_the_chain(tmp_path, capsys):
    error = chained_failure()
    assert failed_stage(error) == "ingest" and type(root_cause(error)) is GenomeInputError
    log = report_failure(error, log_dir=tmp_path)
    err = capsys.readouterr().err
    assert "the ingest stage failed" in err and "cause: GenomeInputError: /data/g.fa, record chr1, line 3" in err
    assert "what to do: fix the input" in err and str(log) in err
    text = log.read_text()
    assert "Traceback" in text and "GenomeInputError" in text and "RuntimeError" in text


def test_a_worker_traceback_in_a_message_is_cut_to_its_error_line():
    worker = RuntimeError("\n".join(["Traceback (most recent call last):", '  File "x.py", line 1', "    f()",
                                     "  File \"y.py\", line 2", "tasks.rl.RLError: step 3: loss is nan", ""]))
    assert cause_text(worker) == ("RLError", "step 3: loss is nan")


def test_pyflyte_run_failure_keeps_stdout_for_the_report(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path / "home"), MEGABASE_HOME=str(tmp_path / "megabase"))
    (tmp_path / "home").mkdir()
    pyflyte = Path(sys.executable).with_name("pyflyte")
    run = subprocess.run([str(pyflyte), "run", "workflows/genome_pipeline.py", "prepare_data", "--fasta",
                          f'["{tmp_path}/missing.fa"]', "--train", '["chr1"]'], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 1
    assert run.stdout.strip() == "Running Execution on local.", run.stdout
    assert "megabase: the ingest stage failed." in run.stderr and "missing.fa: no such file" in run.stderr
    (log,) = (tmp_path / "megabase" / "logs").glob("failure-*.log")
    assert "GenomeInputError" in log.read_text()
    assert not (tmp_path / "megabase" / "outputs").exists() or not any((tmp_path / "megabase" / "outputs").rglob("*.json"))
