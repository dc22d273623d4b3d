"""Pack ingested genome records into 512k-1M-token Parquet shards (single-nucleotide tokens).

This module owns the shard schema every later stage reads.

Token ids are those of :mod:`tasks.vocab` (``<pad>=0 <sep>=1 <bos>=2 <unk>=3 A=4 C=5 G=6
T=7 N=8``), stored as uint8. They are the shards' only ids: a pretrained checkpoint whose
vocabulary numbers the letters differently is served through ``tasks.vocab.id_map_to``
applied at load time; the shards are never rewritten. ``tokenizer.json`` (Hugging Face
format, loadable by transformers and vLLM) is written beside the shards.

Layout of one pack output::

    manifest.json            schema "megabase.shards/1": config, vocab, ingest manifest sha256,
                             per split: shards (path, tokens, bases, sha256), records, totals;
                             held_out_kmer_overlap: how much of the held-out split's 31-mers
                             occur in the train split (see below)
    tokenizer.json           + tokenizer_config.json
    train/shard-00000.parquet ...
    eval/shard-00000.parquet ...

Shard file (Parquet, zstd). Every shard holds exactly ``shard_tokens`` tokens except the last
shard of a split (and, with ``tail="short"``, the last shard of each record), which may be
shorter. The shard's token stream is the concatenation of its rows' ``tokens`` in row order;
each row is one contiguous piece of one record on one strand:

    ============  ===================  ====================================================
    column        type                 meaning
    ============  ===================  ====================================================
    tokens        binary               token ids, one uint8 per byte: ``<sep>`` first if
                                       ``leading_sep``, then the bases
    loss_mask     binary               one byte per token: 1 where the token is A/C/G/T,
                                       0 for N and <sep>
    soft_mask     binary               one byte per token: 1 where the FASTA base was
                                       lowercase (soft-masked)
    source        string (dictionary)  ingest source label
    record        string (dictionary)  record name (first word of the header)
    start         int64                0-based start on the forward strand, inclusive
    end           int64                0-based end on the forward strand, exclusive
    strand        string               "+" or "-" ("-": reverse complement of [start, end))
    leading_sep   bool                 row begins with one <sep> (a new document)
    doc_id        int64                document index within the split (pieces between
                                       separators); equal doc_id = one continuous sequence,
                                       also across shard boundaries
    ============  ===================  ====================================================

Byte columns rather than Parquet lists: a 1M-element list costs a repetition level per
element (5x slower to write); ``np.frombuffer(row["tokens"], np.uint8)`` reads a row without a
copy. So ``len(tokens) == end - start + leading_sep``; a row may hold a separator alone
(``start == end``) when a document boundary falls on a shard's last token. For variable-length
attention (``cu_seqlens``) documents start at rows with ``leading_sep`` (and at the first row
of a shard whose ``doc_id`` differs from the previous shard's last row).

Documents: a record is split into pieces at runs of N of at least ``n_run_split_bases``
bases; those runs are not packed (their positions stay recoverable from the provenance),
shorter runs are packed as N tokens with ``loss_mask`` False. Each piece is one document.
With ``tail="short"`` every record starts a new shard, so its last shard may be short; with
``tail="join"`` records follow each other in the stream separated by ``<sep>``. No A/C/G/T
base is ever dropped. Reverse-complement copies (``reverse_complement=True``) follow each
record's forward pieces, with ``strand="-"`` and the forward-strand coordinates.

Packing streams each record in blocks of ``read_block_bases`` through pyfaidx, so peak memory
is a few shards' worth whatever the chromosome length; outputs are byte-identical for the same
inputs and config (whatever the block size, which is therefore not part of the config), and
written atomically (a failed run leaves no shard behind).

Trust: pack reads only files the ingest manifest names inside the ingest directory, or a
source ingest read in place, and each only if its sha256 is the one ingest recorded; it never
writes an index. Every stage that reads shards calls :func:`verify_shards` first: each shard
path must stay inside the pack directory and each file's sha256 must match the manifest.

Held-out k-mer overlap (``held_out_kmer_overlap`` in the manifest): the held-out records'
distinct 31-mers of A/C/G/T (none spanning an N or a record end), a k-mer and its reverse
complement counted as one, and the fraction of them that occur exactly, on either strand, in
a training record. Related genomes share many (homology, not leakage by name): a held-out
loss is read beside it.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from tasks import vocab
from tasks.atomic import OutputIntegrityError, atomic_output_dir, read_manifest, resolve_inside, sha256_file
from tasks.ingest import GenomeInputError, RecordInfo, load_manifest, open_fasta

log = logging.getLogger("megabase.pack")

MANIFEST_SCHEMA = "megabase.shards/1"
MIN_SHARD_TOKENS = 1 << 19   # 524,288
MAX_SHARD_TOKENS = 1 << 20   # 1,048,576
READ_BLOCK_BASES = 1 << 20   # bases fetched from the FASTA per read (memory/speed only)
KMER_OVERLAP_K = 31

SHARD_SCHEMA = pa.schema(
    [
        ("tokens", pa.binary()),
        ("loss_mask", pa.binary()),
        ("soft_mask", pa.binary()),
        ("source", pa.dictionary(pa.int32(), pa.string())),
        ("record", pa.dictionary(pa.int32(), pa.string())),
        ("start", pa.int64()),
        ("end", pa.int64()),
        ("strand", pa.dictionary(pa.int8(), pa.string())),
        ("leading_sep", pa.bool_()),
        ("doc_id", pa.int64()),
    ],
    metadata={b"megabase.schema": MANIFEST_SCHEMA.encode()},
)


@dataclass(frozen=True)
class PackConfig:
    """Every packing knob.

    Attributes:
        shard_tokens: tokens per shard, in [524288, 1048576].
        tail: "short" (each record starts a new shard; its tail shard may be short) or
            "join" (records continue in the same shard after a ``<sep>``).
        n_run_split_bases: N runs at least this long split a record and are not packed.
        reverse_complement: also pack the reverse complement of every piece (strand "-").
    """

    shard_tokens: int = MAX_SHARD_TOKENS
    tail: str = "short"
    n_run_split_bases: int = 1000
    reverse_complement: bool = False

    def __post_init__(self) -> None:
        if not MIN_SHARD_TOKENS <= self.shard_tokens <= MAX_SHARD_TOKENS:
            raise ValueError(
                f"shard_tokens={self.shard_tokens} is outside [{MIN_SHARD_TOKENS}, {MAX_SHARD_TOKENS}]"
            )
        if self.tail not in ("short", "join"):
            raise ValueError(f"tail={self.tail!r}: expected 'short' or 'join'")
        if self.n_run_split_bases < 1:
            raise ValueError(f"n_run_split_bases={self.n_run_split_bases}: expected a positive number of bases")


@dataclass(frozen=True)
class PackResult:
    """Where the shards are and how many tokens each split holds."""

    out_dir: Path
    manifest: Path
    tokens: dict[str, int]
    shards: dict[str, int]


@dataclass
class _Row:
    source: str
    record: str
    start: int
    end: int
    strand: str
    leading_sep: bool
    doc_id: int
    tokens: list[np.ndarray]
    soft: list[np.ndarray]


class _ShardWriter:
    """Accumulates rows into shards of exactly ``shard_tokens`` tokens and writes them."""

    def __init__(self, split_dir: Path, shard_tokens: int):
        self.split_dir = split_dir
        self.shard_tokens = shard_tokens
        self.rows: list[_Row] = []
        self.filled = 0
        self.doc_id = -1
        self.shards: list[dict] = []
        self.io = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self.pending: list[concurrent.futures.Future] = []
        split_dir.mkdir(parents=True)

    def new_document(self, source: str, record: str, start: int, strand: str) -> None:
        """Start a document: a <sep> if the shard already holds tokens, then its bases."""
        self.doc_id += 1
        if self.filled == self.shard_tokens:
            self.flush()
        sep = self.filled > 0
        self.rows.append(_Row(source, record, start, start, strand, sep, self.doc_id, [], []))
        self.filled += sep

    def append(self, tokens: np.ndarray, soft: np.ndarray) -> None:
        """Append bases of the current document (forward order of the emitted stream)."""
        while len(tokens):
            if self.filled == self.shard_tokens:
                row = self.rows[-1]
                self.flush()
                self.rows.append(_Row(row.source, row.record, row.end if row.strand == "+" else row.start,
                                      row.end if row.strand == "+" else row.start, row.strand, False,
                                      row.doc_id, [], []))
            take = min(len(tokens), self.shard_tokens - self.filled)
            row = self.rows[-1]
            row.tokens.append(tokens[:take])
            row.soft.append(soft[:take])
            if row.strand == "+":
                row.end += take
            else:
                row.start -= take
            self.filled += take
            tokens, soft = tokens[take:], soft[take:]

    def flush(self) -> None:
        """Write the current shard (if it holds anything)."""
        if not self.rows:
            return
        parts, softs = [], []
        for row in self.rows:
            if row.leading_sep:
                parts.append(np.array([vocab.SEP], np.uint8))
                softs.append(np.zeros(1, bool))
            parts += row.tokens
            softs += row.soft
        tokens = np.concatenate(parts).astype(np.uint8, copy=False)
        soft = np.concatenate(softs).astype(bool, copy=False)
        bounds = np.cumsum([0] + [row.end - row.start + row.leading_sep for row in self.rows])
        loss = ((tokens >= vocab.A) & (tokens <= vocab.T)).view(np.uint8)
        as_rows = lambda values: [values[a:b].tobytes() for a, b in zip(bounds[:-1], bounds[1:])]  # noqa: E731
        table = pa.table(
            {
                "tokens": as_rows(tokens),
                "loss_mask": as_rows(loss),
                "soft_mask": as_rows(soft.view(np.uint8)),
                **{name: [getattr(row, name) for row in self.rows]
                   for name in ("source", "record", "start", "end", "strand", "leading_sep", "doc_id")},
            },
            schema=SHARD_SCHEMA,
        )
        path = self.split_dir / f"shard-{len(self.shards):05d}.parquet"
        self.shards.append({
            "path": f"{self.split_dir.name}/{path.name}",
            "tokens": self.filled,
            "rows": len(self.rows),
            "bases": sum(r.end - r.start for r in self.rows),
        })
        # Compression and hashing release the GIL: they overlap with reading the next shard.
        self.pending.append(self.io.submit(_write_shard, table, path))
        self.rows, self.filled = [], 0

    def close(self) -> list[dict]:
        """Wait for every shard write; returns the shard list with sha256 filled in."""
        for shard, future in zip(self.shards, self.pending):
            shard["sha256"] = future.result()
        return self.shards

    def __enter__(self) -> "_ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        # Never leave a write running into a directory the caller is about to delete.
        self.io.shutdown(wait=True, cancel_futures=True)


def _write_shard(table: pa.Table, path: Path) -> str:
    pq.write_table(table, path, compression="zstd", use_dictionary=["source", "record", "strand"],
                   row_group_size=table.num_rows, write_statistics=False)
    return sha256_file(path)


def _blocks(fasta, record: RecordInfo, start: int, end: int, block: int, reverse: bool) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (token ids, soft mask) of [start, end) in blocks, reverse-complemented if asked."""
    positions = range(start, end, block)
    for pos in (reversed(positions) if reverse else positions):
        raw = fasta[record.name][pos : min(pos + block, end)].encode("ascii")
        try:
            ids = vocab.tokenize(raw)
        except ValueError as err:
            raise GenomeInputError(f"{record.fasta}: record {record.name!r} near base {pos}: {err}") from err
        soft = vocab.BYTE_IS_SOFTMASKED[np.frombuffer(raw, dtype=np.uint8)]
        if reverse:
            ids, soft = vocab.COMPLEMENT[ids[::-1]], soft[::-1]
        yield ids, soft


