"""Helpers of the held-out integrity tests: a pack copy without its held-out shards, and a record of shard reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def without_held_out_shards(shards: Path, copy: Path) -> set[str]:
    """Copy the pack output to ``copy`` and delete its held-out (eval) shard files; returns the train shard paths.

    Any attempt to read or verify a held-out shard of the copy fails.
    """
    shutil.copytree(shards, copy)
    splits = json.loads((copy / "manifest.json").read_text())["splits"]
    assert splits["eval"]["shards"]
    for shard in splits["eval"]["shards"]:
        (copy / shard["path"]).unlink()
    return {str(copy / s["path"]) for s in splits["train"]["shards"]}


def record_shard_reads(setattr_) -> list[str]:
    """Wrap ``tasks.pack``'s shard decoder and shard hashing (``setattr_(module, name, value)``: a
    monkeypatch's or the builtin); returns the list every path they open is appended to."""
    import tasks.pack

    opened: list[str] = []

    def recording(read):
        def wrapper(path, *args, **kwargs):
            opened.append(str(path))
            return read(path, *args, **kwargs)
        return wrapper

    for name in ("read_shard", "sha256_file"):   # every shard decode, every shard verification
        setattr_(tasks.pack, name, recording(getattr(tasks.pack, name)))
    return opened
