"""Held-out chromosome evaluation: loss in nats/token and bits per base by prior-context bucket.

Windows of ``window_tokens`` consecutive tokens are cut from the eval split's shards
(:mod:`tasks.pack`), identical for every checkpoint. In a window ``x[0..W)`` the token ``x[j]``
(``j >= 1``) is predicted from ``j`` tokens of prior context; it is scored when it is a base
(A/C/G/T: the shard's ``loss_mask``; N and ``<sep>`` targets are excluded). Scored tokens are
grouped into prior-context buckets ``[e_i, e_{i+1})`` (log4 edges from the preset, the last
bucket ending at ``W``), which partition them exactly. Per bucket and checkpoint:

    nats_per_token = mean over scored tokens of -log p(x[j] | x[:j])
    bits_per_base  = nats_per_token / ln 2      (one token is one base)

plus the relative change against the first checkpoint (the reference result: -4.8% held-out
loss after SFT at 512k, concentrated on long-context tokens), the same split by soft-masked
(repeat) vs unmasked bases, a reverse-complement consistency figure (the same windows reverse
complemented), and a k-th order Markov baseline fitted on the train split, its k (2..12) chosen
on a validation split held out by position inside the training chromosomes
(:func:`markov_baseline`; the held-out chromosomes never choose it), scored on the same tokens,
so a reader sees whether the network beats a classic DNA model.

Any :class:`tasks.engines.LogProbSource` scores a checkpoint: an inference engine, or the
trainer's forward; the report names the producer of every number.

Outputs (``out_dir``, written atomically): ``evaluate.json`` (every number),
``loss_by_context.png`` and ``deck.html`` (the plot and table, for a Flyte Deck).
"""

from __future__ import annotations

import base64
import bz2
import contextlib
import functools
import html
import json
import logging
import lzma
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from tasks import vocab
from tasks.atomic import atomic_output_dir
from tasks.engines import LogProbSource
from tasks.pack import read_shard, verify_shards

log = logging.getLogger("megabase.evaluate")

SCHEMA = "megabase.evaluate/1"
LN2 = math.log(2.0)

__all__ = ["EvalConfig", "EvalError", "EvalResult", "MarkovModel", "ShardStreams", "Window", "bucket_edges",
           "eval_windows", "evaluate", "evaluate_checkpoints", "markov_baseline", "markov_validation_bits",
           "score_windows", "split_shards", "validation_positions"]


class EvalError(ValueError):
    """Invalid evaluation input: no window fits the shards, bad bucket edges, wrong log-prob shape."""


@dataclass(frozen=True)
class EvalConfig:
    """Every evaluation knob.

    Attributes:
        window_tokens: tokens per window (the preset's ``eval_seq_len``).
        context_buckets: lower edges of the prior-context buckets, in tokens, starting at 0,
            strictly increasing; edges at or above ``window_tokens`` are dropped.
        max_windows: at most this many windows, spread evenly over the split's candidates.
        split: shard split to read ("eval": the held-out chromosomes).
        markov_orders: candidate orders k of the Markov baseline (each 0..12; empty: no baseline);
            the one with the fewest bits/base on a validation split of the training chromosomes
            is reported (:func:`markov_baseline`).
        markov_validation_fraction: share of each training record (its last forward
            coordinates, both strands) held out to choose the order, in (0, 1).
        reverse_complement: also score every window's reverse complement.
    """

    window_tokens: int
    context_buckets: tuple[int, ...] = (0, 1_024, 4_096, 16_384)
    max_windows: int = 4
    split: str = "eval"
    markov_orders: tuple[int, ...] = tuple(range(2, 13))
    markov_validation_fraction: float = 0.1
    reverse_complement: bool = True

    def __post_init__(self) -> None:
        if self.window_tokens < 2:
            raise EvalError(f"window_tokens={self.window_tokens}: need at least 2")
        if self.max_windows < 1:
            raise EvalError(f"max_windows={self.max_windows}: need at least 1")
        if any(not 0 <= k <= 12 for k in self.markov_orders):
            raise EvalError(f"markov_orders={self.markov_orders}: expected orders in 0..12")
        if not 0 < self.markov_validation_fraction < 1:
            raise EvalError(f"markov_validation_fraction={self.markov_validation_fraction}: expected a value in (0, 1)")
        bucket_edges(self.context_buckets, self.window_tokens)


def bucket_edges(lower_edges: tuple[int, ...], window_tokens: int) -> np.ndarray:
    """Bucket boundaries ``[e_0 = 0, e_1, ..., W]`` (int64) from lower edges and the window.

    Raises:
        EvalError: edges that do not start at 0 or do not increase strictly.
    """
    edges = [int(e) for e in lower_edges]
    if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise EvalError(f"context_buckets={lower_edges}: need strictly increasing edges starting at 0")
    return np.asarray([e for e in edges if e < window_tokens] + [window_tokens], dtype=np.int64)


