"""Export a megatron distributed checkpoint (SFT's ``latest``/``best`` pointer) to HF format.

The nightly held-out evaluation reads what training left in its checkpoint directory, not a
task output: ``<root>/latest`` names the newest complete ``step-NNNNNNN`` torch_dist
checkpoint and ``<root>/model_config.json`` the model (HF ``config.json`` of the run). The
model part alone is loaded at world size 1 (torch_dist checkpoints reshard: a TP/CP/EP run
loads into one process) and written as a GLM-5.3-Flash-layout export that the engines and
the evaluate stage read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tasks.atomic import atomic_output_dir


class ExportError(FileNotFoundError):
    """The checkpoint directory has no such pointer, checkpoint or model config."""


def resolve_pointer(checkpoint_root: str | os.PathLike, pointer: str = "latest") -> Path:
    """The checkpoint directory ``<root>/<pointer>`` names.

    Raises:
        ExportError: the pointer or the checkpoint it names is missing.
    """
    root = Path(checkpoint_root)
    if not (root / pointer).exists():
        present = sorted(p.name for p in root.iterdir()) if root.is_dir() else "no such directory"
        raise ExportError(f"{root}: no {pointer!r} pointer (present: {present})")
    target = root / (root / pointer).read_text().strip()
    if not target.is_dir():
        raise ExportError(f"{root / pointer} names {target.name}, which does not exist")
    return target


def export_checkpoint(checkpoint_root: str | os.PathLike, out_dir: str | os.PathLike, pointer: str = "latest",
                      preset: str = "") -> Path:
    """Write the HF export of checkpoint ``<root>/<pointer>`` to ``out_dir`` (atomic).

    Raises:
        ExportError: missing pointer, checkpoint or ``model_config.json``.
    """
    from megatron.core import dist_checkpointing

    from model.config import from_hf
    from model.convert import export_metadata, hf_state_dict, save_hf_checkpoint
    from model.glm5_next import build_model
    from tasks.sft import _model_sharded_state_dict

    root = Path(checkpoint_root)
    checkpoint = resolve_pointer(root, pointer)
    config_path = root / "model_config.json"
    if not config_path.exists():
        raise ExportError(f"{root}: no model_config.json (written by tasks.sft at the first checkpoint)")
    hf_config = json.loads(config_path.read_text())
    mcfg = from_hf(hf_config, tensor_model_parallel_size=1, context_parallel_size=1, expert_model_parallel_size=1,
                   expert_tensor_parallel_size=1)
    module = build_model(mcfg)
    loaded = dist_checkpointing.load({"model": _model_sharded_state_dict(module)}, str(checkpoint))
    module.load_state_dict(loaded["model"], strict=False)
    with atomic_output_dir(out_dir) as work:
        meta = export_metadata(preset, None) | {"megabase_checkpoint": str(checkpoint)}
        save_hf_checkpoint(hf_state_dict(module), mcfg, work, meta, vision_config=hf_config.get("vision_config"))
    return Path(out_dir)


# ---- Flyte task: resources only; the logic is export_checkpoint() above -------------------

from flytekit import task  # noqa: E402

from workflows.caching import HashedDir, as_output, resource_kwargs, stage_output_dir  # noqa: E402
from workflows.presets import active_preset  # noqa: E402


@task(**resource_kwargs(active_preset().infer_resources))
def export_checkpoint_task(checkpoint_root: str, pointer: str = "latest") -> HashedDir:
    """Flyte wrapper of :func:`export_checkpoint`. Never cached: the pointer moves; the
    evaluation downstream is cached on the export's content instead."""
    target = resolve_pointer(checkpoint_root, pointer)
    out = stage_output_dir("export", "v1", checkpoint=str(target))
    export_checkpoint(checkpoint_root, out, pointer, active_preset().name)
    return as_output(out)