def _pieces(fasta, record: RecordInfo, cfg: PackConfig, block: int, writer: _ShardWriter, bar: tqdm
            ) -> list[tuple[int, int]]:
    """Stream a record forward into the writer, splitting at long N runs; return the pieces."""
    pieces: list[tuple[int, int]] = []
    piece_start: int | None = None      # start of the open piece
    n_start: int | None = None          # start of a pending N run (not yet emitted)
    pos = 0

    def open_piece(at: int) -> None:
        nonlocal piece_start
        writer.new_document(record.source, record.name, at, "+")
        piece_start = at

    for ids, soft in _blocks(fasta, record, 0, record.length, block, reverse=False):
        is_n = ids == vocab.N
        # Boundaries of runs of equal "is N" inside the block.
        edges = np.flatnonzero(np.diff(is_n.view(np.int8))) + 1
        for lo, hi in zip(np.r_[0, edges], np.r_[edges, len(ids)]):
            lo, hi = int(lo), int(hi)
            if is_n[lo]:
                if n_start is None:
                    n_start = pos + lo
                continue
            if n_start is not None:       # an N run ends here: emit it or split at it
                run = pos + lo - n_start
                if run >= cfg.n_run_split_bases:
                    if piece_start is not None:
                        pieces.append((piece_start, n_start))
                    piece_start = None
                else:
                    if piece_start is None:
                        open_piece(n_start)
                    writer.append(np.full(run, vocab.N, np.uint8), _soft_of(fasta, record, n_start, pos + lo))
                n_start = None
            if piece_start is None:
                open_piece(pos + lo)
            writer.append(ids[lo:hi], soft[lo:hi])
        pos += len(ids)
        bar.update(len(ids))
    if n_start is not None:
        run = record.length - n_start
        if run < cfg.n_run_split_bases:
            if piece_start is None:
                open_piece(n_start)
            writer.append(np.full(run, vocab.N, np.uint8), _soft_of(fasta, record, n_start, record.length))
            n_start = None
    if piece_start is not None:
        pieces.append((piece_start, n_start if n_start is not None else record.length))
    return pieces