@dataclass(frozen=True)
class Window:
    """One evaluation window and where it comes from.

    Attributes:
        tokens: uint8 ``[W]`` token ids.
        loss_mask: bool ``[W]``: True where the token is a base (A/C/G/T).
        soft_mask: bool ``[W]``: True where the FASTA base was lowercase (repeat-masked).
        shard: shard path relative to the pack output.
        offset: index of ``tokens[0]`` in the shard's token stream.
        record, strand, start: provenance of the first token (``start``: 0-based forward
            coordinate of the row's first base, plus the offset into the row).
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    soft_mask: np.ndarray
    shard: str
    offset: int
    record: str
    strand: str
    start: int

    def reverse_complement(self) -> "Window":
        """The window read on the other strand (masks follow their bases)."""
        return Window(vocab.COMPLEMENT[self.tokens[::-1]], self.loss_mask[::-1].copy(), self.soft_mask[::-1].copy(),
                      self.shard, self.offset, self.record, "-" if self.strand == "+" else "+", self.start)

    def provenance(self) -> dict:
        return {"shard": self.shard, "offset": self.offset, "record": self.record, "strand": self.strand,
                "start": self.start, "scored_tokens": int(self.loss_mask[1:].sum())}


def split_shards(shards_dir: Path, split: str) -> list[dict]:
    """The manifest's shard entries (``path``, ``tokens``, ...) of one split.

    Raises:
        EvalError: no manifest, or no such split.
    """
    manifest_path = shards_dir / "manifest.json"
    if not manifest_path.is_file():
        raise EvalError(f"{shards_dir}: no manifest.json (expected a pack output directory)")
    splits = json.loads(manifest_path.read_text())["splits"]
    if split not in splits:
        raise EvalError(f"{shards_dir}: no split {split!r}; the manifest has {', '.join(splits)}")
    return verify_shards(shards_dir, (split,))["splits"][split]["shards"]


class ShardStreams:
    """One shard's token, loss-mask and soft-mask streams plus its rows, to cut windows from."""

    def __init__(self, shards_dir: Path, shard: str):
        table = read_shard(shards_dir / shard)
        join = lambda column: np.frombuffer(b"".join(table.column(column).to_pylist()), dtype=np.uint8)  # noqa: E731
        self.shard = shard
        self.tokens = join("tokens")
        self.loss_mask = join("loss_mask").view(bool)
        self.soft_mask = join("soft_mask").view(bool)
        self.rows = table.select(["source", "record", "start", "end", "strand", "leading_sep"]).to_pylist()
        self.row_starts = np.cumsum([0] + [len(b) for b in table.column("tokens").to_pylist()])

    def window(self, offset: int, length: int) -> Window:
        """Tokens ``[offset, offset + length)`` of the stream, with the first token's provenance."""
        row = int(np.searchsorted(self.row_starts, offset, side="right")) - 1
        info = self.rows[row]
        into = max(offset - int(self.row_starts[row]) - int(info["leading_sep"]), 0)
        start = info["start"] + into if info["strand"] == "+" else info["end"] - into
        sl = slice(offset, offset + length)
        return Window(self.tokens[sl].copy(), self.loss_mask[sl].copy(), self.soft_mask[sl].copy(), self.shard,
                      offset, info["record"], info["strand"], int(start))


def eval_windows(shards_dir: str | os.PathLike, window_tokens: int, max_windows: int, split: str = "eval") -> list[Window]:
    """Cut the split's shards into non-overlapping windows; keep ``max_windows`` evenly spread.

    Windows never cross a shard boundary (with ``tail="short"`` shards end at record ends).
    The selection is deterministic: the same shards give the same windows for every checkpoint.

    Args:
        shards_dir: pack output directory.
        window_tokens: tokens per window.
        max_windows: at most this many windows (``linspace`` over all candidates).
        split: "eval" or "train".

    Returns:
        Windows in shard/offset order.

    Raises:
        EvalError: no shard holds ``window_tokens`` tokens, or the directory is not a pack output.
    """
    shards_dir = Path(shards_dir)
    shards = split_shards(shards_dir, split)
    candidates = [(shard["path"], offset) for shard in shards
                  for offset in range(0, shard["tokens"] - window_tokens + 1, window_tokens)]
    if not candidates:
        longest = max((s["tokens"] for s in shards), default=0)
        raise EvalError(f"{shards_dir}: no {split} shard holds a {window_tokens}-token window (longest {longest})")
    picks = np.unique(np.linspace(0, len(candidates) - 1, min(max_windows, len(candidates))).round().astype(int))
    windows = []
    streams = None
    for shard, offset in (candidates[i] for i in picks):
        if streams is None or streams.shard != shard:
            streams = ShardStreams(shards_dir, shard)
        windows.append(streams.window(offset, window_tokens))
    return windows


def score_windows(source: LogProbSource, windows: list[Window], progress: tqdm | None = None) -> list[np.ndarray]:
    """Per-token log-probs of each window from ``source`` (one window per call: memory).

    ``progress`` (a tqdm bar) advances by one per window scored.

    Returns:
        float32 ``[W - 1]`` per window: ``lp[j - 1] = log p(x[j] | x[:j])``.

    Raises:
        EvalError: the source returned the wrong shape or non-finite values.
    """
    out = []
    for i, window in enumerate(windows):
        (lp,) = source.prompt_logprobs([window.tokens.astype(np.int64)])
        lp = np.asarray(lp)
        if lp.shape != (len(window.tokens) - 1,):
            raise EvalError(f"{source.description}: window {i} gave log-probs of shape {lp.shape}, "
                            f"expected ({len(window.tokens) - 1},)")
        if not np.isfinite(lp).all():
            raise EvalError(f"{source.description}: window {i} has non-finite log-probs at "
                            f"position {int(np.argmin(np.isfinite(lp))) + 1}")
        out.append(lp)
        if progress is not None:
            progress.update()
    return out


