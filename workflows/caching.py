"""Content-addressed caching for Flyte stages.

Three rules make a cache hit mean "same bytes in, same code": 

1. **Cache version from code.** :func:`code_version` hashes the source of the modules a stage
   runs (its own module and the project modules it uses), so editing a stage invalidates it
   and everything downstream (their inputs' hashes change with its outputs).
2. **Cache key from content, not paths.** Stage outputs are directories annotated with
   :data:`HashedDir`: their Flyte literal carries :func:`directory_sha256` (the sha256 of the
   directory's ``manifest.json``, which lists the sha256 of every file the stage wrote, or of
   all its files), so downstream keys depend on content. Raw FASTA inputs are fingerprinted by content before ingest
   (``tasks.ingest.fingerprint_sources``); a renamed identical file hits.
3. **Local outputs outlive the run.** A local execution writes each stage's output under
   ``$MEGABASE_HOME/outputs/<stage>/<key>`` (default ``~/.megabase``), a path derived from
   the cache version and the inputs' content, and returns it without copying into Flyte's
   temporary raw-data directory, so a later cache hit never points at a deleted temp path.
   On a cluster the directory is uploaded to the configured blob store as usual.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Annotated

from flytekit import FlyteContextManager, Resources
from flytekit.core.hash import HashMethod
from flytekit.types.directory import FlyteDirectory

from workflows import presets

REPO_ROOT = Path(__file__).resolve().parents[1]


def code_version(*sources: str, salt: str = "") -> str:
    """Short sha256 of project source files; a directory stands for every ``*.py`` under it.

    Args:
        sources: paths relative to the repo root (``"tasks/pack.py"``, ``"model"``).
        salt: extra text mixed in.

    Raises:
        FileNotFoundError: a listed source does not exist (a typo would silently freeze caches).
    """
    files: set[str] = set()
    for source in sources:
        path = REPO_ROOT / source
        if path.is_dir():
            files.update(p.relative_to(REPO_ROOT).as_posix() for p in path.rglob("*.py"))
        elif path.is_file():
            files.add(source)
        else:
            raise FileNotFoundError(f"code_version: {path} does not exist")
    digest = hashlib.sha256(salt.encode())
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + (REPO_ROOT / name).read_bytes())
    return digest.hexdigest()[:16]


def directory_sha256(path: str | os.PathLike) -> str:
    """Content hash of a stage output directory.

    Its ``manifest.json`` when there is one (ingest, pack and SFT manifests list the sha256 of
    every file they wrote, so shards are not re-read); otherwise sha256 over every file's
    relative path and bytes, in sorted order.
    """
    root = Path(path)
    manifest = root / "manifest.json"
    if manifest.exists():
        return hashlib.sha256(manifest.read_bytes()).hexdigest()
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(file.relative_to(root).as_posix().encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def manifest_sha256(directory: FlyteDirectory) -> str:
    """Content hash of a stage output (a FlyteDirectory): :func:`directory_sha256` of its path."""
    return directory_sha256(directory.path)


def hf_export(path: str | os.PathLike) -> Path:
    """The Hugging Face export inside a checkpoint-producing stage's output (``hf/``), or ``path``
    itself when it is an export: a ``config.json`` with a ``model_type``.

    Raises:
        FileNotFoundError: neither ``path/hf/config.json`` nor ``path/config.json`` is an HF config.
    """
    root = Path(path)
    for candidate in (root / "hf", root):
        config = candidate / "config.json"
        if config.exists() and "model_type" in json.loads(config.read_text()):
            return candidate
    raise FileNotFoundError(f"{root}: no Hugging Face export (config.json with a model_type) here or in hf/")


HashedDir = Annotated[FlyteDirectory, HashMethod(manifest_sha256)]


def megabase_home() -> Path:
    """Root of persistent local outputs: ``$MEGABASE_HOME`` or ``~/.megabase``."""
    return Path(os.environ.get("MEGABASE_HOME", Path.home() / ".megabase")).expanduser()


def is_local_execution() -> bool:
    """True inside ``pyflyte run`` without ``--remote`` (and in tests calling workflows).

    Inside kfpytorch Elastic workers the execution mode is not "local" even in a local run,
    so the raw-output prefix decides too: a local filesystem path means a local run.
    """
    ctx = FlyteContextManager.current_context()
    state = ctx.execution_state
    if state is not None and state.mode is not None and state.is_local_execution():
        return True
    prefix = str(ctx.file_access.raw_output_prefix or "")
    return "://" not in prefix or prefix.startswith("file://")


def _run_key(version: str, identity: dict) -> str:
    """20 hex digits of SHA-256 over a stage's cache version and identity (inputs, config)."""
    return hashlib.sha256(json.dumps([version, identity], sort_keys=True, default=str).encode()).hexdigest()[:20]