def _soft_of(fasta, record: RecordInfo, start: int, end: int) -> np.ndarray:
    # Short N runs are re-read (they are short by definition) to keep their soft-mask bits.
    raw = fasta[record.name][start:end].encode("ascii")
    return vocab.BYTE_IS_SOFTMASKED[np.frombuffer(raw, dtype=np.uint8)]


def _open_fastas(ingest_dir: Path, doc: dict, records: dict[str, RecordInfo], keys: list[str]) -> dict:
    """pyfaidx handles of the FASTA files holding ``keys``, each checked before it is opened.

    A relative path (FASTA, ``.fai``, ``.gzi``) must stay inside ``ingest_dir``; an absolute FASTA
    must be a source ingest read in place. Every FASTA's sha256 must be the one ingest recorded.

    Raises:
        OutputIntegrityError: a path outside the ingest directory, a missing index.
        GenomeInputError: a FASTA whose bytes changed since ingest.
    """
    sources = {row["fasta"]: row for row in doc["sources"]}
    fastas: dict[str, object] = {}
    try:
        for key in keys:
            rec = records[key]
            if rec.fasta in fastas:
                continue
            row = sources.get(rec.fasta)
            if row is None or (os.path.isabs(rec.fasta) and not row["read_in_place"]):
                raise OutputIntegrityError(
                    f"{ingest_dir / 'manifest.json'}: record {key} names FASTA {rec.fasta!r}, which is not "
                    "one of the manifest's sources"
                )
            fasta = Path(rec.fasta) if os.path.isabs(rec.fasta) else resolve_inside(ingest_dir, rec.fasta)
            indexes = [resolve_inside(ingest_dir, p) for p in (rec.fai, rec.gzi) if p]
            if sha256_file(fasta) != row["fasta_sha256"]:
                raise GenomeInputError(
                    f"{fasta}: sha256 differs from the one ingest recorded: the file changed since ingest; "
                    "rerun ingest"
                )
            missing = [str(p) for p in indexes if not p.is_file()]
            if missing:
                raise OutputIntegrityError(
                    f"{ingest_dir}: index {', '.join(missing)} of {fasta} is missing: the ingest output is "
                    "incomplete; rerun ingest"
                )
            fastas[rec.fasta] = open_fasta(ingest_dir, str(fasta), str(indexes[0]),
                                           str(indexes[1]) if rec.gzi else None, build_index=False)
    except BaseException:
        for handle in fastas.values():
            handle.close()
        raise
    return fastas