def _summary(nll: np.ndarray) -> dict:
    """Token count and mean loss; None for an empty selection (strict JSON has no NaN)."""
    if not nll.size:
        return {"tokens": 0, "nats_per_token": None, "bits_per_base": None}
    nats = float(nll.mean())
    return {"tokens": int(nll.size), "nats_per_token": nats, "bits_per_base": nats / LN2}


def _bucket_stats(windows: list[Window], logprobs: list[np.ndarray], edges: np.ndarray) -> dict:
    """Overall and per-bucket loss of scored tokens, also split by soft mask."""
    positions = np.arange(1, len(windows[0].tokens))
    nll, ctx, soft = [], [], []
    for window, lp in zip(windows, logprobs):
        scored = window.loss_mask[1:]
        nll.append(-lp[scored].astype(np.float64))
        ctx.append(positions[scored])
        soft.append(window.soft_mask[1:][scored])
    nll, ctx, soft = np.concatenate(nll), np.concatenate(ctx), np.concatenate(soft)
    which = np.searchsorted(edges, ctx, side="right") - 1
    buckets = []
    for b in range(len(edges) - 1):
        sel = which == b
        buckets.append({"context": [int(edges[b]), int(edges[b + 1])], **_summary(nll[sel]),
                        "soft_masked": _summary(nll[sel & soft]), "unmasked": _summary(nll[sel & ~soft])})
    return {"overall": {**_summary(nll), "soft_masked": _summary(nll[soft]), "unmasked": _summary(nll[~soft])},
            "buckets": buckets}


_DENSE_MAX_CODES = 1 << 20
"""Count tables with at most this many codes (orders k <= 9: 4^(k+1) <= 2^20, 8 MiB of int64)
are dense ``bincount`` arrays; longer orders (4^13 = 67M codes at k = 12, 537 MB dense) keep
only the codes seen, sorted, and look them up with ``searchsorted``."""


class _CountTable:
    """``n(code)`` for integer codes in ``[0, size)``, dense or sparse (:data:`_DENSE_MAX_CODES`).

    Args:
        codes: int32 ``[M]`` observed codes (one per counted position).
        size: number of possible codes.
    """

    def __init__(self, codes: np.ndarray, size: int):
        self.size = size
        if size <= _DENSE_MAX_CODES:
            self.dense: np.ndarray | None = np.bincount(codes, minlength=size)
        else:
            self.dense = None
            self.keys, counts = np.unique(codes, return_counts=True)
            self.values = counts.astype(np.int32)   # one count per seen code: below 2^31 positions

    def __getitem__(self, codes: np.ndarray) -> np.ndarray:
        """int64 counts of ``codes`` (0 for a code never seen)."""
        if self.dense is not None:
            return self.dense[codes]
        if not len(self.keys):
            return np.zeros(len(codes), dtype=np.int64)
        at = np.minimum(np.searchsorted(self.keys, codes), len(self.keys) - 1)
        return np.where(self.keys[at] == codes, self.values[at], 0)

    def contexts(self) -> "_CountTable":
        """The table of ``code // 4``: for (context, base) codes, ``n(context)`` summed over bases."""
        out = _CountTable.__new__(_CountTable)
        out.size = self.size // 4
        if self.dense is not None:
            out.dense = self.dense.reshape(-1, 4).sum(1)
            return out
        out.dense = None
        contexts = self.keys >> 2                  # sorted, since keys are
        first = np.flatnonzero(np.r_[True, contexts[1:] != contexts[:-1]]) if len(contexts) else np.zeros(0, int)
        out.keys = contexts[first]
        out.values = np.add.reduceat(self.values, first) if len(first) else np.zeros(0, np.int64)
        return out


