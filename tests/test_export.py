"""tasks/export.py: which checkpoint a pointer names (a run's directory, or the newest run under a
base directory) and refused pointers; the export itself runs in tests/test_pipeline_e2e.py (the nightly plan)."""

from __future__ import annotations

import os

import pytest

from tasks.export import ExportError, resolve_pointer


def make_run(base, key: str, step: str, pointer: str = "latest", mtime: int | None = None, sft: bool = True):
    run = base / key
    (run / step).mkdir(parents=True)
    (run / pointer).write_text(step + "\n")
    if sft:
        (run / "model_config.json").write_text("{}")
    if mtime is not None:
        os.utime(run / pointer, ns=(mtime, mtime))
    return run


def test_a_run_directory_names_its_own_checkpoint(tmp_path):
    run = make_run(tmp_path, "run-a", "step-0000008")
    assert resolve_pointer(run) == (run, run / "step-0000008")


def test_a_base_directory_resolves_the_run_whose_pointer_was_written_last(tmp_path):
    make_run(tmp_path, "old", "step-0000024", mtime=1_000_000_000)
    new = make_run(tmp_path, "new", "step-0000008", mtime=2_000_000_000)
    make_run(tmp_path, "rl-run", "step-0000002", mtime=3_000_000_000, sft=False)   # RL: no model config
    assert resolve_pointer(tmp_path) == (new, new / "step-0000008")


def test_best_pointer_and_unknown_pointers(tmp_path):
    run = make_run(tmp_path, "run", "step-0000016", pointer="best")
    assert resolve_pointer(run, "best")[1] == run / "step-0000016"
    with pytest.raises(ExportError, match="no 'latest' pointer"):
        resolve_pointer(run, "latest")
    with pytest.raises(ExportError, match="pointer 'model_config.json': choose one of latest, best"):
        resolve_pointer(run, "model_config.json")


def test_a_pointer_outside_its_run_or_to_nothing_is_refused(tmp_path):
    run = make_run(tmp_path, "run", "step-0000008")
    (tmp_path / "elsewhere").mkdir()
    (run / "latest").write_text("../elsewhere")
    with pytest.raises(ExportError, match="outside"):
        resolve_pointer(run)
    (run / "latest").write_text("step-0000099")
    with pytest.raises(ExportError, match="names step-0000099, which does not exist"):
        resolve_pointer(run)
    with pytest.raises(ExportError, match="no such checkpoint directory"):
        resolve_pointer(tmp_path / "missing")
    with pytest.raises(ExportError, match=r"present: \['x'\]"):
        (tmp_path / "empty" / "x").mkdir(parents=True)
        resolve_pointer(tmp_path / "empty")


def test_registering_the_nightly_plan_without_heldout_shards_is_refused(monkeypatch):
    from workflows import genome_pipeline

    monkeypatch.delenv("MEGABASE_HELDOUT_SHARDS", raising=False)
    with pytest.raises(ValueError, match="set MEGABASE_HELDOUT_SHARDS"):
        genome_pipeline.nightly_fixed_inputs(["/venv/bin/pyflyte", "register", "workflows"])
    assert genome_pipeline.nightly_fixed_inputs(["/venv/bin/pyflyte", "run", "x.py"])["shards_uri"] == ""
    monkeypatch.setenv("MEGABASE_HELDOUT_SHARDS", "s3://bucket/pack")
    assert genome_pipeline.nightly_fixed_inputs(["pyflyte", "package"])["shards_uri"] == "s3://bucket/pack"