def _pack_split(records: dict[str, RecordInfo], keys: list[str], cfg: PackConfig, block: int,
                split_dir: Path, fastas: dict) -> dict:
    """Pack the records ``keys`` of one split into ``split_dir``; returns its manifest entry."""
    split_records = []
    with _ShardWriter(split_dir, cfg.shard_tokens) as writer, tqdm(
        total=sum(records[k].length for k in keys), unit="base", unit_scale=True,
        desc=f"pack {split_dir.name}", disable=None,
    ) as bar:
        for key in keys:
            rec = records[key]
            fasta = fastas[rec.fasta]
            if len(fasta[rec.name]) != rec.length:
                raise GenomeInputError(
                    f"{rec.fasta}: record {rec.name!r} has {len(fasta[rec.name])} bases, "
                    f"ingest measured {rec.length}: the file changed since ingest"
                )
            pieces = _pieces(fasta, rec, cfg, block, writer, bar)
            if cfg.reverse_complement:
                for start, end in reversed(pieces):
                    writer.new_document(rec.source, rec.name, end, "-")
                    for ids, soft in _blocks(fasta, rec, start, end, block, reverse=True):
                        writer.append(ids, soft)
            if cfg.tail == "short":
                writer.flush()
            split_records.append({
                "key": key, "length": rec.length, "sha256": rec.sha256,
                "pieces": [list(p) for p in pieces],
                "packed_bases": sum(e - s for s, e in pieces) * (2 if cfg.reverse_complement else 1),
            })
        writer.flush()
        shards = writer.close()
    return {
        "tokens": sum(s["tokens"] for s in shards),
        "bases": sum(s["bases"] for s in shards),
        "documents": writer.doc_id + 1,
        "shards": shards,
        "records": split_records,
    }