class MarkovModel:
    """k-th order Markov model of DNA bases with backoff, fitted by counting.

    ``p(b | c) = (n(c, b) + 1) / (n(c) + 4)`` (add-one smoothing) for the longest context
    ``c`` of at most ``order`` preceding bases that holds only A/C/G/T and lies inside the
    scored sequence (shorter contexts near its start or after an N/<sep>). A context never
    seen in training gets the uniform 1/4: add-one does not back off to shorter contexts on
    sparsity, which is what makes large k lose on held-out data and a validation choice of k
    necessary. The classic baseline of DNA language-model papers (e.g. the Markov baselines
    of Nguyen et al., HyenaDNA, 2023).

    The counts of every order ``0 .. order`` are kept, so one fit also serves every lower
    order (:meth:`logprobs` with ``order=``).

    Args:
        order: maximum context length k in bases (0 to 12).
    """

    def __init__(self, order: int):
        if not 0 <= order <= 12:
            raise EvalError(f"Markov order {order}: expected 0 to 12")
        self.order = order
        self.pairs: list[_CountTable] = []
        self.contexts: list[_CountTable] = []

    @staticmethod
    def _clean_run(tokens: np.ndarray) -> np.ndarray:
        """int64 ``[T]``: number of consecutive bases ending at each position (0 at N/<sep>)."""
        is_base = (tokens >= vocab.A) & (tokens <= vocab.T)
        idx = np.arange(len(tokens))
        last_bad = np.maximum.accumulate(np.where(is_base, -1, idx))
        return np.where(is_base, idx - last_bad, 0)

    @staticmethod
    def _codes(tokens: np.ndarray, max_order: int):
        """Yield ``(k, code)`` for ``k = 0 .. max_order``: int32 ``[T]`` with ``code[t]`` the index of
        (bases ``t-k .. t-1``, base ``t``) in base 4 (meaningful where ``t >= k`` and all are bases).

        The same array is updated in place from one order to the next (copy it to keep it);
        int32 holds every code (``4^13 < 2^31``) at half the memory and sort time of int64.
        """
        digits = np.clip(tokens.astype(np.int32) - vocab.A, 0, 3)
        code = digits.copy()
        yield 0, code
        for k in range(1, max_order + 1):
            # code_k[t] = digit[t-k] * 4^k + code_{k-1}[t]: one pass per order, not k passes.
            code[k:] += digits[:-k] * 4 ** k
            yield k, code

    def fit(self, streams: np.ndarray | list[np.ndarray]) -> "MarkovModel":
        """Count every order on the token streams (uint8 ``[T]`` each; a list: one per shard).

        A (context, base) pair is counted only inside one stream and one run of bases. Fitting
        replaces any previous counts. Orders are counted one at a time over all streams, so
        memory holds one order's codes (4 bytes per token), not all of them.
        """
        streams = [streams] if isinstance(streams, np.ndarray) else list(streams)
        runs = [self._clean_run(tokens) for tokens in streams]
        orders = zip(*(self._codes(tokens, self.order) for tokens in streams)) if streams else iter(())
        self.pairs = []
        for k, per_stream in enumerate(orders):
            codes = [code[run >= k + 1] for (_, code), run in zip(per_stream, runs)]
            self.pairs.append(_CountTable(np.concatenate(codes), 4 ** (k + 1)))
        if not streams:
            self.pairs = [_CountTable(np.zeros(0, np.int32), 4 ** (k + 1)) for k in range(self.order + 1)]
        self.contexts = [table.contexts() for table in self.pairs]
        return self

    def logprobs(self, tokens: np.ndarray, order: int | None = None) -> np.ndarray:
        """float64 ``[T - 1]``: ``log p(x[j] | context)`` for ``j >= 1``; 0 where ``x[j]`` is not a base.

        Args:
            tokens: uint8 ``[T]`` token ids.
            order: use contexts of at most this many bases (default: the fitted order).
        """
        order = self.order if order is None else order
        if not 0 <= order <= self.order or not self.pairs:
            raise EvalError(f"Markov order {order}: the model is fitted up to order {self.order}"
                            + ("" if self.pairs else " but not fitted yet"))
        run = self._clean_run(tokens)
        # Context length used for x[j]: clean bases right before j, capped at the order.
        ctx = np.minimum(np.concatenate([[0], run[:-1]]), order)
        out = np.zeros(len(tokens))
        for k, code in self._codes(tokens, order):
            sel = np.flatnonzero((ctx == k) & (run > 0))
            if not len(sel):
                continue
            pair = self.pairs[k][code[sel]].astype(np.float64)
            context_total = self.contexts[k][code[sel] >> 2].astype(np.float64)
            out[sel] = np.log((pair + 1) / (context_total + 4))
        return out[1:]


def markov_validation_bits(model: MarkovModel, validation: list[np.ndarray], orders: tuple[int, ...]) -> dict[int, float]:
    """Bits per base of ``model`` at each order on the validation streams (all their base targets).

    Each validation stream is scored on its own, its first base without context, like an
    evaluation window.

    Returns:
        order -> bits per base (float; NaN-free: raises when there is no base to score).

    Raises:
        EvalError: the validation streams hold no base target.
    """
    bases = sum(int(((s[1:] >= vocab.A) & (s[1:] <= vocab.T)).sum()) for s in validation)
    if not bases:
        raise EvalError("the Markov validation split holds no A/C/G/T target; raise markov_validation_fraction")
    return {k: -sum(float(model.logprobs(s, k).sum()) for s in validation if len(s) > 1) / bases / LN2 for k in orders}


def validation_positions(streams: "ShardStreams", cut: Mapping[str, int]) -> np.ndarray:
    """bool ``[T]``: True where the shard's token lies at or after its record's validation cut.

    A token's forward-strand coordinate comes from its row (``+``: ``start + i``; ``-``: the row
    is the reverse complement of ``[start, end)``, so ``end - 1 - i``), so both strands of the
    same stretch fall on the same side. A row's leading ``<sep>`` is never a validation base.
    """
    held = np.zeros(len(streams.tokens), dtype=bool)
    for row, a, b in zip(streams.rows, streams.row_starts[:-1], streams.row_starts[1:]):
        first = int(a) + int(row["leading_sep"])
        i = np.arange(int(b) - first)
        coord = row["start"] + i if row["strand"] == "+" else row["end"] - 1 - i
        held[first:int(b)] = coord >= cut[f"{row['source']}:{row['record']}"]
    return held


@dataclass(frozen=True)
class _MarkovSource:
    model: MarkovModel
    description: str

    def prompt_logprobs(self, prompts):
        return [self.model.logprobs(np.asarray(p)).astype(np.float32) for p in prompts]


@dataclass(frozen=True)
class EvalResult:
    """Where the outputs are and the report itself (the content of ``evaluate.json``)."""

    out_dir: Path
    report: dict = field(repr=False)


