"""All-or-nothing stage outputs, and the checks a stage makes before it trusts another's.

A stage that fails (bad input, a killed process) must never leave a half-written shard or
manifest where a later stage, or a Flyte cache hit, would read it. Every stage writes its
whole output directory through :func:`atomic_output_dir`. A stage reading another's output
resolves every path a manifest or pointer names with :func:`resolve_inside`, so a crafted or
damaged file cannot make it read or write outside that output.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


class OutputIntegrityError(ValueError):
    """A stage output does not match what its writer recorded: a path that leaves its root, a
    missing file, a sha256 that differs from the manifest. The message names the file."""


def resolve_inside(root: str | os.PathLike, relative: str | os.PathLike) -> Path:
    """``root / relative``, checked: resolved (symlinks and ``..`` followed) it must stay inside ``root``.

    The path is returned as joined, not resolved, so it compares equal to paths built from ``root``.

    Args:
        root: the directory the path belongs to (a stage output, a checkpoint root).
        relative: a path read from a manifest, pointer or config; an absolute path is accepted
            only if it lies inside ``root``.

    Raises:
        OutputIntegrityError: the resolved path is ``root`` itself or outside it.
    """
    base = Path(root).resolve()
    path = (base / relative).resolve()
    if path == base or not path.is_relative_to(base):
        raise OutputIntegrityError(
            f"{base}: the path {str(relative)!r} resolves to {path}, outside this directory; "
            "paths in manifests and pointers must name a file inside it"
        )
    return Path(root) / relative


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes ``out_dir`` only if the block succeeds.

    The temporary directory is a sibling of ``out_dir`` (same filesystem, so the final
    ``os.rename`` is atomic). An existing ``out_dir`` is replaced only after the new one is
    complete. On any exception the temporary directory is removed and ``out_dir`` is left
    exactly as it was.

    Args:
        out_dir: the final output directory.

    Yields:
        Path of the temporary directory to write into.
    """
    out_dir = Path(out_dir).absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def read_manifest(stage_dir: str | os.PathLike, schema: str, error: type[Exception] = OutputIntegrityError) -> dict:
    """``stage_dir/manifest.json``, parsed and checked to carry ``"schema": schema``.

    Raises:
        error: no manifest, or another schema (the message names the file and both schemas).
    """
    path = Path(stage_dir) / "manifest.json"
    if not path.is_file():
        raise error(f"{stage_dir}: no manifest.json (expected a {schema} output directory)")
    doc = json.loads(path.read_text())
    if doc.get("schema") != schema:
        raise error(f"{path}: schema {doc.get('schema')!r}, expected {schema!r}")
    return doc


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in ``chunk_bytes`` pieces (constant memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def keep_records_through(path: str | os.PathLike, step: int) -> list[dict]:
    """Truncate a JSON-lines history to the records of steps ``<= step``; returns them.

    A training run resumed from the checkpoint of ``step`` keeps its history up to that step
    and drops what a killed run wrote after it. Each record has an integer ``"step"``. A missing
    file stays missing (a run that fails before its first step leaves no empty history behind).
    """
    path = Path(path)
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines()]
    kept = [r for r in records if r["step"] <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept
