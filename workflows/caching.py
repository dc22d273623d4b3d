"""Content-addressed caching for Flyte stages.

Three rules make a cache hit mean "same bytes in, same code": 

1. **Cache version from code.** :func:`code_version` hashes the source of the modules a stage
   runs (its own module and the project modules it uses), so editing a stage invalidates it
   and everything downstream (their inputs' hashes change with its outputs).
2. **Cache key from content, not paths.** Stage outputs are directories annotated with
   :data:`HashedDir`: their Flyte literal carries the sha256 of the directory's
   ``manifest.json`` (which lists the sha256 of every file the stage wrote), so downstream
   keys depend on content. Raw FASTA inputs are fingerprinted by content before ingest
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
import os
import tempfile
from pathlib import Path
from typing import Annotated

from flytekit import FlyteContextManager, Resources
from flytekit.core.hash import HashMethod
from flytekit.types.directory import FlyteDirectory

from workflows import presets

REPO_ROOT = Path(__file__).resolve().parents[1]


def code_version(*modules: str, salt: str = "") -> str:
    """Short sha256 of the given project source files (paths relative to the repo root).

    Raises:
        FileNotFoundError: a listed module does not exist (a typo would silently freeze caches).
    """
    digest = hashlib.sha256(salt.encode())
    for module in sorted(modules):
        path = REPO_ROOT / module
        digest.update(module.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def manifest_sha256(directory: FlyteDirectory) -> str:
    """Content hash of a stage output: sha256 of its ``manifest.json``."""
    return hashlib.sha256((Path(directory.path) / "manifest.json").read_bytes()).hexdigest()


HashedDir = Annotated[FlyteDirectory, HashMethod(manifest_sha256)]


def megabase_home() -> Path:
    """Root of persistent local outputs: ``$MEGABASE_HOME`` or ``~/.megabase``."""
    return Path(os.environ.get("MEGABASE_HOME", Path.home() / ".megabase")).expanduser()


def is_local_execution() -> bool:
    """True inside ``pyflyte run`` without ``--remote`` (and in tests calling workflows)."""
    state = FlyteContextManager.current_context().execution_state
    return state is not None and state.mode is not None and state.is_local_execution()


def stage_output_dir(stage: str, version: str, **identity) -> Path:
    """Where a stage writes: persistent and content-addressed locally, a fresh temp dir remotely.

    Args:
        stage: stage name, e.g. "ingest".
        version: the stage's cache version.
        identity: JSON-serializable values that determine the output (input hashes, config).
    """
    if not is_local_execution():
        return Path(tempfile.mkdtemp(prefix=f"megabase-{stage}-"))
    key = hashlib.sha256(json.dumps([version, identity], sort_keys=True, default=str).encode()).hexdigest()[:20]
    return megabase_home() / "outputs" / stage / key


def as_output(path: Path) -> FlyteDirectory:
    """Return a stage's output directory: kept in place locally, uploaded on a cluster."""
    if is_local_execution():
        return FlyteDirectory(str(path), remote_directory=False)
    return FlyteDirectory(str(path))


def requests_for(resources: presets.Resources) -> Resources:
    """Flyte resource requests of a preset's :class:`workflows.presets.Resources`."""
    return Resources(cpu=resources.cpu, mem=resources.mem, gpu=str(resources.gpu) if resources.gpu else None)