MARKOV_SMOOTHING = ("add-one (Laplace): p(b|c) = (n(c,b) + 1) / (n(c) + 4); backoff to the longest context of "
                    "A/C/G/T inside the scored window (window start, after N/<sep>), not on sparse counts")


def markov_baseline(shards_dir: str | os.PathLike, orders: tuple[int, ...],
                    validation_fraction: float) -> tuple[_MarkovSource, dict] | None:
    """The Markov baseline of the train split, its order chosen on a validation split of the train split.

    Validation split, held out by position inside the *training* chromosomes: for every train
    record of length ``L`` the forward coordinates ``[cut, L)`` with
    ``cut = L - ceil(validation_fraction x L)``, on both strands (a k-mer model would otherwise
    count the reverse complement of what it is scored on, when the pack holds both strands).
    The counts of orders ``0 .. max(orders)`` are fitted on the rest of the train split, every
    order is scored on the validation bases, the order with the fewest bits/base is chosen (the
    lowest such order on a tie) and refitted on the whole train split. Only the train split's
    shards are opened: the held-out chromosomes never influence the choice.

    Args:
        shards_dir: pack output directory.
        orders: candidate orders k (each 0 .. 12).
        validation_fraction: share of each training record held out for the choice, in (0, 1).

    Returns:
        (the refitted model as a log-prob source, the selection: orders' validation bits/base,
        chosen order, smoothing, validation bases), or ``None`` when the pack has no train shard
        (an evaluation-only pack: an unfitted model is a uniform guess, not a baseline).

    Raises:
        EvalError: a fraction outside (0, 1), an order outside 0..12, or no validation base.
    """
    if not 0 < validation_fraction < 1:
        raise EvalError(f"markov_validation_fraction={validation_fraction}: expected a value in (0, 1)")
    if not orders or any(not 0 <= k <= 12 for k in orders):
        raise EvalError(f"markov_orders={orders}: expected orders in 0..12")
    shards_dir = Path(shards_dir)
    shards = split_shards(shards_dir, "train")
    if not shards:
        return None
    manifest = json.loads((shards_dir / "manifest.json").read_text())
    cut = {r["key"]: r["length"] - math.ceil(validation_fraction * r["length"])
           for r in manifest["splits"]["train"]["records"]}
    full, fit, validation = [], [], []
    for shard in shards:
        streams = ShardStreams(shards_dir, shard["path"])
        held = validation_positions(streams, cut)
        full.append(streams.tokens)
        # Validation tokens become N in the fitted stream: no counted (context, base) pair
        # crosses the cut. The validation stream keeps only its tokens, one N between pieces
        # that are not adjacent in the shard, so no scored context crosses a cut either.
        fit.append(np.where(held, np.uint8(vocab.N), streams.tokens))
        where = np.flatnonzero(held)
        gaps = np.flatnonzero(np.diff(where) > 1) + 1
        validation.append(np.insert(streams.tokens[where], gaps, np.uint8(vocab.N)))
    bits = markov_validation_bits(MarkovModel(max(orders)).fit(fit), validation, tuple(orders))
    chosen = min(bits, key=lambda k: (bits[k], k))
    model = MarkovModel(chosen).fit(full)
    selection = {
        "chosen_order": chosen,
        "validation_bits_per_base": {str(k): bits[k] for k in sorted(bits)},
        "smoothing": MARKOV_SMOOTHING,
        "validation": (f"last {validation_fraction:.0%} of every training record's forward coordinates, both "
                       "strands; the held-out chromosomes are not read"),
        "validation_bases": sum(int(((v >= vocab.A) & (v <= vocab.T)).sum()) for v in validation),
        "fit_bases": sum(int(((t >= vocab.A) & (t <= vocab.T)).sum()) for t in full),
    }
    description = (f"Markov order {chosen} (chosen among {min(orders)}..{max(orders)} on a validation split of the "
                   f"training chromosomes), add-one smoothing, backoff; fitted on the train split")
    return _MarkovSource(model, description), selection


COMPRESSORS = {
    "xz -9e (lzma)": lambda data: lzma.compress(data, preset=9 | lzma.PRESET_EXTREME),
    "bzip2 -9": lambda data: bz2.compress(data, compresslevel=9),
}
"""General-purpose compressors whose size on the scored bases is a baseline (standard library)."""


def compressor_baselines(windows: list[Window]) -> dict[str, dict]:
    """Bits per base of each of :data:`COMPRESSORS` on exactly the bases the models score.

    Each window's scored bases (its A/C/G/T targets, in order, as ASCII) are compressed on their
    own, as the models score each window on its own: ``8 * sum of compressed bytes / bases``.
    Windows may overlap, and one stream of all of them would let the compressor copy the
    overlap. A compressor has no per-token cost, so the numbers are overall only; they are what
    a model must beat to say it learned more than a general-purpose compressor finds in the
    same sequence.
    """
    letters = np.frombuffer(b"????ACGT", dtype=np.uint8)
    pieces = [letters[w.tokens[1:][w.loss_mask[1:]]].tobytes() for w in windows]
    bases = sum(map(len, pieces))
    if not bases:
        return {}
    return {name: {"bits_per_base": 8 * sum(len(compress(p)) for p in pieces if p) / bases, "bases": bases,
                   "source": f"{name} on each window's scored bases ({bases:,} in all)"}
            for name, compress in COMPRESSORS.items()}


