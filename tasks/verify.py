"""Verify that the inference engine scores sequences as the trainer does, by context length.

RL corrects for the gap between the policy that sampled (the engine) and the policy being
trained (the trainer's forward) with importance weights; a large gap makes those weights
noisy, and a gap that grows with context is a defect of one side's long-context path. This
stage measures it before a checkpoint is served or used for RL:

1. Sample ``windows_per_length`` windows of each length ``L`` from the held-out split's
   shards (seeded random offsets inside a shard).
2. Score every window with each leg: ``log p(x[t + 1] | x[: t + 1])`` for all ``t`` (every
   position, N and ``<sep>`` included: this is a numerics check, not a loss), from the
   trainer (Megatron forward, the SFT code, in the training parallel layout on the GPU presets:
   :func:`verify_checkpoint`), the engine (vLLM), and optionally a reference (transformers), so a
   mismatch is pinned on one side.
3. Per pair of legs and **prior-context bucket** (each token by its own prior context, the
   number of tokens before it in its window: ``[0, 1k), [1k, 2k), [2k, 4k), ...``): mean, p99
   and max of ``|diff|``, the token count, and the worst windows with the position of their
   largest difference (on hybrid models outliers concentrate in a few sequences: the mean
   alone hides them). Bucketing tokens, not windows, keeps a defect that appears only at long
   prior context from being averaged with the window's short-context tokens.
4. Gate: every compared bucket of every pair must have mean and p99 under the preset's
   thresholds (float32 CPU: mean 1e-4; bf16: mean 0.05, SkyRL's CI bound). A failure raises
   :class:`VerifyGateError` whose message holds the table and names the failing buckets.

A leg may be capped (``leg_max_tokens``): transformers' glm5_next builds ``T x T`` DSA masks,
so its leg stops at 16k tokens; longer buckets are compared without it, and the report says
so. Nothing is compared silently less than asked: a bucket no pair can cover is an error.

Sources: the trainer/vLLM gap study of the reference run (0.04-0.07 mean |diff| at
128k-1M in bf16) and SkyRL's log-prob consistency CI (mean |diff| < 0.05).
"""

from __future__ import annotations

import base64
import html
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from tasks.atomic import atomic_output_dir
from tasks.engines import LogProbSource
from tasks.evaluate import ShardStreams, Window, split_shards

log = logging.getLogger("megabase.verify")

SCHEMA = "megabase.verify/1"
LEGS = ("trainer", "engine", "reference")
PAIRS = (("trainer", "engine"), ("trainer", "reference"), ("engine", "reference"))

__all__ = ["VerifyConfig", "VerifyError", "VerifyGateError", "VerifyResult", "context_label", "format_table",
           "sample_windows", "verify", "verify_checkpoint"]


class VerifyError(ValueError):
    """Invalid verify input: no shard long enough, a bucket no pair of legs can cover, bad shapes."""


