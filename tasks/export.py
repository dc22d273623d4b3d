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


POINTERS = ("latest", "best")
"""The pointer files a training run keeps in its checkpoint directory (``tasks.checkpoint.Checkpointer``)."""


class ExportError(FileNotFoundError):
    """The checkpoint directory has no such pointer, checkpoint or model config."""


def resolve_pointer(checkpoint_root: str | os.PathLike, pointer: str = "latest") -> tuple[Path, Path]:
    """The training run and the checkpoint ``pointer`` names under ``checkpoint_root``.

    ``checkpoint_root`` is one run's checkpoint directory (it holds the pointer), or the base
    directory the runs share (``$MEGABASE_HOME/checkpoints``, a preset's ``checkpoint_uri``),
    which holds one directory per run key: then, of the runs that hold the pointer and a
    ``model_config.json`` (SFT runs), the one whose pointer was written last is taken, so a
    schedule with fixed inputs follows the newest training run.

    Returns:
        ``(run_dir, checkpoint_dir)``: the run's directory (``model_config.json``) and the
        ``step-NNNNNNN`` checkpoint inside it.

    Raises:
        ExportError: an unknown pointer name, no run holding the pointer, or a pointer naming a
            checkpoint that is missing or outside its run.
    """
    from tasks.atomic import OutputIntegrityError, resolve_inside

    if pointer not in POINTERS:
        raise ExportError(f"pointer {pointer!r}: choose one of {', '.join(POINTERS)}")
    root = Path(checkpoint_root)
    if not root.is_dir():
        raise ExportError(f"{root}: no such checkpoint directory")
    run = root
    if not (root / pointer).is_file():
        runs = [d for d in root.iterdir() if (d / pointer).is_file() and (d / "model_config.json").is_file()]
        if not runs:
            present = sorted(p.name for p in root.iterdir())
            raise ExportError(f"{root}: no {pointer!r} pointer, here or in a run directory below it "
                              f"(present: {present})")
        run = max(runs, key=lambda d: ((d / pointer).stat().st_mtime_ns, d.name))
    try:
        target = resolve_inside(run, (run / pointer).read_text().strip())
    except OutputIntegrityError as err:
        raise ExportError(str(err)) from None
    if not target.is_dir():
        raise ExportError(f"{run / pointer} names {target.name}, which does not exist")
    return run, target


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
    from tasks.checkpoint import model_sharded_state_dict

    root, checkpoint = resolve_pointer(checkpoint_root, pointer)
    config_path = root / "model_config.json"
    if not config_path.exists():
        raise ExportError(f"{root}: no model_config.json (written by tasks.sft at the first checkpoint)")
    hf_config = json.loads(config_path.read_text())
    mcfg = from_hf(hf_config, tensor_model_parallel_size=1, context_parallel_size=1, expert_model_parallel_size=1,
                   expert_tensor_parallel_size=1)
    module = build_model(mcfg)
    loaded = dist_checkpointing.load({"model": model_sharded_state_dict(module)}, str(checkpoint))
    module.load_state_dict(loaded["model"], strict=False)
    with atomic_output_dir(out_dir) as work:
        meta = export_metadata(preset, None) | {"megabase_checkpoint": str(checkpoint)}
        save_hf_checkpoint(hf_state_dict(module), mcfg, work, meta, vision_config=hf_config.get("vision_config"))
    return Path(out_dir)


# ---- Flyte task: resources only; the logic is export_checkpoint() above -------------------

from flytekit import task  # noqa: E402

from tasks.caching import HashedDir, as_output, resource_kwargs, stage_output_dir, stage_version  # noqa: E402
from tasks.presets import active_preset  # noqa: E402

EXPORT_VERSION = stage_version("export", active_preset())


@task(**resource_kwargs(active_preset().infer_resources))
def export_checkpoint_task(checkpoint_root: str, pointer: str = "latest") -> HashedDir:
    """Flyte wrapper of :func:`export_checkpoint`. Never cached: the pointer moves; the
    evaluation downstream is cached on the export's content instead."""
    _, target = resolve_pointer(checkpoint_root, pointer)
    out = stage_output_dir("export", EXPORT_VERSION, checkpoint=str(target))
    export_checkpoint(checkpoint_root, out, pointer, active_preset().name)
    return as_output(out)