def _opened(source: LogProbSource | Callable[[], LogProbSource]):
    """A source, or one built now from a zero-argument factory and closed after use."""
    if isinstance(source, LogProbSource):
        return contextlib.nullcontext(source)
    built = source()
    return contextlib.closing(built) if hasattr(built, "close") else contextlib.nullcontext(built)


def evaluate(sources: Mapping[str, LogProbSource | Callable[[], LogProbSource]], shards_dir: str | os.PathLike, cfg: EvalConfig,
             out_dir: str | os.PathLike) -> EvalResult:
    """Held-out loss per prior-context bucket for each checkpoint, on identical windows.

    Args:
        sources: checkpoint label -> log-prob source (or a zero-argument factory of one, built
            when its turn comes and closed after, so one model is in memory at a time), in
            report order; the first is the baseline of the relative change
            (e.g. ``{"base": ..., "sft": ..., "rl": ...}``).
        shards_dir: pack output directory.
        cfg: windows, buckets, baselines.
        out_dir: output directory (atomic): ``evaluate.json``, ``loss_by_context.png``, ``deck.html``.

    Returns:
        :class:`EvalResult` with the report.

    Raises:
        EvalError: no sources, no window fits, or a source returned bad log-probs.
        ImportError: matplotlib is missing (the plot is part of the output, never skipped).
    """
    if not sources:
        raise EvalError("evaluate needs at least one checkpoint (log-prob source)")
    shards_dir = Path(shards_dir)
    edges = bucket_edges(cfg.context_buckets, cfg.window_tokens)
    windows = eval_windows(shards_dir, cfg.window_tokens, cfg.max_windows, cfg.split)
    if not any(w.loss_mask[1:].any() for w in windows):
        raise EvalError(f"{shards_dir}: the {len(windows)} {cfg.split} windows hold no A/C/G/T target to score")
    rc_windows = [w.reverse_complement() for w in windows] if cfg.reverse_complement else []
    log.info("evaluate: %d windows of %d tokens from %s/%s", len(windows), cfg.window_tokens, shards_dir, cfg.split)

    results: dict[str, dict] = {}
    bar = tqdm(total=(len(sources) + bool(cfg.markov_orders)) * (len(windows) + len(rc_windows)), desc="evaluate",
               unit="window", disable=None)

    def score(label: str, factory) -> None:
        bar.set_postfix(checkpoint=label)
        with _opened(factory) as source:
            stats = _bucket_stats(windows, score_windows(source, windows, bar), edges)
            rc = _bucket_stats(rc_windows, score_windows(source, rc_windows, bar), edges)["overall"] if rc_windows else None
        entry = {"source": source.description, **stats}
        if rc is not None and rc["tokens"]:
            forward = stats["overall"]["bits_per_base"]
            entry["reverse_complement"] = {"bits_per_base": rc["bits_per_base"], "forward_bits_per_base": forward,
                                           "relative_gap": (rc["bits_per_base"] - forward) / forward}
        results[label] = entry
        log.info("evaluate %s: %.4f bits/base (%s)", label, stats["overall"]["bits_per_base"], source.description)

    for label, factory in sources.items():
        score(label, factory)
    # The Markov baseline is fitted after the checkpoints are scored: ranks that serve a
    # distributed trainer scorer wait on rank 0 only while it scores.
    if cfg.markov_orders:
        fitted = markov_baseline(shards_dir, cfg.markov_orders, cfg.markov_validation_fraction)
        if fitted is None:
            log.warning("evaluate: %s has no train split (an evaluation-only pack): no Markov baseline", shards_dir)
        else:
            baseline, markov_selection = fitted
            log.info("evaluate: Markov order %d chosen; validation bits/base by order %s",
                     markov_selection["chosen_order"], markov_selection["validation_bits_per_base"])
            label = f"markov-{markov_selection['chosen_order']}"
            score(label, baseline)
            results[label]["selection"] = markov_selection
    bar.close()

    base = results[next(iter(sources))]
    for entry in results.values():
        entry["overall"]["relative_change"] = _relative(entry["overall"], base["overall"])
        for bucket, base_bucket in zip(entry["buckets"], base["buckets"]):
            bucket["relative_change"] = _relative(bucket, base_bucket)

    report = {
        "schema": SCHEMA,
        "config": asdict(cfg),
        "shards_dir": str(shards_dir.absolute()),
        "windows": [w.provenance() for w in windows],
        "context_buckets": [[int(a), int(b)] for a, b in zip(edges[:-1], edges[1:])],
        "checkpoints": {label: results[label] for label in sources},
        "baselines": {label: results[label] for label in results if label not in sources},
        "compressors": compressor_baselines(windows),
        "held_out_kmer_overlap": _manifest_overlap(shards_dir),
    }
    with atomic_output_dir(out_dir) as work:
        (work / "evaluate.json").write_text(json.dumps(report, indent=1))
        png = plot_loss_by_context(report, work / "loss_by_context.png")
        (work / "deck.html").write_text(deck_html(report, png))
    return EvalResult(Path(out_dir), report)


def _manifest_overlap(shards_dir: Path) -> dict | None:
    """The pack manifest's train/held-out 31-mer overlap (``tasks.pack``), or None for older packs."""
    return json.loads((shards_dir / "manifest.json").read_text()).get("held_out_kmer_overlap")


def _relative(entry: dict, base: dict) -> float | None:
    if not entry["tokens"] or not base["tokens"]:
        return None
    return (entry["nats_per_token"] - base["nats_per_token"]) / base["nats_per_token"]