def _window_codes(codes: np.ndarray, k: int) -> np.ndarray:
    """``codes[i : i + k]`` (2-bit uint64 codes) as one base-4 number each, first base most significant.

    Windows of 1, 2, 4, ... bases are built by doubling and those of the binary digits of ``k``
    concatenated: about 2 log2(k) array operations instead of k.
    """
    n = len(codes) - k + 1
    out = np.zeros(n, np.uint64)
    filled, width, windows = 0, 1, codes
    while True:
        if k & width:
            out = (out << np.uint64(2 * width)) | windows[filled : filled + n]
            filled += width
        if 2 * width > k:
            return out
        windows = (windows[:-width] << np.uint64(2 * width)) | windows[width:]
        width *= 2


def _canonical_kmers(ids: np.ndarray, k: int) -> np.ndarray:
    """2-bit codes (A=0 C=1 G=2 T=3, first base most significant) of every k-mer of token ids
    ``ids`` that holds only A/C/G/T, each the smaller of the k-mer's and its reverse complement's."""
    n = len(ids) - k + 1
    if n <= 0:
        return np.zeros(0, np.uint64)
    acgt = (ids >= vocab.A) & (ids <= vocab.T)
    codes = np.where(acgt, ids - vocab.A, 0).astype(np.uint64)
    forward = _window_codes(codes, k)
    reverse = _window_codes(np.uint64(3) - codes[::-1], k)[::-1]   # complement, read backwards
    not_acgt = np.concatenate([[0], np.cumsum(~acgt)])
    return np.minimum(forward, reverse)[not_acgt[k:] == not_acgt[:n]]


def _distinct(values: np.ndarray) -> np.ndarray:
    """Sorted distinct values (sort + neighbour test: several times faster than ``np.unique`` here)."""
    values = np.sort(values)
    return values[np.r_[True, values[1:] != values[:-1]]] if len(values) else values


def _record_kmers(blocks: Iterator[tuple[np.ndarray, np.ndarray]], k: int) -> Iterator[np.ndarray]:
    """Canonical k-mers of one record read in blocks (k-mers across block edges included)."""
    carry = np.zeros(0, np.uint8)
    for ids, _ in blocks:
        joined = np.concatenate([carry, ids])
        yield _canonical_kmers(joined, k)
        carry = joined[max(len(joined) - (k - 1), 0):]


