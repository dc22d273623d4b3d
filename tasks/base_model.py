"""The starting checkpoint of fine-tuning, as a Hugging Face export.

Held-out evaluation compares "before" with "after" fine-tuning, so "before" must be a
checkpoint of its own: either a pretrained GLM-5.3-Flash-layout export (``init_hf``, a
directory or fsspec URI, copied so the output is self-contained) or a model preset of
:mod:`model.config` initialized from ``seed`` (the local and CI presets: there is no
pretrained DNA glm5_next to start from on a laptop). SFT starts from this export.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import fsspec

from tasks.atomic import atomic_output_dir


def base_model(model_preset: str, seed: int, out_dir: str | os.PathLike, init_hf: str = "") -> Path:
    """Write the starting checkpoint to ``out_dir`` (``config.json`` + ``model.safetensors``).

    Args:
        model_preset: ``tiny`` | ``small`` | ``full`` (ignored when ``init_hf`` is given).
        seed: initialization seed of the preset's weights.
        out_dir: output directory (atomic).
        init_hf: pretrained export directory or URI to start from instead ("" = none).

    Raises:
        FileNotFoundError: ``init_hf`` has no ``config.json``.
    """
    with atomic_output_dir(out_dir) as work:
        if init_hf:
            fs, root = fsspec.core.url_to_fs(init_hf)
            if not fs.exists(f"{root}/config.json"):
                raise FileNotFoundError(f"{init_hf}: not a Hugging Face export (no config.json)")
            for path in fs.ls(root, detail=False):
                if path.endswith((".json", ".safetensors")):
                    fs.get_file(path, str(work / Path(path).name))
        else:
            from model.config import preset
            from model.convert import export_metadata, hf_state_dict, save_hf_checkpoint
            from model.glm5_next import build_model

            cfg = preset(model_preset)
            save_hf_checkpoint(hf_state_dict(build_model(cfg, seed=seed, zero_head=True)), cfg, work,
                               export_metadata(model_preset, None))
        (work / "base_model.json").write_text(json.dumps({"model_preset": model_preset, "seed": seed, "init_hf": init_hf}))
    return Path(out_dir)


# ---- Flyte task: resources and cache version only; the logic is base_model() above --------

from flytekit import Cache, task  # noqa: E402

from tasks.caching import HashedDir, as_output, stage_version, requests_for, stage_output_dir  # noqa: E402
from tasks.presets import active_preset  # noqa: E402

BASE_VERSION = stage_version("base_model", active_preset())


@task(cache=Cache(version=BASE_VERSION), requests=requests_for(active_preset().data_resources))
def base_model_task(model_preset: str, seed: int, init_hf: str = "") -> HashedDir:
    """Flyte wrapper of :func:`base_model`."""
    out = stage_output_dir("base_model", BASE_VERSION, model_preset=model_preset, seed=seed, init_hf=init_hf)
    base_model(model_preset, seed, out, init_hf)
    return as_output(out)