def _bucket_label(lo: int, hi: int) -> str:
    fmt = lambda n: f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)  # noqa: E731
    return f"[{fmt(lo)}, {fmt(hi)})"


def plot_loss_by_context(report: dict, path: Path) -> Path:
    """PNG: bits/base per context bucket for every checkpoint and baseline (left), relative
    change against the first checkpoint (right).

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [_bucket_label(*b) for b in report["context_buckets"]]
    x = np.arange(len(labels))
    others = [name for name in report["checkpoints"]][1:]
    fig, axes = plt.subplots(1, 2 if others else 1, figsize=(11 if others else 6.5, 4.2), squeeze=False)
    left = axes[0, 0]
    for name, entry in report["checkpoints"].items():
        left.plot(x, [np.nan if b["bits_per_base"] is None else b["bits_per_base"] for b in entry["buckets"]],
                  "-", marker="o", label=name)
    # Baselines are reference lines at their overall bits/base: a Markov model of at most 12
    # bases of context scores every bucket alike, so only the network's curve varies with context.
    for name, entry in report["baselines"].items():
        left.axhline(entry["overall"]["bits_per_base"], color="tab:olive", linewidth=1.0, linestyle="--",
                     label=f"{name} (k chosen on train validation)" if "selection" in entry else name)
    left.axhline(2.0, color="grey", linewidth=0.8, linestyle=":", label="uniform over A/C/G/T")
    for (name, entry), color in zip(report.get("compressors", {}).items(), ("tab:brown", "tab:pink")):
        left.axhline(entry["bits_per_base"], color=color, linewidth=0.8, linestyle="-.", label=name)
    left.set(xticks=x, xticklabels=labels, xlabel="prior context (tokens)", ylabel="bits per base",
             title="held-out loss by prior context")
    left.legend(fontsize=8)
    if not others:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
    right = axes[0, 1]
    width = 0.8 / max(len(others), 1)
    for i, name in enumerate(others):
        change = [100 * (b["relative_change"] or 0.0) for b in report["checkpoints"][name]["buckets"]]
        right.bar(x + (i - (len(others) - 1) / 2) * width, change, width, label=name)
    first = next(iter(report["checkpoints"]))
    right.axhline(0, color="black", linewidth=0.8)
    right.set(xticks=x, xticklabels=labels, xlabel="prior context (tokens)", ylabel="% change in loss",
              title=f"relative to {first!r}")
    if others:
        right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(bits: float | None) -> str:
    return "n/a" if bits is None else f"{bits:.4f}"


def deck_html(report: dict, png: Path) -> str:
    """HTML snippet for a Flyte Deck: the plot (inline PNG) and the bits/base table."""
    image = base64.b64encode(png.read_bytes()).decode()
    buckets = [_bucket_label(*b) for b in report["context_buckets"]]
    head = "".join(f"<th>{html.escape(b)}</th>" for b in buckets)
    rows = []
    for name, entry in {**report["checkpoints"], **report["baselines"]}.items():
        cells = "".join(
            f"<td>{_fmt(b['bits_per_base'])}" + (f" ({100 * b['relative_change']:+.1f}%)" if b.get("relative_change") else "")
            + f"<br><small>{b['tokens']:,} tok</small></td>" for b in entry["buckets"])
        rows.append(f"<tr><td><b>{html.escape(name)}</b><br><small>{html.escape(entry['source'])}</small></td>"
                    f"{cells}<td>{_fmt(entry['overall']['bits_per_base'])}</td></tr>")
    for name, entry in report.get("compressors", {}).items():
        rows.append(f"<tr><td><b>{html.escape(name)}</b><br><small>{html.escape(entry['source'])}</small></td>"
                    f"<td colspan={len(buckets)}>(no per-token cost)</td><td>{_fmt(entry['bits_per_base'])}</td></tr>")
    for name, entry in report["baselines"].items():
        if selection := entry.get("selection"):
            by_order = ", ".join(f"k={k}: {bits:.4f}" for k, bits in selection["validation_bits_per_base"].items())
            rows.append(f"<tr><td colspan={len(buckets) + 2}><small>{html.escape(name)}: order "
                        f"{selection['chosen_order']} chosen on {selection['validation_bases']:,} validation bases "
                        f"({html.escape(selection['validation'])}); validation bits/base {by_order}; smoothing "
                        f"{html.escape(selection['smoothing'])}</small></td></tr>")
    windows = report["windows"]
    overlap = report.get("held_out_kmer_overlap") or {}
    note = (f"<p>{100 * overlap['fraction']:.1f}% of the held-out chromosome's distinct {overlap['k']}-mers "
            f"(both strands) occur exactly in the training split: shared sequence (homology), not leakage "
            f"of the held-out record.</p>" if overlap.get("fraction") is not None else "")
    return (
        f"<h3>Held-out loss (bits per base) by prior context: {len(windows)} windows of "
        f"{report['config']['window_tokens']:,} tokens, split {html.escape(report['config']['split'])}</h3>"
        f'<img src="data:image/png;base64,{image}" style="max-width:100%">'
        f"<table border=1 cellpadding=4><tr><th>checkpoint</th>{head}<th>all</th></tr>{''.join(rows)}</table>"
        f"{note}"
    )



def evaluate_checkpoints(checkpoints: Mapping[str, str | os.PathLike], shards_dir: str | os.PathLike, preset,
                         out_dir: str | os.PathLike) -> EvalResult | None:
    """Evaluate HF exports with a preset's window, buckets and scorer (the Flyte task's body).

    With ``preset.evaluate.scorer == "trainer"`` every rank of the job runs this: each checkpoint
    in turn is built in ``preset.infer_parallel`` (:func:`tasks.engines.preset_trainer_logprobs`;
    one process on the CPU presets, TP x CP ranks on the GPU presets), rank 0 runs
    :func:`evaluate` and writes the report, the other ranks score their CP slices of its windows.
    Before anything is built the scorer's forward memory plan at ``preset.eval_seq_len``
    (:func:`tasks.memory_plan.scoring_memory_plan`) is computed, printed by rank 0 and refused when
    it does not fit. With ``"engine"`` the preset's engine scores in one process, spread over
    the task's GPUs.

    Args:
        checkpoints: label -> export directory, in report order (first = baseline).
        shards_dir: pack output directory.
        preset: a :class:`tasks.presets.Preset`; ``preset.evaluate.scorer`` picks the
            trainer's forward or ``preset.engine``; dtype is ``preset.verify.dtype``.
        out_dir: output directory.

    Returns:
        The :class:`EvalResult` on rank 0; None on the other ranks of a trainer scorer's job.

    Raises:
        EvalError: unknown scorer, or see :func:`evaluate`.
        tasks.memory_plan.MemoryPlanError: the trainer scorer does not fit the device.
    """
    from model.config import from_hf
    from tasks.engines import make_engine, preset_trainer_logprobs, serving_kwargs
    from tasks.memory_plan import scoring_memory_plan

    spec = preset.evaluate
    if spec.scorer not in ("trainer", "engine"):
        raise EvalError(f"preset {preset.name}: evaluate.scorer={spec.scorer!r}; choose 'trainer' or 'engine'")
    cfg = EvalConfig(window_tokens=preset.eval_seq_len, context_buckets=spec.context_buckets,
                     max_windows=spec.max_windows, markov_orders=spec.markov_orders,
                     markov_validation_fraction=spec.markov_validation_fraction,
                     reverse_complement=spec.reverse_complement)
    if spec.scorer == "engine":
        build = lambda path: functools.partial(make_engine, preset.engine, path, preset.verify.dtype,  # noqa: E731
                                               preset.eval_seq_len,
                                               **serving_kwargs(preset.engine, preset.infer_resources.gpu))
        return evaluate({label: build(path) for label, path in checkpoints.items()}, shards_dir, cfg, out_dir)
    main = int(os.environ.get("RANK", 0)) == 0
    for label, path in checkpoints.items():
        plan = scoring_memory_plan(from_hf(json.loads((Path(path) / "config.json").read_text())), preset,
                                   preset.eval_seq_len, with_engine=False)
        if main:
            log.info("evaluate %s: trainer scorer memory plan (per device, before anything is allocated):\n%s", label,
                     plan.table())
    if not main:
        for path in checkpoints.values():
            with contextlib.closing(preset_trainer_logprobs(path, preset)) as follower:
                follower.serve()
        return None
    return evaluate({label: functools.partial(preset_trainer_logprobs, path, preset)
                     for label, path in checkpoints.items()}, shards_dir, cfg, out_dir)


# ---- Flyte task: resources only; the logic is evaluate_checkpoints() / evaluate() above -----

from flytekit import Cache, Deck, task  # noqa: E402

from tasks.caching import (  # noqa: E402
    HashedDir, as_output, elastic_kwargs, stage_version, hf_export, manifest_sha256, resource_kwargs, stage_output_dir,
)
from tasks.presets import ParallelSpec, active_preset  # noqa: E402


EVALUATE_VERSION = stage_version("evaluate", active_preset())
# The engine scores in one process (spread over the task's GPUs); the trainer in its layout.
_LAYOUT = active_preset().infer_parallel if active_preset().evaluate.scorer == "trainer" else ParallelSpec()


@task(cache=Cache(version=EVALUATE_VERSION), enable_deck=True, **elastic_kwargs(_LAYOUT),
      **resource_kwargs(active_preset().infer_resources))
def evaluate_task(shards: HashedDir, checkpoints: list[HashedDir], labels: list[str]) -> HashedDir:
    """Flyte wrapper of :func:`evaluate_checkpoints` (labels name the checkpoints, first = baseline).

    Each checkpoint is an HF export or a stage output holding one in ``hf/`` (SFT, RL); cached on
    their content, so the nightly evaluation reruns exactly when the latest checkpoint changed.
    With the trainer scorer on a preset whose ``infer_parallel`` has several ranks this is a
    kfpytorch ``Elastic`` job of that layout (``infer_resources`` per replica); rank 0's output
    comes back.
    """
    preset = active_preset()
    out = stage_output_dir("evaluate", EVALUATE_VERSION, shards=manifest_sha256(shards), labels=labels,
                           checkpoints=[manifest_sha256(c) for c in checkpoints])
    paths = {label: hf_export(ckpt.download()) for label, ckpt in zip(labels, checkpoints, strict=True)}
    result = evaluate_checkpoints(paths, shards.download(), preset, out)
    if result is not None:
        Deck("evaluate", (out / "deck.html").read_text())
    return as_output(out)