def held_out_kmer_overlap(train: list[Iterator], held_out: list[Iterator], k: int = KMER_OVERLAP_K) -> dict:
    """How many of the held-out records' distinct k-mers occur exactly in the training records.

    Both strands: a k-mer and its reverse complement count as one (canonical form). k-mers that
    hold an N, or cross from one record into the next, are not counted.

    Args:
        train: one iterator of ``(token ids, soft mask)`` blocks per training record, in order.
        held_out: the same for the held-out records.
        k: k-mer length, at most 32 (2 bits per base in a uint64).

    Returns:
        ``k``, ``held_out_kmers`` (distinct canonical k-mers), ``held_out_kmers_in_train`` and
        ``fraction`` (their ratio; None without held-out k-mers).
    """
    if not 1 <= k <= 32:
        raise ValueError(f"k={k}: expected 1..32 (2 bits per base in a uint64)")
    parts = [_distinct(kmers) for blocks in held_out for kmers in _record_kmers(blocks, k)]
    held = _distinct(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)
    seen = np.zeros(len(held), bool)
    if len(held):
        for blocks in train:
            for kmers in _record_kmers(blocks, k):
                kmers = _distinct(kmers)    # sorted queries: searchsorted stays in cache
                at = np.minimum(np.searchsorted(held, kmers), len(held) - 1)
                seen[at[held[at] == kmers]] = True
    hits = int(seen.sum())
    return {
        "k": k,
        "strands": "both (a k-mer and its reverse complement count as one)",
        "held_out_kmers": len(held),
        "held_out_kmers_in_train": hits,
        "fraction": hits / len(held) if len(held) else None,
    }


def pack(ingest_dir: str | os.PathLike, cfg: PackConfig, out_dir: str | os.PathLike,
         read_block_bases: int = READ_BLOCK_BASES) -> PackResult:
    """Pack the train and eval records selected by ingest into Parquet shards.

    Args:
        ingest_dir: output directory of ``tasks.ingest.ingest``.
        cfg: packing configuration.
        out_dir: output directory (replaced atomically; nothing is left behind on error).
        read_block_bases: bases fetched from the FASTA per read (memory/speed only: the output
            does not depend on it).

    Returns:
        Manifest location, tokens and shard count per split.

    Raises:
        GenomeInputError: the ingest output is missing/invalid or a FASTA changed since ingest.
        OutputIntegrityError: the ingest manifest names a file outside the ingest directory (other
            than a source read in place) or an index that is missing.
    """
    if read_block_bases < 1:
        raise ValueError(f"read_block_bases={read_block_bases}: expected a positive number of bases")
    ingest_dir = Path(ingest_dir).absolute()
    doc, records = load_manifest(ingest_dir)
    selection = {split: doc["selection"][split] for split in ("train", "eval")}
    fastas = _open_fastas(ingest_dir, doc, records, selection["train"] + selection["eval"])
    out_dir = Path(out_dir)
    try:
        with atomic_output_dir(out_dir) as work:
            vocab.write_tokenizer(work)
            splits = {
                split: _pack_split(records, keys, cfg, read_block_bases, work / split, fastas)
                for split, keys in selection.items()
            }
            blocks = {split: [_blocks(fastas[records[key].fasta], records[key], 0, records[key].length,
                                      read_block_bases, reverse=False) for key in keys]
                      for split, keys in selection.items()}
            manifest = {
                "schema": MANIFEST_SCHEMA,
                "config": asdict(cfg),
                "vocab": {"tokens": list(vocab.TOKENS), "size": vocab.VOCAB_SIZE, "tokenizer": "tokenizer.json"},
                "ingest_manifest_sha256": sha256_file(ingest_dir / "manifest.json"),
                "held_out_kmer_overlap": held_out_kmer_overlap(blocks["train"], blocks["eval"]),
                "splits": splits,
            }
            (work / "manifest.json").write_text(json.dumps(manifest, indent=1))
    finally:
        for fasta in fastas.values():
            fasta.close()
    for split, info in splits.items():
        log.info("%s: %d tokens in %d shards", split, info["tokens"], len(info["shards"]))
    overlap = manifest["held_out_kmer_overlap"]
    if overlap["fraction"] is not None:
        log.info("held-out %d-mers also in train (either strand): %.1f%% of %d",
                 overlap["k"], 100 * overlap["fraction"], overlap["held_out_kmers"])
    return PackResult(
        out_dir=out_dir,
        manifest=out_dir / "manifest.json",
        tokens={s: i["tokens"] for s, i in splits.items()},
        shards={s: len(i["shards"]) for s, i in splits.items()},
    )