def stage_output_dir(stage: str, version: str, **identity) -> Path:
    """Where a stage writes: persistent and content-addressed locally, a fresh temp dir remotely.

    Args:
        stage: stage name, e.g. "ingest".
        version: the stage's cache version.
        identity: JSON-serializable values that determine the output (input hashes, config).
    """
    if not is_local_execution():
        out = Path(tempfile.mkdtemp(prefix=f"megabase-{stage}-"))
    else:
        out = megabase_home() / "outputs" / stage / _run_key(version, identity)
    if os.environ.get("RANK", "0") == "0":      # once per job, not once per Elastic worker
        logging.getLogger("megabase.workflow").info("stage %s: running, output %s", stage, out)
    return out


def run_checkpoint_dir(base_uri: str, version: str, **identity) -> str:
    """The checkpoint directory of one training run: ``<base_uri or $MEGABASE_HOME/checkpoints>/<key>``.

    ``key`` hashes the stage's cache version and ``identity`` (input hashes, config), so every
    worker of the job derives the same path (on a cluster ``base_uri`` must be a shared mount)
    and a restarted run finds its own ``latest`` checkpoint, never another run's.
    """
    key = _run_key(version, identity)
    if not base_uri:
        return str(megabase_home() / "checkpoints" / key)
    base = base_uri.rstrip("/")
    return base if base.endswith(key) else f"{base}/{key}"


def shared_kernel_cache(checkpoint_dir: str, on_gpu: bool | None = None) -> str | None:
    """Point Triton's kernel and autotuning caches at ``<checkpoint_dir>/../triton-cache`` on GPU workers.

    A cold GPU worker spends minutes compiling and autotuning the fla KDA and DSA kernels before
    its first step (242-296 s measured on an H200, 65 s with a warm cache, ``kernels/NOTES.md at fee4dc9``);
    an Elastic restart or the next run would pay it again. Under the checkpoint root (a shared
    mount on a cluster) every worker and every later run reuses them: Triton keys its entries
    by source, GPU architecture and versions and writes them atomically. Leaves an existing
    ``TRITON_CACHE_DIR`` alone; does nothing without CUDA (``on_gpu`` overrides the check).
    Returns the cache directory set, or None.
    """
    import torch

    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    if not on_gpu or os.environ.get("TRITON_CACHE_DIR"):
        return None
    cache = str(Path(checkpoint_dir).parent / "triton-cache")
    os.environ["TRITON_CACHE_DIR"] = cache
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    return cache


def as_output(path: Path) -> FlyteDirectory:
    """Return a stage's output directory: kept in place locally, uploaded on a cluster."""
    if is_local_execution():
        return FlyteDirectory(str(path), remote_directory=False)
    return FlyteDirectory(str(path))


def requests_for(resources: presets.Resources) -> Resources:
    """Flyte resource requests of a preset's :class:`workflows.presets.Resources`."""
    return Resources(cpu=resources.cpu, mem=resources.mem, gpu=str(resources.gpu) if resources.gpu else None)


def resource_kwargs(resources: presets.Resources) -> dict:
    """``@task`` keyword arguments for a preset's resources: requests, GPU accelerator, /dev/shm."""
    from flytekit.extras.accelerators import GPUAccelerator

    return dict(
        requests=requests_for(resources),
        accelerator=GPUAccelerator(resources.accelerator) if resources.accelerator else None,
        shared_memory=resources.shared_memory or False,
    )
