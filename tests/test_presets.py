"""GPU presets against the SFT memory plan: what they request covers what the plan says they need."""

import os
from pathlib import Path

import pytest

from tasks.memory_plan import memory_plan
from tasks.sft import model_config, preset_sft_config
from tasks.presets import DEVICE_MEMORY_BYTES, get_preset

UNITS = {"Gi": 2**30, "Ti": 2**40, "G": 10**9, "T": 10**12}


def quantity_bytes(q: str) -> int:
    """Kubernetes memory quantity -> bytes (the suffixes the presets use)."""
    for suffix in ("Gi", "Ti", "G", "T"):
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * UNITS[suffix])
    return int(q)


@pytest.mark.parametrize("name", ["b200-64"])
def test_training_requests_cover_the_memory_plan(name):
    p = get_preset(name)
    cfg = preset_sft_config(p)
    res, par = p.train_resources, p.train_parallel
    requested = quantity_bytes(res.mem)
    # Raises MemoryPlanError when a device or the node's requested memory cannot hold the run.
    plan = memory_plan(model_config(cfg), cfg, world_size=par.nnodes * par.nproc_per_node,
                       procs_per_node=par.nproc_per_node, device_limit=DEVICE_MEMORY_BYTES[res.accelerator],
                       host_limit=requested, on_gpu=True)
    assert plan.device_total <= DEVICE_MEMORY_BYTES[res.accelerator]
    # The request is sized from the plan: enough for the pinned host memory, at most 20% above it.
    assert plan.host_total <= requested <= 1.2 * plan.host_total, (plan.host_total / 2**30, requested / 2**30)


def test_main_command_help_has_one_line_per_option_and_the_run_defaults():
    """``pyflyte run ... genome_pipeline --help``: every option documented, no JSON schemas, and
    the defaults it shows are the ones the default run uses."""
    import subprocess
    import sys

    from tasks.presets import active_preset

    pyflyte = Path(sys.executable).with_name("pyflyte")
    out = subprocess.run([str(pyflyte), "run", "workflows/genome_pipeline.py", "genome_pipeline", "--help"],
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, COLUMNS="200")).stdout
    preset = active_preset()
    assert '"properties"' not in out
    expected = {"shard_tokens": preset.data.shard_tokens, "train_seq_len": preset.train_seq_len,
                "sft_steps": preset.sft.steps, "sft_lr": preset.sft.lr, "rl_steps": preset.rl.steps,
                "rl_prompt_len": preset.rl.prompt_len, "rl_gen_len": preset.rl.gen_len}
    for option, value in expected.items():
        (line,) = [line for line in out.splitlines() if f"--{option} " in line]
        assert f"[default: {value}]" in line, line