def verify_shards(pack_dir: str | os.PathLike, splits: Iterable[str] | None = None) -> dict:
    """The pack manifest, after checking every shard of ``splits`` against it (all splits: None).

    Call it before reading shards. Each shard path must resolve inside ``pack_dir``; each file's
    sha256 (streamed, constant memory) must equal the manifest's. A stage reading only the train
    split passes ``("train",)`` and never opens a held-out shard.

    Raises:
        OutputIntegrityError: no manifest or not a pack manifest, an unknown split, a shard path
            outside ``pack_dir``, a missing shard, a shard whose bytes differ from the manifest.
    """
    pack_dir = Path(pack_dir)
    path = pack_dir / "manifest.json"
    manifest = read_manifest(pack_dir, MANIFEST_SCHEMA)
    for split in manifest["splits"] if splits is None else splits:
        if split not in manifest["splits"]:
            raise OutputIntegrityError(f"{path}: no split {split!r}; the manifest has {', '.join(manifest['splits'])}")
        for shard in manifest["splits"][split]["shards"]:
            file = resolve_inside(pack_dir, shard["path"])
            if not file.is_file():
                raise OutputIntegrityError(f"{file}: shard listed in {path} is missing; rerun pack")
            if sha256_file(file) != shard["sha256"]:
                raise OutputIntegrityError(
                    f"{file}: sha256 differs from the manifest's {shard['sha256']}: the shard changed after "
                    "pack wrote it; delete this pack output (and its Flyte cache entry) and rerun pack"
                )
    return manifest


def read_shard(path: str | os.PathLike) -> pa.Table:
    """Read one shard, checking its schema tag.

    Raises:
        GenomeInputError: the file is not a megabase shard of this schema version.
    """
    table = pq.read_table(path)
    tag = (table.schema.metadata or {}).get(b"megabase.schema")
    if tag != MANIFEST_SCHEMA.encode():
        raise GenomeInputError(f"{path}: not a {MANIFEST_SCHEMA} shard (schema tag {tag!r})")
    return table


def shard_token_stream(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """The shard's token stream and loss mask, concatenated over rows.

    Returns:
        (tokens uint8 ``[shard_tokens]``, loss_mask bool ``[shard_tokens]``).
    """
    table = read_shard(path)
    tokens = np.frombuffer(b"".join(table.column("tokens").to_pylist()), dtype=np.uint8)
    mask = np.frombuffer(b"".join(table.column("loss_mask").to_pylist()), dtype=np.uint8).view(bool)
    return tokens, mask


# ---- Flyte task: resources and cache version only; the logic is pack() above ------------

from flytekit import Cache, task  # noqa: E402

from tasks.caching import HashedDir, as_output, stage_version, requests_for, stage_output_dir  # noqa: E402
from tasks.presets import active_preset  # noqa: E402

PACK_VERSION = stage_version("pack", active_preset())


@task(cache=Cache(version=PACK_VERSION), requests=requests_for(active_preset().data_resources))
def pack_task(ingest_dir: HashedDir, cfg: PackConfig) -> HashedDir:
    """Flyte wrapper of :func:`pack`; cached on the ingest output's manifest hash and ``cfg``."""
    from tasks.caching import manifest_sha256

    out = stage_output_dir("pack", PACK_VERSION, ingest=manifest_sha256(ingest_dir), cfg=asdict(cfg))
    pack(ingest_dir.download(), cfg, out)
    return as_output(out)