class VerifyGateError(RuntimeError):
    """The log-prob gap exceeds the preset's thresholds; ``report`` holds every number."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class VerifyConfig:
    """Every verify knob.

    Attributes:
        context_lengths: tokens per sampled window (window lengths; a leg cap applies to them).
        windows_per_length: windows sampled per length.
        context_buckets: lower edges (tokens of prior context, starting at 0) of the buckets
            every scored token falls in by its own prior context.
        mean_abs_diff_max: gate on the mean |diff| per bucket, nats/token.
        p99_abs_diff_max: gate on the 99th percentile |diff| per bucket, nats/token.
        leg_max_tokens: longest window a leg ("trainer", "engine", "reference") is run on;
            absent = no cap.
        worst_windows: windows listed per bucket and pair in the report.
        split: shard split sampled ("eval": held out).
        seed: window sampling seed.
    """

    context_lengths: tuple[int, ...]
    windows_per_length: int = 2
    context_buckets: tuple[int, ...] = (0,) + tuple(1 << k for k in range(10, 21))
    mean_abs_diff_max: float = 1e-4
    p99_abs_diff_max: float = 1e-3
    leg_max_tokens: Mapping[str, int] = field(default_factory=dict)
    worst_windows: int = 3
    split: str = "eval"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.context_lengths or min(self.context_lengths) < 2:
            raise VerifyError(f"context_lengths={self.context_lengths}: need lengths of at least 2 tokens")
        if self.windows_per_length < 1:
            raise VerifyError(f"windows_per_length={self.windows_per_length}: need at least 1")
        edges = self.context_buckets
        if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
            raise VerifyError(f"context_buckets={edges}: need strictly increasing lower edges starting at 0")
        if unknown := set(self.leg_max_tokens) - set(LEGS):
            raise VerifyError(f"leg_max_tokens names unknown legs {sorted(unknown)}; legs are {LEGS}")


def sample_windows(shards_dir: str | os.PathLike, context_lengths: tuple[int, ...], windows_per_length: int,
                   seed: int = 0, split: str = "eval") -> dict[int, list[Window]]:
    """Random windows of each length, inside single shards of the split (seeded, reproducible).

    A shard is drawn with probability proportional to its number of possible start offsets,
    then a uniform offset in it.

    Raises:
        VerifyError: no shard of the split holds a window of some length.
    """
    shards_dir = Path(shards_dir)
    shards = split_shards(shards_dir, split)
    rng = np.random.default_rng(seed)
    picks: dict[int, list[tuple[str, int]]] = {}
    for length in context_lengths:
        starts = np.array([max(s["tokens"] - length + 1, 0) for s in shards], dtype=np.float64)
        if not starts.sum():
            longest = max((s["tokens"] for s in shards), default=0)
            raise VerifyError(f"{shards_dir}: no {split} shard holds a {length}-token window (longest {longest})")
        chosen = rng.choice(len(shards), size=windows_per_length, p=starts / starts.sum())
        picks[length] = [(shards[i]["path"], int(rng.integers(0, starts[i]))) for i in chosen]
    streams = {path: ShardStreams(shards_dir, path) for path in sorted({p for pl in picks.values() for p, _ in pl})}
    windows = {length: [streams[shard].window(offset, length) for shard, offset in pl] for length, pl in picks.items()}
    return windows


def _score(source: LogProbSource, leg: str, window: Window) -> np.ndarray:
    (lp,) = source.prompt_logprobs([window.tokens.astype(np.int64)])
    lp = np.asarray(lp, dtype=np.float64)
    if lp.shape != (len(window.tokens) - 1,):
        raise VerifyError(f"{leg} ({source.description}) returned shape {lp.shape} for a "
                          f"{len(window.tokens)}-token window, expected ({len(window.tokens) - 1},)")
    return lp


def context_label(lo: int, hi: int | None) -> str:
    """``[1k, 2k)``-style label of a prior-context bucket (``hi`` None: unbounded)."""
    def short(n: int) -> str:
        return f"{n >> 20}M" if n and n % (1 << 20) == 0 else f"{n >> 10}k" if n and n % 1024 == 0 else str(n)
    return f"[{short(lo)}, {short(hi) if hi is not None else 'inf'})"


def _context_buckets(diffs: list[np.ndarray], windows: list[Window], cfg: VerifyConfig) -> list[dict]:
    """Statistics of one pair's ``|diff|`` per prior-context bucket.

    ``diffs[i][t]`` belongs to the prediction of token ``t + 1`` of window ``i``, whose prior
    context is ``t + 1`` tokens. Buckets no token reaches are left out.
    """
    edges = list(cfg.context_buckets)
    out = []
    for lo, hi in zip(edges, edges[1:] + [None]):
        parts, owners = [], []
        for i, d in enumerate(diffs):
            chosen = d[max(lo, 1) - 1 : (hi - 1 if hi is not None else None)]   # d[t]: context t + 1
            if chosen.size:
                parts.append(chosen)
                owners.append(i)
        if not parts:
            continue
        flat = np.concatenate(parts)
        mean, p99, worst = float(flat.mean()), float(np.percentile(flat, 99)), float(flat.max())
        ranked = sorted(range(len(parts)), key=lambda j: -parts[j].max())[: cfg.worst_windows]
        out.append({
            "context": context_label(lo, hi), "context_lo": lo, "context_hi": hi,
            "windows": len(parts), "tokens": int(flat.size),
            "mean_abs_diff": mean, "p99_abs_diff": p99, "max_abs_diff": worst,
            "passed": bool(mean <= cfg.mean_abs_diff_max and p99 <= cfg.p99_abs_diff_max),
            "worst_windows": [{
                **windows[owners[j]].provenance(),
                "window_tokens": len(windows[owners[j]].tokens),
                # position of the predicted token inside the window (its prior context length)
                "position": max(lo, 1) + int(parts[j].argmax()),
                "max_abs_diff": float(parts[j].max()),
                "mean_abs_diff": float(parts[j].mean()),
            } for j in ranked],
        })
    return out


@dataclass(frozen=True)
class VerifyResult:
    """The report (content of ``verify.json``) and where it was written, if anywhere."""

    passed: bool
    report: dict = field(repr=False)
    out_dir: Path | None = None


def verify(trainer: LogProbSource, engine: LogProbSource, shards_dir: str | os.PathLike, cfg: VerifyConfig,
           reference: LogProbSource | None = None, out_dir: str | os.PathLike | None = None) -> VerifyResult:
    """Compare per-token log-probs of the trainer, the engine and optionally a reference.

    Args:
        trainer: the trainer's forward (:class:`tasks.engines.TrainerLogProbs`) or any log-prob source.
        engine: the inference engine (``tasks.engines``).
        shards_dir: pack output directory; windows come from ``cfg.split``.
        cfg: lengths, windows, thresholds, leg caps.
        reference: third leg (transformers), or None for the two-way check.
        out_dir: where ``verify.json``, ``verify_diff_by_length.png`` and ``deck.html`` go
            (written atomically, also when the gate fails); None writes nothing.

    Returns:
        :class:`VerifyResult` (``passed`` is True: a failing gate raises).

    Raises:
        VerifyGateError: a bucket's mean or p99 |diff| exceeds its threshold; the message holds
            the table and names the failing buckets and pairs.
        VerifyError: no window fits, a length no pair can compare, or a bad log-prob shape.
    """
    legs = {"trainer": trainer, "engine": engine, "reference": reference}
    legs = {name: src for name, src in legs.items() if src is not None}
    caps = {name: cfg.leg_max_tokens.get(name) for name in legs}
    notes = []
    for name, cap in caps.items():
        if cap is not None and any(length > cap for length in cfg.context_lengths):
            notes.append(f"{name} leg ({legs[name].description}) capped at {cap:,} tokens: longer lengths "
                         f"{[L for L in cfg.context_lengths if L > cap]} are compared without it")
    windows = sample_windows(shards_dir, cfg.context_lengths, cfg.windows_per_length, cfg.seed, cfg.split)

    pair_diffs: dict[str, tuple[list[np.ndarray], list[Window]]] = {}
    active_legs = {length: [name for name in legs if caps[name] is None or length <= caps[name]]
                   for length in cfg.context_lengths}
    bar = tqdm(total=sum(len(active_legs[n]) * len(windows[n]) for n in cfg.context_lengths), desc="verify",
               unit="window", disable=None)
    for length in cfg.context_lengths:
        active = active_legs[length]
        compared = [(a, b) for a, b in PAIRS if a in active and b in active]
        if not compared:
            raise VerifyError(f"no pair of legs runs {length}-token windows (caps {caps}); lower the length or lift a cap")
        scores = {}
        for name in active:
            bar.set_postfix(leg=name, tokens=length)
            scores[name] = []
            for w in windows[length]:
                scores[name].append(_score(legs[name], name, w))
                bar.update()
        for a, b in compared:
            diffs, owners = pair_diffs.setdefault(f"{a} vs {b}", ([], []))
            diffs += [np.abs(x - y) for x, y in zip(scores[a], scores[b])]
            owners += windows[length]
            log.info("verify %d-token windows, %s vs %s: mean |diff| %.2e", length, a, b,
                     float(np.mean(np.concatenate(diffs[-len(windows[length]):]))))
    bar.close()
    pairs = {pair: _context_buckets(diffs, owners, cfg) for pair, (diffs, owners) in pair_diffs.items()}

    failed = [(pair, b) for pair, buckets in pairs.items() for b in buckets if not b["passed"]]
    report = {
        "schema": SCHEMA,
        "passed": not failed,
        "config": {**asdict(cfg), "leg_max_tokens": dict(cfg.leg_max_tokens)},
        "shards_dir": str(Path(shards_dir).absolute()),
        "legs": {name: src.description for name, src in legs.items()},
        "notes": notes,
        "pairs": pairs,
    }
    table = format_table(report)
    if out_dir is not None:
        with atomic_output_dir(out_dir) as work:
            (work / "verify.json").write_text(json.dumps(report, indent=1))
            (work / "table.txt").write_text(table + "\n")
            png = plot_diff_by_length(report, work / "verify_diff_by_length.png")
            (work / "deck.html").write_text(deck_html(report, table, png))
    if failed:
        reasons = "; ".join(
            f"prior context {b['context']} ({pair}): mean |diff| {b['mean_abs_diff']:.3e} "
            f"(max allowed {cfg.mean_abs_diff_max:.0e}), p99 {b['p99_abs_diff']:.3e} (max allowed {cfg.p99_abs_diff_max:.0e})"
            for pair, b in failed)
        raise VerifyGateError(f"verify failed: {reasons}\n{table}", report)
    return VerifyResult(True, report, Path(out_dir) if out_dir is not None else None)


def format_table(report: dict) -> str:
    """Plain-text table: one row per pair and context length, the worst window of each, notes."""
    head = f"{'pair':<22}{'prior context':>15}{'windows':>8}{'tokens':>10}{'mean':>11}{'p99':>11}{'max':>11}  gate   worst window (shard@offset, position)"
    lines = [head, "-" * len(head)]
    for pair, buckets in report["pairs"].items():
        for b in buckets:
            w = b["worst_windows"][0]
            lines.append(
                f"{pair:<22}{b['context']:>15}{b['windows']:>8}{b['tokens']:>10,}{b['mean_abs_diff']:>11.2e}"
                f"{b['p99_abs_diff']:>11.2e}{b['max_abs_diff']:>11.2e}  {'pass' if b['passed'] else 'FAIL'}   "
                f"{w['shard']}@{w['offset']} pos {w['position']:,} ({w['record']}{w['strand']}{w['start']:,})")
    lines += [f"legs: {name} = {desc}" for name, desc in report["legs"].items()]
    lines += [f"note: {note}" for note in report["notes"]]
    return "\n".join(lines)


def plot_diff_by_length(report: dict, path: Path) -> Path:
    """PNG: mean, p99 and max |diff| vs prior context per pair (log-log; a bucket at its upper edge), with the gate.

    Raises:
        ImportError: matplotlib is not installed (the plot is an output, never skipped).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (pair, buckets), color in zip(report["pairs"].items(), ("C0", "C1", "C2")):
        x = [b["context_hi"] or 2 * b["context_lo"] for b in buckets]
        for stat, style in (("mean_abs_diff", "-o"), ("p99_abs_diff", "--^"), ("max_abs_diff", ":x")):
            ax.plot(x, [max(b[stat], 1e-12) for b in buckets], style, color=color,
                    label=f"{pair} {stat.split('_')[0]}")
    cfg = report["config"]
    ax.axhline(cfg["mean_abs_diff_max"], color="red", linewidth=0.8, label="mean gate")
    ax.axhline(cfg["p99_abs_diff_max"], color="red", linewidth=0.8, linestyle="--", label="p99 gate")
    ax.set(xscale="log", yscale="log", xlabel="prior context (tokens, bucket upper edge)", ylabel="|log p diff| (nats/token)",
           title="verify: trainer vs engine log-prob gap")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def deck_html(report: dict, table: str, png: Path) -> str:
    """HTML snippet for a Flyte Deck: verdict, plot, table."""
    image = base64.b64encode(png.read_bytes()).decode()
    verdict = "passed" if report["passed"] else "FAILED"
    return (f"<h3>verify {verdict}</h3><img src=\"data:image/png;base64,{image}\" style=\"max-width:100%\">"
            f"<pre>{html.escape(table)}</pre>")


