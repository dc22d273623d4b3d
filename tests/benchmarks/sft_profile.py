"""Whole-step profile of SFT on one GPU: step time, MFU, GPU kernel time by family, host-idle share.

One process, in this order: the anchor (a bf16 8192^3 matmul, median of events), then per
configuration of ``tests/gpu/sft_small.py``'s ``CONFIGS`` (``small`` preset, bf16, real shards)
the SFT run of :func:`tasks.sft.train_step`: ``--steps`` timed steps (the first compiles and
autotunes: reported as the first step), one untimed step under torch's CUDA sync debug mode (where
the host waits on the device: :func:`host_syncs`), then ``--profile-steps`` steps under
``torch.profiler``.
Run on the device machine (``PARTS=profile bash tests/gpu/session.sh``)::

    python tests/benchmarks/sft_profile.py --pack runs/sft_gpu_pack --configs 64k --out $OUT/sft_profile.json
    python tests/benchmarks/sft_profile.py ... --moe-experts sequential grouped   # both MoE expert paths, one process
    python tests/benchmarks/sft_profile.py ... --compile-glue off on              # eager vs fused glue, one process
    python tests/benchmarks/sft_profile.py ... --dsa-dkv query pool               # sparse MLA dkv per query / per k-pool
    python tests/benchmarks/sft_profile.py ... --variants "" "kda_conv=torch,moe_permute=megatron"   # any SFTConfig fields
    python tests/benchmarks/sft_profile.py --table sft_profile.json               # the table of a saved run, no GPU

Printed per configuration: the median unprofiled step time after the first, tokens/s, MFU from the
stage's own ``model_flops_per_token`` against the 989 TF/s datasheet peak and against the matmul
rate measured in the same process, the share of GPU kernel time per family (:data:`FAMILIES`, by
kernel name; memcpy/memset count as copy/cast) with its milliseconds per step, and the host-idle
share: the fraction of the profiled steps' wall time (first step start to last kernel end) in which
no kernel, copy or fill runs on the GPU. The profiler itself adds host time, so the idle share is
an upper bound for the unprofiled steps; the profiled step time is printed next to it. ``--out``
gets everything as JSON, with the 40 kernels of most time and their families.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "gpu"))

from flyte_standin import install_flytekit_stand_in  # noqa: E402
from sft_small import CONFIGS, sft_config  # noqa: E402

DATASHEET_TFLOPS = 989.0   # H100/H200 SXM dense bf16 (tasks.trainer.PEAK_BF16_TFLOPS)

# Kernel families, first match wins (so the project's and fla's Triton kernels come before the
# generic names: fla's kernels hold "reduce" or "cumsum" too). Patterns match torch's, cuBLAS's,
# CUTLASS's, Triton's and inductor's (triton_poi_ / triton_red_ / triton_per_) kernel names.
FAMILIES: list[tuple[str, str]] = [
    ("sparse MLA fwd", r"sparse_mla_fwd"),
    # the Triton backward (per query, runs, the runs' scan), the Gluon query and latent gradients, rowsum(dO O)
    ("sparse MLA bwd", r"sparse_mla_(bwd|dq|dkv|delta)|run_scan"),
    ("DSA indexer", r"pool_scores|select_kernel|expand_kernel|compress_kernel|sparse_mla_mass|indexer_kl"),
    ("KDA/fla", r"chunk_|kda|delta_rule|solve_tril|cumsum_|l2norm|wy_|causal_conv1d|recompute_w_u|kkt"),
    # the mHC kernels of kernels/hc: the projection, the maps (gates and Sinkhorn-Knopp), the merge's backward
    ("mHC", r"^hc_(projection|maps|merge)_"),
    # torch.compile's fused glue (mHC collapse/merge forward, norms, gates, SwiGLU): pointwise, reduction and
    # persistent-reduction kernels, whose names also hold the ops they fuse ("_to_copy", "sum").
    ("inductor glue", r"^triton_(poi|red|per)_"),
    ("GEMM", r"gemm|gemv|cutlass|wmma|xmma|cublas|nvjet|matmul|_mm_|grouped_mm|Kernel2|splitK"),
    ("copy/cast", r"copy|Memcpy|Memset|CatArrayBatched|cat_|memcpy|memset"),
    ("gather/scatter", r"index|gather|scatter|embedding|Embedding|sort|radix|topk|take|put_|masked_select"),
    ("reduce", r"reduce|Reduce|softmax|SoftMax|norm|Norm|nll|cross_entropy|sum_|mean_"),
    ("elementwise", r"elementwise|vectorized|unrolled|multi_tensor_apply|fill|foreach"),
]
_COMPILED = [(name, re.compile(pattern)) for name, pattern in FAMILIES]
FAMILY_NAMES = [name for name, _ in FAMILIES] + ["other"]


def kernel_family(name: str) -> str:
    """The family of a GPU kernel (or ``Memcpy``/``Memset`` activity) from its name."""
    return next((family for family, pattern in _COMPILED if pattern.search(name)), "other")


def matmul_tflops(size: int = 8192, reps: int = 20) -> float:
    """bf16 ``size^3`` matmul rate, TFLOP/s: median over ``reps`` event-timed products on random data."""
    import torch

    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * size**3 / statistics.median(times) / 1e12


def host_syncs(step):
    """Run ``step()`` with torch's CUDA sync debug mode on: ``(its result, the synchronising call sites)``.

    Every operation that makes the host wait for the device (``.item()``/``float()`` of a device
    tensor, a blocking copy, ``nonzero``...) warns; each warning is attributed to the innermost frame
    of the Python stack outside torch (the project's, megatron's or fla's line that called it). Syncs
    inside a backward are reported at the ``backward()`` call. Sites: ``[{"site", "count"}]``, most
    frequent first.
    """
    import collections
    import traceback
    import warnings

    import torch

    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if f"{os.sep}torch{os.sep}" not in f.filename and not f.filename.endswith("warnings.py")]
        site = frames[-1] if frames else None
        where = "?" if site is None else f"{'/'.join(Path(site.filename).parts[-2:])}:{site.lineno} {site.name}"
        sites[where] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, [{"site": where, "count": n} for where, n in sites.most_common()]


def _union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``[start, end)`` intervals clipped to ``[lo, hi)`` (same units)."""
    total, reach = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total += end - start
            reach = end
    return total


def trace_summary(trace: dict, steps: int) -> dict:
    """Kernel time by family and the host-idle share of a chrome trace of ``steps`` profiled steps.

    ``trace``: ``torch.profiler`` chrome-trace JSON whose steps are ``record_function("sft_step")``
    ranges (timestamps in microseconds, GPU activity on the host clock).
    """
    events = trace["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    marks = [e for e in events if e.get("ph") == "X" and e.get("name") == "sft_step"
             and e.get("cat") in ("user_annotation", "cpu_op")]
    if not gpu or not marks:
        raise RuntimeError(f"trace holds {len(gpu)} GPU activities and {len(marks)} sft_step ranges; need both")
    lo = min(e["ts"] for e in marks)
    hi = max(max(e["ts"] + e["dur"] for e in marks), max(e["ts"] + e["dur"] for e in gpu))
    busy = _union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu], lo, hi)
    by_family = dict.fromkeys(FAMILY_NAMES, 0.0)
    by_kernel: dict[str, list] = {}
    for e in gpu:
        name = e["name"]
        by_family[kernel_family(name)] += e["dur"]
        slot = by_kernel.setdefault(name, [0.0, 0])
        slot[0] += e["dur"]
        slot[1] += 1
    kernel_total = sum(by_family.values())
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:40]
    return {
        "profiled_step_s": (hi - lo) / 1e6 / steps,
        "gpu_busy_s_per_step": busy / 1e6 / steps,
        "host_idle_share": 1 - busy / (hi - lo),
        "kernel_s_per_step": kernel_total / 1e6 / steps,
        "launches_per_step": len(gpu) / steps,
        "families": {f: {"share": t / kernel_total, "ms_per_step": t / 1e3 / steps} for f, t in by_family.items()},
        "top_kernels": [{"name": n[:200], "family": kernel_family(n), "ms_per_step": t / 1e3 / steps,
                         "calls_per_step": c / steps} for n, (t, c) in top],
    }


