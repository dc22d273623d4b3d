"""`pyflyte package` (offline) serializes the workflow for a B200 cluster: decoded protobufs."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from flyteidl.admin import launch_plan_pb2, task_pb2
from google.protobuf import json_format

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def b200_package(tmp_path_factory):
    out = tmp_path_factory.mktemp("package")
    env = dict(os.environ, MEGABASE_PRESET="b200-64", MEGABASE_CHECKPOINT_ROOT="/mnt/checkpoints/megabase",
               MEGABASE_HELDOUT_SHARDS="s3://megabase/shards/hg38")
    pyflyte = Path(sys.executable).with_name("pyflyte")
    subprocess.run([str(pyflyte), "--pkgs", "workflows", "package", "--image", "megabase-gpu:test", "-f",
                    "-o", str(out / "pkg.tgz")], cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    with tarfile.open(out / "pkg.tgz") as tar:
        # the "data" filter exists from Python 3.11.4 (Debian 12's python3 is 3.11.2)
        tar.extractall(out / "pkg", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return out / "pkg"


def task_template(pkg: Path, name: str):
    (path,) = pkg.glob(f"*_{name}_1.pb")
    spec = task_pb2.TaskSpec()
    spec.ParseFromString(path.read_bytes())
    return spec.template


def requests(template) -> dict[str, str]:
    names = {1: "cpu", 2: "gpu", 3: "memory"}
    return {names.get(r.name, str(r.name)): r.value for r in template.container.resources.requests}


@pytest.mark.parametrize("name", ["tasks.sft.sft_task", "tasks.rl.rl_task"])
def test_training_tasks_request_b200_nodes(b200_package, name):
    template = task_template(b200_package, name)
    assert requests(template)["gpu"] == "8"
    assert template.extended_resources.gpu_accelerator.device == "nvidia-b200"
    assert template.extended_resources.shared_memory.size_limit == "256Gi"
    assert template.metadata.discoverable and template.metadata.discovery_version


@pytest.mark.parametrize("name", ["tasks.sft.sft_task", "tasks.rl.rl_task"])
def test_training_is_an_elastic_pytorch_job_of_8_nodes_x_8_gpus(b200_package, name):
    template = task_template(b200_package, name)
    assert template.type == "pytorch"
    job = json_format.MessageToDict(template.custom)
    assert job["workerReplicas"]["replicas"] == 8
    assert job["elasticConfig"]["nprocPerNode"] == 8
    assert job["elasticConfig"]["minReplicas"] == job["elasticConfig"]["maxReplicas"] == 8


@pytest.mark.parametrize("name", ["tasks.ingest.ingest_task", "tasks.pack.pack_task"])
def test_data_stages_request_no_gpu_and_are_cached(b200_package, name):
    template = task_template(b200_package, name)
    assert "gpu" not in requests(template)
    assert not template.extended_resources.HasField("gpu_accelerator")
    assert template.metadata.discoverable


@pytest.mark.parametrize("name", ["tasks.verify.verify_task", "tasks.evaluate.evaluate_task"])
def test_inference_stages_are_elastic_jobs_of_the_trainer_layout(b200_package, name):
    """verify's trainer leg and evaluate's trainer scorer: 8 replicas x 8 GPUs, every GPU a rank
    (CP=64 x EP=32, tasks/presets.py infer_parallel)."""
    template = task_template(b200_package, name)
    assert requests(template)["gpu"] == "8"
    assert template.extended_resources.gpu_accelerator.device == "nvidia-b200"
    assert template.type == "pytorch"
    job = json_format.MessageToDict(template.custom)
    assert job["workerReplicas"]["replicas"] == 8
    assert job["elasticConfig"]["nprocPerNode"] == 8
    assert job["elasticConfig"]["minReplicas"] == job["elasticConfig"]["maxReplicas"] == 8


def test_nightly_launch_plan_carries_its_cron_schedule_and_inputs(b200_package):
    (path,) = b200_package.glob("*_nightly_heldout_eval_*.pb")
    plan = launch_plan_pb2.LaunchPlan()
    plan.ParseFromString(path.read_bytes())
    assert plan.spec.entity_metadata.schedule.cron_schedule.schedule == "0 2 * * *"
    fixed = {k: v.scalar.primitive.string_value for k, v in plan.spec.fixed_inputs.literals.items()}
    assert fixed == {"checkpoint_root": "/mnt/checkpoints/megabase", "shards_uri": "s3://megabase/shards/hg38",
                     "pointer": "latest"}