def verify_checkpoint(checkpoint_dir: str | os.PathLike, shards_dir: str | os.PathLike, preset,
                      out_dir: str | os.PathLike, three_way: bool = False) -> VerifyResult | None:
    """Verify one HF export with a preset's engine, lengths and thresholds (the Flyte task's body).

    The trainer leg is :func:`tasks.engines.preset_trainer_logprobs`, built on every rank of the
    job in ``preset.infer_parallel`` (one process on the CPU presets; TP x CP ranks of an elastic
    job on the GPU presets). Rank 0 also holds the engine leg (``preset.engine``; on a GPU
    tensor-parallel over its node's GPUs, with ``preset.verify.engine_gpu_memory_fraction`` of
    each), runs :func:`verify` and writes the report; the other ranks score their CP slices of
    rank 0's windows until it is done. With ``three_way`` transformers is the reference leg (when
    the engine is not transformers already). Every transformers leg on a glm5_next export is
    capped at ``preset.verify.transformers_max_tokens`` (``T x T`` DSA masks), and the report says so.

    Before anything is built, the trainer leg's forward memory plan at the longest window
    (:func:`tasks.memory_plan.scoring_memory_plan`, the engine's share of the GPU included) is
    computed on every rank, printed by rank 0, and refused when it does not fit.

    Returns:
        The :class:`VerifyResult` on rank 0; None on the other ranks.

    Raises:
        VerifyGateError, VerifyError: see :func:`verify`.
        tasks.memory_plan.MemoryPlanError: the trainer leg does not fit the device.
    """
    from model.config import from_hf
    from tasks.engines import make_engine, preset_trainer_logprobs, serving_kwargs
    from tasks.memory_plan import scoring_memory_plan

    spec = preset.verify
    hf_config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    legs = {"engine": preset.engine} | ({"reference": "transformers"} if three_way and preset.engine != "transformers" else {})
    caps = {leg: spec.transformers_max_tokens for leg, name in legs.items()
            if name == "transformers" and hf_config.get("model_type") == "glm5_next"}
    cfg = VerifyConfig(context_lengths=spec.context_lengths, windows_per_length=spec.windows_per_length,
                       mean_abs_diff_max=spec.mean_abs_diff_max, p99_abs_diff_max=spec.p99_abs_diff_max,
                       leg_max_tokens=caps, worst_windows=spec.worst_windows)
    longest = lambda leg: min([max(spec.context_lengths)] + ([caps[leg]] if leg in caps else []))  # noqa: E731
    plan = scoring_memory_plan(from_hf(hf_config), preset, longest("trainer"), with_engine=True)
    if int(os.environ.get("RANK", 0)) == 0:
        log.info("verify trainer leg memory plan (per device, before anything is allocated):\n%s", plan.table())
    trainer = preset_trainer_logprobs(checkpoint_dir, preset)
    try:
        if not trainer.is_main:
            trainer.serve()
            return None
        engine_kwargs = ({"chunked_prefill": True, "max_num_batched_tokens": spec.engine_step_tokens}
                         if legs["engine"] == "vllm" else {}) | serving_kwargs(
            legs["engine"], preset.infer_resources.gpu, spec.engine_gpu_memory_fraction)
        with make_engine(legs["engine"], checkpoint_dir, spec.dtype, longest("engine"), **engine_kwargs) as engine:
            if "reference" not in legs:
                return verify(trainer, engine, shards_dir, cfg, None, out_dir)
            with make_engine("transformers", checkpoint_dir, spec.dtype, longest("reference")) as reference:
                return verify(trainer, engine, shards_dir, cfg, reference, out_dir)
    finally:
        trainer.close()