def parse_variant(text: str) -> dict:
    """``"field=value,field=value"`` -> SFTConfig overrides, each value parsed as its field's type.

    Raises:
        ValueError: a field SFTConfig does not have, or an entry without ``=``.
    """
    from tasks.sft import SFTConfig

    fields = {f.name: f for f in dataclasses.fields(SFTConfig)}
    overrides = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"variant entry {item!r}: expected field=value with a SFTConfig field")
        # annotations are strings (postponed evaluation): map the scalar ones, the rest stay str
        kind = {"bool": bool, "int": int, "float": float}.get(str(fields[key].type), str)
        overrides[key] = value.lower() in ("1", "true", "on") if kind is bool else kind(value)
    return overrides


def profile_config(name: str, pack: str, steps: int, profile_steps: int, anchor: float, moe_experts: str,
                   compile_glue: bool = True, trace_out: Path | None = None, dsa_dkv: str = "auto",
                   variant: str = "") -> dict:
    """Timed and profiled SFT steps of configuration ``name`` with the routed-expert path ``moe_experts``
    (:mod:`model.moe`), the layers' glue fused or eager (``compile_glue``, :mod:`model.fused`) and the
    sparse MLA backward's ``dsa_dkv`` and the ``variant``'s further overrides (:func:`parse_variant`)
    (:class:`tasks.sft.SFTConfig`); the chrome trace gzipped to ``trace_out`` when it is under 15 MiB compressed (what the device machine
    sends back)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from tasks.sft import SFTRun, train_step
    from tasks.trainer import ManualGC

    cfg = dataclasses.replace(sft_config(name, steps + 1 + profile_steps), moe_experts=moe_experts,
                              compile_glue=compile_glue, dsa_dkv=dsa_dkv, **parse_variant(variant))
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    run = SFTRun.start(pack, cfg, Path(tempfile.mkdtemp(prefix=f"sft_profile_{name}_")))
    records = []
    with ManualGC(cfg.gc_interval) as collector:
        for _ in range(steps):
            records.append(train_step(run))
            run.emit(records[-1])
            collector.step(run.step)
        # One more step, untimed, with the host's waits on the device reported by call site.
        audited, syncs = host_syncs(lambda: train_step(run))
        run.emit(audited)
        collector.step(run.step)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(profile_steps):
                with record_function("sft_step"):
                    records.append(train_step(run))
                collector.step(run.step)
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        text = Path(f.name).read_bytes()
        summary = trace_summary(json.loads(text), profile_steps)
    if trace_out is not None:
        packed = gzip.compress(text, 1)
        if len(packed) < 15 * 2**20:
            trace_out.write_bytes(packed)
    # Device time per aten op (kernels attributed to the op that launched them): which op an
    # fp32 GEMM or a cast comes from, which the kernel names do not say.
    ops = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                 key=lambda e: -e.self_device_time_total)[:30]
    summary["top_ops"] = [{"op": e.key, "ms_per_step": e.self_device_time_total / 1e3 / profile_steps,
                           "calls_per_step": e.count / profile_steps} for e in ops]
    timed = [r["step_time_s"] for r in records[1:steps]] or [records[0]["step_time_s"]]
    step_s = statistics.median(timed)
    tokens_per_s = cfg.seq_len / step_s
    flops_per_token = run.flops_per_token
    row = {
        "config": name, "moe_experts": moe_experts, "compile_glue": compile_glue, "dsa_dkv": dsa_dkv,
        "variant": variant,
        "seq_len": cfg.seq_len, "step_s": step_s,
        "step_times_s": [r["step_time_s"] for r in records], "first_step_s": records[0]["step_time_s"],
        "tokens_per_s": tokens_per_s, "flops_per_token": flops_per_token,
        "model_tflops": flops_per_token * tokens_per_s / 1e12,
        "mfu_datasheet": flops_per_token * tokens_per_s / (DATASHEET_TFLOPS * 1e12),
        "mfu_matmul": flops_per_token * tokens_per_s / (anchor * 1e12),
        "losses": [r["loss"] for r in records], "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "host_syncs_per_step": sum(site["count"] for site in syncs), "host_sync_sites": syncs,
        **summary,
    }
    del run, prof
    return row


def _label(row: dict) -> str:
    glue = {True: "fused", False: "eager"}.get(row.get("compile_glue", False))
    dkv = f" dkv/{row['dsa_dkv']}" if "dsa_dkv" in row else ""
    variant = f" [{row['variant']}]" if row.get("variant") else ""
    return f"{row['config']} {row['moe_experts']} {glue}{dkv}{variant}"


def table(anchor: float, rows: list[dict]) -> str:
    """The printed table: one column per profiled run."""
    heads = [_label(r) for r in rows]
    lines = [f"matmul anchor (bf16 8192^3, this process): {anchor:.0f} TF/s; datasheet {DATASHEET_TFLOPS:.0f} TF/s",
             "| | " + " | ".join(heads) + " |", "|---|" + "---|" * len(rows)]

    def add(label, fmt):
        lines.append(f"| {label} | " + " | ".join(fmt(r) for r in rows) + " |")

    add("step time (s, median unprofiled)", lambda r: f"{r['step_s']:.3f}")
    add("first step (s)", lambda r: f"{r['first_step_s']:.1f}")
    add("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}")
    add("model TF/s", lambda r: f"{r['model_tflops']:.1f}")
    add("MFU vs 989 TF/s", lambda r: f"{100 * r['mfu_datasheet']:.1f}%")
    add("MFU vs matmul anchor", lambda r: f"{100 * r['mfu_matmul']:.1f}%")
    add("profiled step (s)", lambda r: f"{r['profiled_step_s']:.3f}")
    add("GPU busy per step (s)", lambda r: f"{r['gpu_busy_s_per_step']:.3f}")
    add("host-idle share", lambda r: f"{100 * r['host_idle_share']:.1f}%")
    add("kernel launches per step", lambda r: f"{r['launches_per_step']:,.0f}")
    add("host waits on the device per step", lambda r: str(r.get("host_syncs_per_step", "-")))
    for family in FAMILY_NAMES:
        add(f"{family}", lambda r, f=family: f"{100 * r['families'][f]['share']:.1f}% "
                                            f"({r['families'][f]['ms_per_step']:.0f} ms)")
    add("peak GiB", lambda r: f"{r['peak_gib']:.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", help="pack output directory (python -m tasks prepare)")
    parser.add_argument("--configs", nargs="+", default=["64k"], choices=sorted(CONFIGS))
    parser.add_argument("--moe-experts", nargs="+", default=["grouped"], choices=["grouped", "sequential"],
                        help="routed-expert paths, each profiled for every configuration (model.moe)")
    parser.add_argument("--compile-glue", nargs="+", default=["on"], choices=["on", "off"],
                        help="layer glue fused by torch.compile (on) or eager (off), each profiled (model.fused)")
    parser.add_argument("--dsa-dkv", nargs="+", default=["auto"], choices=["auto", "pool", "query"],
                        help="sparse MLA dkv summed per k-pool or scattered per query, each profiled")
    parser.add_argument("--variants", nargs="+", default=[""],
                        help="SFTConfig overrides, each 'field=value,...' ('' = defaults), each profiled")
    parser.add_argument("--steps", type=int, default=4, help="unprofiled steps (the first compiles)")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--out", help="JSON file")
    parser.add_argument("--table", help="print the table of this saved --out JSON and exit")
    parser.add_argument("--trace-dir", default="", help="write each run's gzipped chrome trace here")
    parser.add_argument("--seed-compile-cache", action="store_true",
                        help="load the compiled glue shipped for this GPU first (tasks.caching.seed_compile_cache), "
                             "as SFT workers do")
    parser.add_argument("--save-compile-cache", default="",
                        help="write torch.compiler.save_cache_artifacts() of this process here, gzipped, at the end "
                             "(the file kernels/tunings/<gpu>.torch-<version>.inductor.bin.gz ships; from a device "
                             "call name it without '+', e.g. $OUT/inductor.bin.gz: the device drops such names)")
    args = parser.parse_args()
    if args.table:
        saved = json.loads(Path(args.table).read_text())
        print(table(saved["matmul_tflops"], saved["runs"]))
        return
    if not (args.pack and args.out):
        parser.error("--pack and --out are required to profile")
    if args.profile_steps < 1:   # the family table and host-idle share come from the profiled steps' trace
        parser.error(f"--profile-steps {args.profile_steps}: at least 1 step is profiled")
    install_flytekit_stand_in()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s: %(message)s")
    if args.seed_compile_cache:
        import torch

        from tasks.caching import compile_cache_path, seed_compile_cache

        gpu = torch.cuda.get_device_name()
        print(f"compile cache: {seed_compile_cache(gpu)} artifacts from {compile_cache_path(gpu, torch.__version__)}",
              flush=True)
    anchor = matmul_tflops()
    print(f"matmul anchor: {anchor:.0f} TF/s", flush=True)
    rows = []
    for name in args.configs:
        for i, (experts, glue, dkv, variant) in enumerate(
                [(e, g, d, v) for e in args.moe_experts for g in args.compile_glue for d in args.dsa_dkv
                 for v in args.variants]):
            started = time.perf_counter()
            trace = (Path(args.trace_dir, f"trace_{name}_{experts}_{glue}_{dkv}_{i}.json.gz")
                     if args.trace_dir else None)
            rows.append(profile_config(name, args.pack, args.steps, args.profile_steps, anchor, experts,
                                       glue == "on", trace, dkv, variant))
            rows[-1]["wall_s"] = time.perf_counter() - started
            Path(args.out).write_text(json.dumps({"matmul_tflops": anchor, "runs": rows}, indent=1))
            print(json.dumps({k: v for k, v in rows[-1].items()
                          if k not in ("top_kernels", "families", "top_ops", "host_sync_sites")}),
                  flush=True)
    for r in rows:
        print(f"\ntop kernels, {_label(r)} (ms per step, calls per step, family):")
        for k in r["top_kernels"][:15]:
            print(f"  {k['ms_per_step']:8.1f} {k['calls_per_step']:7.0f}  {k['family']:<15} {k['name'][:110]}")
        print(f"host waits on the device in one step, {_label(r)} (count, call site):")
        for site in r.get("host_sync_sites", []):
            print(f"  {site['count']:8d}  {site['site'][:110]}")
        print(f"top ops by device time, {_label(r)} (ms per step, calls per step):")
        for o in r["top_ops"][:15]:
            print(f"  {o['ms_per_step']:8.1f} {o['calls_per_step']:7.0f}  {o['op'][:110]}")
    if args.save_compile_cache:
        import torch

        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            Path(args.save_compile_cache).write_bytes(gzip.compress(saved[0], 9))
            print(f"compile cache: {sum(len(v) for v in saved[1].artifacts.values())} artifacts, "
                  f"{len(saved[0]) / 2**20:.1f} MiB -> {args.save_compile_cache}")
    print()
    print(table(anchor, rows))


if __name__ == "__main__":   # dist-checkpoint saves start a spawn Manager: the guard is required
    main()
