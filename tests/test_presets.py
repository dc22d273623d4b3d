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


@pytest.mark.parametrize("name", ["h200", "b200-64"])
def test_verify_and_evaluate_trainer_legs_fit_the_gpus_they_request(name):
    """The trainer's log-prob job is one replica of TP x CP ranks, as many as the task requests
    GPUs; its forward-only plan at the longest window fits each GPU beside verify's engine."""
    from model.config import preset as model_preset
    from tasks.memory_plan import scoring_memory_plan

    p = get_preset(name)
    par, res = p.infer_parallel, p.infer_resources
    assert par.nproc_per_node == res.gpu and par.tensor_parallel * par.context_parallel == par.nnodes * res.gpu
    assert p.evaluate.scorer == "trainer" and p.verify.dtype == "bfloat16"
    device = DEVICE_MEMORY_BYTES[res.accelerator]
    mcfg = model_preset(p.model)
    verify = scoring_memory_plan(mcfg, p, max(p.verify.context_lengths), with_engine=True, device_limit=device,
                                 on_gpu=True)
    evaluate = scoring_memory_plan(mcfg, p, p.eval_seq_len, with_engine=False, device_limit=device, on_gpu=True)
    print(f"{name} verify trainer leg at {max(p.verify.context_lengths):,} tokens:\n{verify.table()}")
    print(f"{name} evaluate trainer scorer at {p.eval_seq_len:,} tokens:\n{evaluate.table()}")
    assert verify.engine == int(device * p.verify.engine_gpu_memory_fraction) and evaluate.engine == 0
    assert verify.device_total <= device and evaluate.device_total <= device


def test_verify_trainer_leg_of_the_full_model_on_one_node_is_refused_before_launch():
    """One node of 8 B200s: 36 experts per GPU (87 GiB of bf16 weights) beside the engine's 55%."""
    import dataclasses

    from model.config import preset as model_preset
    from tasks.memory_plan import MemoryPlanError, scoring_memory_plan

    p = get_preset("b200-64")
    one_node = dict(nnodes=1, nproc_per_node=8, context_parallel=8, expert_parallel=8)
    smaller = dataclasses.replace(p, infer_parallel=dataclasses.replace(p.infer_parallel, **one_node))
    with pytest.raises(MemoryPlanError, match=r"trainer log-probs\): model at seq_len=1048576 .* does not fit"):
        scoring_memory_plan(model_preset(p.model), smaller, 1 << 20, with_engine=True,
                            device_limit=DEVICE_MEMORY_BYTES[p.infer_resources.accelerator], on_gpu=True)


def test_memory_table_reads_a_tiny_part_in_mib_beside_gigabytes():
    """A laptop plan's weights are megabytes beside gigabytes of activations: that row reads in MiB, not 0.00 GiB;
    a zero stays 0.00 GiB."""
    from tasks.memory_plan import device_table

    lines = device_table([("weights", 3 * 2**20), ("activations", 2 * 2**30), ("offload", 0)],
                         2 * 2**30 + 3 * 2**20, 24 * 2**30, 12)
    assert [line.split()[-2:] for line in lines[:3]] == [["3.00", "MiB"], ["2.00", "GiB"], ["0.00", "GiB"]]
    assert lines[3].split()[-5:] == ["2.00", "GiB", "of", "24.00", "GiB"]
    tiny = device_table([("weights", 5 * 2**19)], 5 * 2**19, 24 * 2**30, 12)
    assert tiny[1].split()[-5:] == ["2.50", "MiB", "of", "24.00", "GiB"]