# ---- Flyte task: resources only; the logic is verify_checkpoint() / verify() above ----------

from flytekit import Cache, Deck, task  # noqa: E402

from tasks.caching import (  # noqa: E402
    HashedDir, as_output, elastic_kwargs, stage_version, hf_export, manifest_sha256, resource_kwargs, stage_output_dir,
)
from tasks.presets import active_preset  # noqa: E402
from tasks.trainer import finish_parallel  # noqa: E402


VERIFY_VERSION = stage_version("verify", active_preset())


@task(cache=Cache(version=VERIFY_VERSION), enable_deck=True, **elastic_kwargs(active_preset().infer_parallel),
      **resource_kwargs(active_preset().infer_resources))
def verify_task(shards: HashedDir, checkpoint: HashedDir, three_way: bool = False) -> HashedDir:
    """Flyte wrapper of :func:`verify_checkpoint`; a failing gate fails the task (table in the message).

    ``checkpoint`` is an HF export or a stage output holding one in ``hf/`` (SFT, RL). On a preset
    whose ``infer_parallel`` has several ranks this is a kfpytorch ``Elastic`` job of that layout
    (``infer_resources`` per replica); every worker runs the trainer leg and rank 0's output
    comes back.
    """
    preset = active_preset()
    out = stage_output_dir("verify", VERIFY_VERSION, shards=manifest_sha256(shards),
                           checkpoint=manifest_sha256(checkpoint), three_way=three_way)
    result = verify_checkpoint(hf_export(checkpoint.download()), shards.download(), preset, out, three_way)
    if result is not None:
        Deck("verify", (out / "deck.html").read_text())
    finish_parallel()
    return as_output(out)


def main(argv: list[str] | None = None) -> None:
    """``torchrun --nproc-per-node N -m tasks.verify CHECKPOINT PACK_DIR OUT_DIR [--preset NAME] [--engine NAME]
    [--infer-parallel JSON] [--three-way]``: :func:`verify_checkpoint` outside Flyte, the trainer leg in the
    preset's ``infer_parallel`` (or the JSON object of :class:`tasks.presets.ParallelSpec` fields given)."""
    import argparse
    import dataclasses

    from tasks.presets import ParallelSpec, get_preset

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("pack_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--preset", default="local-cpu")
    parser.add_argument("--engine", default=None, help="engine leg instead of the preset's (vllm | transformers)")
    parser.add_argument("--infer-parallel", default=None, help="JSON object of ParallelSpec fields")
    parser.add_argument("--three-way", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    preset = get_preset(args.preset)
    if args.engine:
        preset = dataclasses.replace(preset, engine=args.engine)
    if args.infer_parallel:
        preset = dataclasses.replace(preset, infer_parallel=ParallelSpec(**json.loads(args.infer_parallel)))
    verify_checkpoint(args.checkpoint, args.pack_dir, preset, args.out_dir, args.three_way)
    finish_parallel()


if __name__ == "__main__":
    main()
