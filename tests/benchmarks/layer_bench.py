"""Full-width layer benchmark: one glm5_next layer of each kind, forward+backward as one rank of the
``b200-64`` layout on one GPU, and the 45-layer step on 64 B200 projected from it (issue 35, item 4).

What runs (one process; ``PARTS=layerbench bash tests/gpu/session.sh`` on one H200)::

    python tests/benchmarks/layer_bench.py --out $OUT/layer_bench.json              # 256k and 1M
    python tests/benchmarks/layer_bench.py --seq-lens 1048576 --iters 5             # one length
    python tests/benchmarks/layer_bench.py --dry-run                                 # CPU, tiny preset
    python tests/benchmarks/layer_bench.py --variant dsa_fwd=gluon                    # any SFTConfig fields
    python tests/benchmarks/layer_bench.py --device cpu --rows-from A.json B.json    # re-project saved rows

1. The anchor: a bf16 8192^3 matmul (``sft_profile.matmul_tflops``), TFLOP/s.
2. The model config exactly as SFT builds it for the training preset (``tasks.sft.model_config`` of
   ``preset_sft_config(b200-64)``: the ``full`` preset, bf16, full-layer recompute (each MLP
   chunk recomputed inside when a layer has several), every layer's input offloaded to pinned host
   memory, ``mlp_chunk_tokens`` 131,072, grouped MoE experts, fused glue). One layer of each (mixer,
   MLP, indexer) kind of its 45-layer schedule (KDA+dense x 3, KDA+MoE x 31, DSA+MoE x 11) is built
   from that config with ``model.glm5_next.layer_spec``, cast to bf16, and run through
   ``Glm5NextModel._layer_call`` (the model's own recompute and offload wrapper, one
   :class:`model.offload.OffloadChain` per call).
3. Per layer kind and sequence length ``seq``, the share of CP rank ``CP - 1`` (the last: its DSA
   queries see the most keys, and every layer ends at a collective that waits for it):
   ``seq / CP`` local tokens. ``CP`` is the memory plan's layout for that length (``--cp plan``,
   :func:`planned_cp`: the smallest power of two at which ``tasks.memory_plan`` fits the run on a B200;
   the rest of the 64 GPUs are data parallel): 16 at 256k and 64 at 1M for ``b200-64``, 16,384 local
   tokens each. ``--cp N`` fixes it (earlier runs measured 256k at the preset's CP = 64: 4,096 local tokens).

   * **CP, emulated on the real code path.** The mixers receive a :class:`EmulatedCP` (rank
     ``CP - 1`` of ``CP``, no process group) and, for the span of the run, ``all_gather_seq`` in
     :mod:`model.layers` and :mod:`model.parallel` is a local stand-in (:func:`emulated_cp_gathers`)
     that returns the full-length tensor a real all-gather returns, made of ``CP`` copies of the
     local shard (copies keep the values bounded: the KDA fold multiplies 63 transitions). So the
     DSA layer projects its local queries at offset ``(CP - 1) * seq / CP``, the lightning indexer
     scores them against the pooled keys of the whole sequence, the sparse MLA reads the
     full-length latent, and KDA runs ``KDAMixer._kda_context_parallel`` unchanged: the state pass
     with values ``[v | 0]``, the fold of ``CP - 1`` predecessor states, the output pass (about 2x
     the local KDA work). The stand-in's backward keeps this rank's chunk of the gradient without
     the all-reduce. Bytes of every gather and every all-reduce the real code would issue are
     logged and priced in the projection (step 5).
   * **EP, emulated by the local experts alone.** EP = 32 leaves 288 / 32 = 9 experts per GPU;
     the layer is built with those 9 experts and ``moe_router_topk`` 8 unchanged, so every local
     token sends 8 rows: the local experts receive ``local tokens x topk`` rows, the EP average,
     with the sigmoid router spreading them over 9 grouped-GEMM groups. Not modelled: expert-load
     imbalance across EP ranks, the router's 288-wide projection (9-wide here; 0.1% of the MoE
     FLOPs), and the ``allgather`` dispatcher's local permute of ``EP x local`` gathered tokens
     (only its communication is priced).
   * **Indexer KL loss** (the preset's ``indexer_kl_coeff``): the SFT hook
     (:class:`tasks.sft.IndexerKL`) on the DSA layer, popped and added to the loss before each
     backward as ``train_step`` does. Under full recompute the hook fires in the backward's
     recompute, so each timed iteration holds one KL forward and the previous KL's backward.

   Timed: ``--warmup`` untimed iterations (compilation, autotuning, the KL's steady state), then
   the median of ``--iters`` iterations, each synchronised wall time; on CUDA one more iteration
   under ``torch.profiler`` splits the time into tensor-core kernels, other kernels and device idle.
   Peak: ``torch.cuda.max_memory_allocated`` in the measurement (every benchmarked layer's weights
   and gradients are resident; the part above them is printed too). The embedding, final norm,
   output head and chunked loss (``Glm5NextModel`` with its layers removed) are timed the same way.
4. FLOPs: the per-layer split of ``tasks.trainer.model_flops_per_token`` (layer ``i``'s share is
   ``F(i + 1) - F(i)`` for the config truncated to its first ``i`` layers; the head's is
   ``6 x (vocab x hidden + hidden)``; the split sums to the whole model's). That is model FLOPs:
   forward + backward = 3 x forward, no recompute, the indexer at the sequence's mean key count,
   KDA once; the rank executes more (recompute, the last rank's indexer, the CP state pass).
5. Projection: step time per GPU = sum over the schedule's kinds of count x measured time, plus
   the head, each scaled from the GPU it ran on to B200 by the profiled split and the datasheets
   (on an H200: tensor-core kernel time x 989 / 2250 dense bf16 TF/s, other kernel time x 4.8 / 8
   TB/s HBM, device-idle time x 1; on an H100 the HBM ratio is 3.35 / 8, :func:`datasheet`), plus
   communication from bytes (NCCL ring model: an all-gather moves ``(R - 1) / R`` of its output per
   rank, an all-reduce twice that; a group that spans nodes runs at the per-GPU InfiniBand
   bandwidth, inside a node at NVLink's): the logged CP collectives, the MoE dispatcher's
   collectives (per MoE forward and backward counted in the run; the configured dispatcher, alltoall
   under EP, and the other one for comparison), and the distributed optimizer's
   gradient reduce-scatter and parameter all-gather. SFT issues the gradient reduce-scatter bucket by
   bucket during the backward (``overlap_grad_reduce``): up to 2/3 of the compute time of it leaves the
   step (:data:`BACKWARD_SHARE`); and the parameter all-gather bucket by bucket during the next
   forward (``overlap_param_gather``): up to the forward's share of it leaves the step (1/4 of the
   compute under full recompute, 1/3 without, :func:`forward_share`); every other collective is
   synchronous, so the step adds them. The compute-only time is the bound with perfect overlap. tokens/s =
   ``seq x DP / step`` beside the reference's 24,900 (256k) and 13,700 (1M) tokens/s on 64 B200.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import traceback
import time
import types
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "gpu"))

import torch  # noqa: E402

from flyte_standin import install_flytekit_stand_in  # noqa: E402
from model.parallel import CPContext, ParallelLayout  # noqa: E402

REFERENCE_TOKENS_PER_S = {262_144: 24_900.0, 1_048_576: 13_700.0}
"""GLM-5.3-Flash trained on 64 B200, tokens/s by tokens per sequence: the reference result the project
must beat (the design card; issue 35)."""
GOAL_RATIO = 3.0
H200 = {"name": "H200", "bf16_tflops": 989.0, "hbm_tbps": 4.8}      # datasheet: dense bf16, HBM3e
H100 = {"name": "H100", "bf16_tflops": 989.0, "hbm_tbps": 3.35}     # datasheet: dense bf16, HBM3 (SXM)
B200 = {"name": "B200", "bf16_tflops": 2250.0, "hbm_tbps": 8.0}     # datasheet: dense bf16, HBM3e
MEASURED_GPUS = (H200, H100)
"""The GPUs whose rows the projection scales to B200, by datasheet; rows without a ``gpu`` were measured on
an H200."""

# Kernel families (sft_profile.FAMILIES) whose time is tensor-core bound; the rest is memory bound.
TENSOR_CORE_FAMILIES = ("sparse MLA fwd", "sparse MLA bwd", "DSA indexer", "KDA/fla", "GEMM")
KIND_NAMES = {"linear_attention": "KDA", "indexed_attention": "DSA"}
HEAD_LABEL = "embedding + head + loss"   # the row of the embedding, final norm, output head and loss


def datasheet(name: str) -> dict:
    """The datasheet of :data:`MEASURED_GPUS` whose name is in ``name`` (``torch.cuda.get_device_name``, e.g.
    'NVIDIA H100 80GB HBM3'). Raises ValueError for any other GPU: its rows have no B200 scaling here."""
    for sheet in MEASURED_GPUS:
        if sheet["name"] in name:
            return sheet
    raise ValueError(f"layer rows measured on {name!r}: no datasheet to scale them to B200 "
                     f"(known: {', '.join(s['name'] for s in MEASURED_GPUS)})")


def row_datasheet(row: dict) -> dict:
    """The datasheet of the GPU a row was measured on (its ``gpu``); an H200's for rows without one (CPU dry
    runs, and rows saved before rows named their GPU)."""
    return datasheet(row.get("gpu") or H200["name"])


def gpu_name(device: torch.device) -> str | None:
    """``torch.cuda.get_device_name`` of a CUDA ``device`` (a row's ``gpu``); None on CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


class EmulatedCP(CPContext):
    """Rank ``rank`` of a context-parallel group of ``size`` ranks that exist only in the emulation
    (no process group: :func:`emulated_cp_gathers` stands in for the collectives)."""

    def __init__(self, rank: int, size: int):
        self.group, self.rank, self.size = None, rank, size


@dataclasses.dataclass
class CollectiveLog:
    """Bytes the real CP collectives would move: full all-gather outputs and all-reduced gradients."""

    all_gather_bytes: int = 0
    all_reduce_bytes: int = 0
    calls: int = 0

    def reset(self) -> None:
        self.all_gather_bytes = self.all_reduce_bytes = self.calls = 0


class _EmulatedGather(torch.autograd.Function):
    """``all_gather_seq`` of one rank without the others: ``size`` copies of the local shard."""

    @staticmethod
    def forward(ctx, x, dim, cp, log):
        ctx.dim, ctx.cp, ctx.log = dim, cp, log
        out = torch.cat([x] * cp.size, dim=dim)
        log.all_gather_bytes += out.numel() * out.element_size()
        log.calls += 1
        return out

    @staticmethod
    def backward(ctx, grad):
        # The real backward all-reduces the full gradient over CP, then keeps this rank's chunk.
        ctx.log.all_reduce_bytes += grad.numel() * grad.element_size()
        return grad.chunk(ctx.cp.size, dim=ctx.dim)[ctx.cp.rank].contiguous(), None, None, None


@contextlib.contextmanager
def emulated_cp_gathers(log: CollectiveLog):
    """For the span of the block, the mixers' and the indexer-KL hook's ``all_gather_seq`` (bound in
    :mod:`model.layers`, read from :mod:`model.parallel` at call time) is :class:`_EmulatedGather`."""
    import model.layers
    import model.parallel

    def gather(x, dim, cp):
        return x if cp.size == 1 else _EmulatedGather.apply(x, dim, cp, log)

    saved = model.layers.all_gather_seq, model.parallel.all_gather_seq
    model.layers.all_gather_seq = model.parallel.all_gather_seq = gather
    try:
        yield
    finally:
        model.layers.all_gather_seq, model.parallel.all_gather_seq = saved


def wanted(args, label: str) -> bool:
    """Whether ``--only`` (label prefixes; empty: every kind) selects the layer kind ``label``."""
    return not args.only or label.startswith(tuple(args.only))


def kind_label(kind: tuple[str, str, str]) -> str:
    mixer, mlp, indexer = kind
    label = f"{KIND_NAMES[mixer]}+{'MoE' if mlp == 'sparse' else 'dense'}"
    return label + (" (shared indexer)" if mixer == "indexed_attention" and indexer == "shared" else "")


def schedule_kinds(mcfg) -> tuple[list[tuple[str, str, str]], Counter, dict]:
    """Kinds ``(layer_type, mlp_layer_type, indexer_type)`` of a schedule in order of first
    appearance, their counts, and the index of each one's first layer."""
    kinds = list(zip(mcfg.layer_types, mcfg.mlp_layer_types, mcfg.indexer_types))
    first = {}
    for i, k in enumerate(kinds):
        first.setdefault(k, i)
    return list(first), Counter(kinds), first


def truncated(mcfg, num_layers: int, **changes):
    """``mcfg`` cut to its first ``num_layers`` layers (validation re-runs; offload set after it, as
    ``tasks.sft.model_config`` does)."""
    from model.config import replace

    sparse = mcfg.mlp_layer_types[:num_layers]
    cfg = replace(mcfg, num_layers=num_layers, layer_types=mcfg.layer_types[:num_layers],
                  indexer_types=mcfg.indexer_types[:num_layers], mlp_layer_types=sparse,
                  moe_layer_freq=[1 if t == "sparse" else 0 for t in sparse], cpu_offloading=False, **changes)
    cfg.cpu_offloading, cfg.cpu_offloading_num_layers = mcfg.cpu_offloading, mcfg.cpu_offloading_num_layers
    return cfg


def layer_flops_per_token(mcfg, seq: int, layer: int) -> float:
    """Layer ``layer``'s share of ``tasks.trainer.model_flops_per_token(mcfg, seq)``."""
    from tasks.trainer import model_flops_per_token

    before = model_flops_per_token(truncated(mcfg, layer), seq) if layer else head_flops_per_token(mcfg)
    return model_flops_per_token(truncated(mcfg, layer + 1), seq) - before


def head_flops_per_token(mcfg) -> float:
    """Output head and final norm share of ``model_flops_per_token`` (embedding lookups count none)."""
    return 6.0 * (mcfg.vocab_size * mcfg.hidden_size + mcfg.hidden_size)


def bench_config(mcfg, kinds, experts_per_rank: int):
    """One layer per kind, in schedule order, with the EP rank's local experts and no model parallelism
    inside the process (the emulation provides CP; see the module docstring)."""
    from model.config import replace

    types_ = [k[0] for k in kinds]
    mlp = [k[1] for k in kinds]
    cfg = replace(mcfg, num_layers=len(kinds), layer_types=types_, indexer_types=[k[2] for k in kinds],
                  mlp_layer_types=mlp, moe_layer_freq=[1 if t == "sparse" else 0 for t in mlp],
                  num_moe_experts=experts_per_rank if "sparse" in mlp else None, moe_router_num_groups=None,
                  moe_router_group_topk=None, context_parallel_size=1, expert_model_parallel_size=1,
                  cpu_offloading=False)
    cfg.cpu_offloading, cfg.cpu_offloading_num_layers = mcfg.cpu_offloading, mcfg.cpu_offloading_num_layers
    return cfg


def init_single_process(seed: int) -> None:
    """What ``model.glm5_next.build_model`` sets up before building modules, for one process."""
    from megatron.core import parallel_state, tensor_parallel

    from model import cpu_compat

    cpu_compat.enable()
    if not torch.distributed.is_initialized():
        cpu_compat.init_process_group(0, 1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def to_device(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Cast and move as ``build_model`` does (the routers' expert bias stays float32)."""
    module.to(dtype)
    for m in module.modules():
        if hasattr(m, "_maintain_float32_expert_bias"):
            m._maintain_float32_expert_bias()
    return module.to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_iterations(step, device, warmup: int, iters: int, before_first=None, after_first=None) -> list[float]:
    """Wall seconds of ``iters`` synchronised calls of ``step`` after ``warmup`` untimed ones, with
    Python's collector off (a collection would stall the device where it waits on launches);
    ``before_first`` / ``after_first`` are called around the first timed call."""
    for i in range(warmup):
        start = time.perf_counter()
        step()
        sync(device)
        # the first iterations compile and autotune (minutes at full width): say where the time goes
        print(f"  warmup {i + 1}/{warmup}: {time.perf_counter() - start:.1f} s", flush=True)
    times = []
    gc.collect()
    gc.disable()
    try:
        for i in range(iters):
            if i == 0 and before_first is not None:
                before_first()
            start = time.perf_counter()
            step()
            sync(device)
            times.append(time.perf_counter() - start)
            if i == 0 and after_first is not None:
                after_first()
    finally:
        gc.enable()
    return times


def kernel_split(step, device) -> dict | None:
    """One iteration of ``step`` under ``torch.profiler`` (CUDA only): fractions of its wall time in
    tensor-core kernels, other kernels, and with the device idle (``sft_profile.trace_summary``)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile, record_function

    from sft_profile import trace_summary

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("sft_step"):   # the step range trace_summary reads
            step()
        sync(device)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        summary = trace_summary(json.loads(Path(f.name).read_text()), 1)
    busy = 1.0 - summary["host_idle_share"]
    tensor_core = sum(summary["families"][f]["share"] for f in TENSOR_CORE_FAMILIES)
    return {"tensor_core": busy * tensor_core, "other_kernels": busy * (1 - tensor_core), "idle": 1 - busy,
            "families_ms": {f: round(v["ms_per_step"], 2) for f, v in summary["families"].items()}}


def measure_layer(layer, cfg, kind, seq: int, cp: int, device, dtype, args, log: CollectiveLog,
                  prev_topk, kl_coeff: float) -> tuple[dict, torch.Tensor | None]:
    """Forward+backward of one layer as CP rank ``cp - 1`` at ``seq`` tokens; returns the row and the
    top-k it selected (a shared-indexer layer after it reuses it)."""
    from model.glm5_next import Glm5NextModel
    from model.offload import OffloadChain
    from tasks.sft import IndexerKL

    tokens = seq // cp
    gen = torch.Generator(device=device).manual_seed(seq)
    shape = (tokens, 1, cfg.hc_mult, cfg.hidden_size)
    streams = torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_()
    grad_out = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    # Glm5NextModel._layer_call reads only its config and training flag: the model's own recompute
    # and offload wrapper around one layer.
    holder = types.SimpleNamespace(config=cfg, training=True)
    indexer_kl = IndexerKL(layer, kl_coeff)
    moe_calls = []   # per MoE forward: whether it runs with grad (then one backward follows)
    hooks = [layer.mlp.register_forward_hook(lambda m, a, o: moe_calls.append(torch.is_grad_enabled()))
             ] if layer.is_moe else []
    kept = {"kl_terms": 0}

    def step():
        offload = OffloadChain() if cfg.cpu_offloading else None
        out, topk = Glm5NextModel._layer_call(holder, layer, streams, prev_topk, None, offload)
        roots, grads = [out], [grad_out]
        kl = indexer_kl.pop()
        if torch.is_tensor(kl):   # train_step's loss term: coeff x KL x target tokens
            roots.append(kl * (kl_coeff * tokens))
            grads.append(None)
            kept["kl_terms"] += 1
        torch.autograd.backward(roots, grads)
        streams.grad = None
        kept["topk"] = topk

    def start_counting():
        log.reset()
        moe_calls.clear()
        kept["kl_terms"] = 0

    def snapshot():   # what one iteration issued
        kept["counted"] = (dataclasses.replace(log), list(moe_calls), kept["kl_terms"])

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    with emulated_cp_gathers(log):
        times = time_iterations(step, device, args.warmup, args.iters, start_counting, snapshot)
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
        split = kernel_split(step, device)
    for handle in hooks:
        handle.remove()
    indexer_kl.remove()
    indexer_kl.pop()
    layer_log, calls, kl_terms = kept["counted"]
    row = {
        "kind": kind_label(kind), "seq_len": seq, "local_tokens": tokens, "step_s": statistics.median(times),
        "times_s": times, "peak_gib": peak / 2**30, "above_resident_gib": (peak - resident) / 2**30,
        "cp_all_gather_bytes": layer_log.all_gather_bytes, "cp_all_reduce_bytes": layer_log.all_reduce_bytes,
        "cp_collectives": layer_log.calls,
        "moe_forwards": len(calls), "moe_backwards": sum(calls), "indexer_kl_backwards": kl_terms, "split": split,
    }
    return row, kept.get("topk")


def head_model(cfg, device, dtype):
    """``Glm5NextModel`` of ``cfg`` without its layers: embedding, final norm, output head, chunked loss."""
    from model.glm5_next import Glm5NextModel

    model = Glm5NextModel(truncated(cfg, 1))
    model.layers = torch.nn.ModuleList()
    return to_device(model, device, dtype)


def measure_head(model, seq: int, cp: int, device, args) -> dict:
    """Forward+backward of ``model`` (:func:`head_model`) on ``seq / cp`` tokens, loss = summed NLL."""
    tokens = seq // cp
    vocab = model.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(seq + 1)
    ids = torch.randint(0, vocab, (1, tokens), device=device, generator=gen)
    labels = torch.randint(0, vocab, (1, tokens), device=device, generator=gen)

    def step():
        model(ids, labels).sum().backward()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = time_iterations(step, device, args.warmup, args.iters)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    split = kernel_split(step, device)
    return {"kind": HEAD_LABEL, "seq_len": seq, "local_tokens": tokens,
            "step_s": statistics.median(times), "times_s": times, "peak_gib": peak / 2**30,
            "above_resident_gib": None, "split": split}


def ring_seconds(nbytes: float, ranks: int, gbytes_per_s: float, all_reduce: bool = False) -> float:
    """NCCL ring time of an all-gather with ``nbytes`` of output (or an all-reduce of ``nbytes``)."""
    if ranks <= 1:
        return 0.0
    return (2 if all_reduce else 1) * (ranks - 1) / ranks * nbytes / (gbytes_per_s * 1e9)


BACKWARD_SHARE = 2 / 3
"""Share of a step's compute that is backward (2 of the 3 forward-equivalents; more under full recompute):
the time an overlapped gradient reduce-scatter can hide behind."""


def forward_share(recompute: str) -> float:
    """Share of a step's compute that is the first forward: 1 of 4 forward-equivalents under full-layer
    recompute (forward, recomputed forward, backward = 2), 1 of 3 otherwise (selective recompute counted
    as none: the lower bound of the backward's share, the upper one of the forward's)."""
    return 1 / 4 if recompute == "full" else 1 / 3


def project(rows: list[dict], full_cfg, counts: Counter, kinds, seq: int, layout: dict, args,
            overlap_grad_reduce: bool = False, overlap_param_gather: bool = False, recompute: str = "full") -> dict:
    """The 45-layer step on the training layout from the measured rows of one length, with its arithmetic.

    ``overlap_grad_reduce`` (SFT's setting): the distributed optimizer's gradient reduce-scatter is issued
    bucket by bucket during the backward, so up to :data:`BACKWARD_SHARE` of the compute time of it leaves
    the step. ``overlap_param_gather`` (SFT's setting): its parameter all-gather is issued bucket by bucket
    during the next forward, so up to :func:`forward_share` (``recompute``) of the compute time of it leaves
    the step. The link they share with the MoE all-to-all and the CP gathers is not modelled."""
    from model.config import parameter_count

    lines = []
    cp, ep, world, nproc = layout["cp"], layout["ep"], layout["world"], layout["nproc_per_node"]
    dp = world // (layout["tp"] * cp)
    ib, nvl = args.ib_gbytes_per_s, args.nvlink_gbytes_per_s
    bw = lambda ranks: ib if ranks > nproc else nvl  # noqa: E731  (contiguous groups)
    by_kind = {r["kind"]: r for r in rows if r["seq_len"] == seq}

    def b200(row):
        gpu = row_datasheet(row)
        tc, hbm = gpu["bf16_tflops"] / B200["bf16_tflops"], gpu["hbm_tbps"] / B200["hbm_tbps"]
        s = row["split"]
        if s is None:   # no profile (CPU): the whole time counted tensor-core bound
            return row["step_s"] * tc, f"x {gpu['bf16_tflops']:g}/{B200['bf16_tflops']:g} (no kernel split)"
        factor = s["tensor_core"] * tc + s["other_kernels"] * hbm + s["idle"]
        return row["step_s"] * factor, (f"x ({s['tensor_core']:.2f} x {gpu['bf16_tflops']:g}/{B200['bf16_tflops']:g}"
                                        f" + {s['other_kernels']:.2f} x {gpu['hbm_tbps']:g}/{B200['hbm_tbps']:g} "
                                        f"+ {s['idle']:.2f} idle) = x {factor:.3f}")

    tokens = seq // cp
    h, e, topk = full_cfg.hidden_size, full_cfg.num_moe_experts or 0, full_cfg.moe_router_topk
    local_peers = min(ep, nproc)
    compute_gpu = compute_b200 = comm = comm_a2a = 0.0
    measured_on = "+".join(sorted({row_datasheet(r)["name"] for r in by_kind.values()}))
    lines.append(f"projection at {seq:,} tokens per sequence: {world} GPUs, CP={cp} ({tokens:,} tokens per GPU), "
                 f"EP={ep}, DP={dp}; NVLink {nvl:g} GB/s, InfiniBand {ib:g} GB/s per GPU")
    for kind in [*kinds, None]:
        label = HEAD_LABEL if kind is None else kind_label(kind)
        count = 1 if kind is None else counts[kind]
        row = by_kind[label]
        t_b200, how = b200(row)
        compute_gpu += count * row["step_s"]
        compute_b200 += count * t_b200
        gpu = row_datasheet(row)["name"]
        lines.append(f"  {label:<24s} {count:3d} x {row['step_s']:.4f} s ({gpu}) = {count * row['step_s']:8.3f} s; "
                     f"B200 {how}: {count:3d} x {t_b200:.4f} = {count * t_b200:8.3f} s")
        if kind is None:
            continue
        t_cp = (ring_seconds(row["cp_all_gather_bytes"], cp, bw(cp))
                + ring_seconds(row["cp_all_reduce_bytes"], cp, bw(cp), all_reduce=True))
        # allgather dispatcher (megatron MoEAllGatherTokenDispatcher over TP x EP): per MoE forward,
        # gather hidden (bf16), probs (float32 [tokens, E]) and routing map (bool), reduce-scatter the
        # output; backward: reduce-scatter the hidden and probs grads, all-gather the output grad.
        fwd_bytes = ep * tokens * (2 * h + 4 * e + e) + ep * tokens * 2 * h
        bwd_bytes = ep * tokens * (2 * h + 4 * e) + ep * tokens * 2 * h
        t_ep = (row["moe_forwards"] * ring_seconds(fwd_bytes, ep, bw(ep))
                + row["moe_backwards"] * ring_seconds(bwd_bytes, ep, bw(ep)))
        # an all-to-all dispatcher instead: topk rows (bf16 + float32 prob) out and back per pass
        a2a = tokens * topk * (2 * h + 4)
        a2a_s = 2 * a2a * ((ep - local_peers) / ep / ib + (local_peers - 1) / ep / nvl) / 1e9
        t_a2a = (row["moe_forwards"] + row["moe_backwards"]) * a2a_s
        comm += count * (t_cp + t_ep)
        comm_a2a += count * (t_cp + t_a2a)
        lines.append(f"  {'':<24s} comm per layer: CP {row['cp_collectives']} gathers of "
                     f"{row['cp_all_gather_bytes'] / 2**30:.3f} GiB + all-reduces of "
                     f"{row['cp_all_reduce_bytes'] / 2**30:.3f} GiB = {t_cp:.4f} s; MoE "
                     f"{row['moe_forwards']} fwd / {row['moe_backwards']} bwd, allgather dispatcher "
                     f"{t_ep:.4f} s (all-to-all {t_a2a:.4f} s)")
    counts_p = parameter_count(full_cfg)
    dense = counts_p["total"] - counts_p["moe_routed"]
    expert = counts_p["moe_routed"] / ep
    edp = world // ep
    # distributed optimizer: float32 grads reduce-scattered, bf16 params all-gathered, over DP x CP
    # (dense) and over the expert-data-parallel ranks (experts; strided by EP, so on other nodes)
    t_rs = ring_seconds(dense * 4, dp * cp, bw(dp * cp)) + ring_seconds(expert * 4, edp, ib if ep >= nproc else nvl)
    t_ag = ring_seconds(dense * 2, dp * cp, bw(dp * cp)) + ring_seconds(expert * 2, edp, ib if ep >= nproc else nvl)
    t_opt = t_rs + t_ag
    lines.append(f"  optimizer collectives: dense {dense / 1e9:.2f}B params over {dp * cp} ranks, experts "
                 f"{expert / 1e9:.2f}B local params over {edp} ranks: {t_opt:.3f} s (gradient reduce-scatter "
                 f"{t_rs:.3f} s, parameter all-gather {t_ag:.3f} s)")
    comm += t_opt
    comm_a2a += t_opt
    configured = full_cfg.moe_token_dispatcher_type
    comm_serial = comm_a2a if configured == "alltoall" else comm
    sharded = dp * cp > 1
    hidden_rs = min(t_rs, BACKWARD_SHARE * compute_b200) if overlap_grad_reduce and sharded else 0.0
    fwd = forward_share(recompute)
    hidden_ag = min(t_ag, fwd * compute_b200) if overlap_param_gather and sharded else 0.0
    hidden = hidden_rs + hidden_ag
    if hidden_rs:
        lines.append(f"  gradient reduce-scatter issued during the backward (overlap_grad_reduce): {hidden_rs:.3f} s "
                     f"of it off the step (at most {BACKWARD_SHARE:.2f} x {compute_b200:.3f} s of compute)")
    if hidden_ag:
        lines.append(f"  parameter all-gather issued during the next forward (overlap_param_gather): {hidden_ag:.3f} s "
                     f"of it off the step (at most {fwd:.2f} x {compute_b200:.3f} s of compute, recompute={recompute})")
    comm_configured = comm_serial - hidden
    step = compute_b200 + comm_configured
    out = {"seq_len": seq, "dispatcher": configured, "measured_on": measured_on, "compute_measured_s": compute_gpu,
           "compute_b200_s": compute_b200,
           "comm_s": comm_configured, "comm_allgather_s": comm, "comm_all_to_all_s": comm_a2a, "step_b200_s": step,
           "grad_reduce_hidden_s": hidden_rs, "param_gather_hidden_s": hidden_ag,
           "tokens_per_s_serial": seq * dp / (compute_b200 + comm_serial),
           "tokens_per_s": seq * dp / step, "tokens_per_s_compute_only": seq * dp / compute_b200,
           "tokens_per_s_allgather": seq * dp / (compute_b200 + comm),
           "tokens_per_s_all_to_all": seq * dp / (compute_b200 + comm_a2a)}
    lines.append(f"  one GPU: {compute_gpu:.3f} s on {measured_on} -> {compute_b200:.3f} s on B200 compute + "
                 f"{comm_configured:.3f} s comm ({configured} dispatcher) = {step:.3f} s per step")
    ref = REFERENCE_TOKENS_PER_S.get(seq)
    other = ("allgather dispatcher instead", "tokens_per_s_allgather") if configured == "alltoall" else \
        ("all-to-all dispatcher instead", "tokens_per_s_all_to_all")
    overlapped = ", ".join(name for name, t in (("gradient reduce-scatter", hidden_rs),
                                                ("parameter all-gather", hidden_ag)) if t)
    overlapped = f"{overlapped} overlapped, other collectives not" if hidden else "collectives not overlapped"
    for name, key in ((f"as configured ({configured} dispatcher, {overlapped})", "tokens_per_s"),
                      *([("no collective overlapped", "tokens_per_s_serial")] if hidden else []),
                      other, ("compute only (collectives fully overlapped)", "tokens_per_s_compute_only")):
        ratio = f" = {out[key] / ref:.2f}x the reference {ref:,.0f} (goal >= {GOAL_RATIO:g}x)" if ref else ""
        lines.append(f"  tokens/s on {world} B200, {name}: {seq:,} x {dp} / step = {out[key]:,.0f}{ratio}")
    out["lines"] = lines
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--training-preset", default="b200-64", help="tasks.presets name: model, layout, knobs")
    parser.add_argument("--model", default="", help="model preset instead of the training preset's (tiny on CPU)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[262_144, 1_048_576])
    parser.add_argument("--cp", default="plan",
                        help="context-parallel size, or 'plan' (default): per length, the smallest power of two "
                             "at which tasks.memory_plan fits the training preset's run on its GPU")
    parser.add_argument("--ep", type=int, default=0, help="expert-parallel size (default: the preset's)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations (the second holds a KL backward)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--only", nargs="+", default=[],
                        help="measure only the layer kinds whose label starts with one of these (e.g. KDA; "
                             "'embedding' for the head): a table, no projection")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--rows-from", nargs="+", default=[], metavar="JSON",
                        help="no measurement: table and projection from earlier runs' --out files (a later "
                             "file's row of the same kind and length replaces an earlier one's)")
    parser.add_argument("--ib-gbytes-per-s", type=float, default=50.0, help="per GPU (one 400 Gb/s NIC)")
    parser.add_argument("--nvlink-gbytes-per-s", type=float, default=900.0, help="per GPU and direction (NVLink 5)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny preset, 4,096 tokens, CP=EP=4")
    parser.add_argument("--variant", default="",
                        help="SFTConfig overrides on top of the preset's, 'field=value,...' (e.g. dsa_fwd=gluon)")
    parser.add_argument("--out", help="JSON file (rewritten after every measurement)")
    args = parser.parse_args()
    if args.dry_run:
        args.device, args.model, args.seq_lens, args.cp, args.ep = "cpu", args.model or "tiny", [4096], "4", 4
        args.warmup, args.iters = 2, 1
    if args.cp != "plan" and not (args.cp.isdigit() and int(args.cp) > 0):
        parser.error(f"--cp {args.cp!r}: a context-parallel size or 'plan'")
    install_flytekit_stand_in()
    from tasks.presets import get_preset
    from sft_profile import parse_variant
    from tasks.sft import model_config, preset_sft_config

    training = get_preset(args.training_preset)
    par = training.train_parallel
    base = {"tp": par.tensor_parallel, "ep": args.ep or par.expert_parallel,
            "world": par.nnodes * par.nproc_per_node, "nproc_per_node": par.nproc_per_node}
    sft_cfg = dataclasses.replace(preset_sft_config(training), model=args.model or training.model,
                                  context_parallel=par.context_parallel, expert_parallel=base["ep"], dtype="bfloat16",
                                  **parse_variant(args.variant))
    # "every layer offloaded" stays every layer for a model preset with fewer layers (the dry run's)
    num_layers = model_config(dataclasses.replace(sft_cfg, offload_layers=0)).num_layers
    sft_cfg = dataclasses.replace(sft_cfg, offload_layers=min(sft_cfg.offload_layers, num_layers))
    full_cfg = model_config(sft_cfg)
    kinds, counts, first = schedule_kinds(full_cfg)
    experts_per_rank = (full_cfg.num_moe_experts or 0) // base["ep"]
    if args.rows_from:
        loaded, anchor = merged_rows(args.rows_from)
        cps = {}
        for r in loaded:                                       # each length in the layout it was measured in
            cp = cps.setdefault(r["seq_len"], r["seq_len"] // r["local_tokens"])
            if cp != r["seq_len"] // r["local_tokens"]:
                parser.error(f"--rows-from: rows at {r['seq_len']:,} tokens were measured at different CP sizes "
                             f"({cp} and {r['seq_len'] // r['local_tokens']}, {r['source']})")
    else:
        cps = {}
        for seq in args.seq_lens:
            cps[seq] = int(args.cp) if args.cp != "plan" else planned_cp(sft_cfg, seq, base)
            if cps[seq] is None:
                parser.error(f"no context-parallel size fits {seq:,}-token windows in the memory plan")
            if seq % cps[seq]:
                parser.error(f"--seq-lens {seq} is not divisible by CP={cps[seq]}")
    layouts = {seq: dict(base, cp=cp) for seq, cp in cps.items()}
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run (or --device cpu --model tiny)")
    dtype = torch.bfloat16
    print(f"{args.training_preset}: model {sft_cfg.model}, recompute {sft_cfg.recompute}, offload_layers "
          f"{sft_cfg.offload_layers}, mlp_chunk_tokens {sft_cfg.mlp_chunk_tokens}, indexer_kl_coeff "
          f"{sft_cfg.indexer_kl_coeff}, moe_experts {full_cfg.moe_experts}, compile_glue {full_cfg.compile_glue}, "
          f"dispatcher {full_cfg.moe_token_dispatcher_type}; layout {base}, CP by length "
          f"{ {seq: cp for seq, cp in sorted(cps.items())} }; {experts_per_rank} local experts "
          f"(top-{full_cfg.moe_router_topk})", flush=True)
    print("schedule: " + ", ".join(f"{kind_label(k)} x {counts[k]}" for k in kinds), flush=True)
    rows: list[dict] = []
    result = {"anchor_tflops": None, "layouts": {str(seq): lay for seq, lay in layouts.items()},
              "preset": args.training_preset, "variant": args.variant, "model": sft_cfg.model, "rows": rows,
              "projections": []}

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))

    if args.rows_from:
        result["anchor_tflops"] = anchor
        rows.extend(loaded)
        result["rows_from"] = args.rows_from
        lengths = sorted({r["seq_len"] for r in rows})
    else:
        result["anchor_tflops"] = measure(args, kinds, sft_cfg, first, layouts, experts_per_rank, device, dtype,
                                          rows, save)
        lengths = args.seq_lens
    measured = [seq for seq in lengths if sum(r["seq_len"] == seq for r in rows) == len(kinds) + 1]
    report(args, rows, measured, kinds, counts, first, full_cfg, sft_cfg, layouts, result["anchor_tflops"], result)
    save()


def planned_cp(sft_cfg, seq: int, layout: dict) -> int | None:
    """The smallest power-of-two CP dividing the world and ``seq`` at which :func:`tasks.memory_plan.memory_plan`
    fits ``sft_cfg``'s run of ``seq``-token windows on the training preset's GPU (B200); None if none does.

    Fewer CP ranks per sequence is more data parallelism: fewer collectives per token and more tokens per
    GPU for the same memory (the plan's activations scale with ``seq / CP``)."""
    from tasks.memory_plan import MemoryPlanError, memory_plan
    from tasks.presets import DEVICE_MEMORY_BYTES
    from tasks.sft import model_config
    from tasks.trainer import ParallelLayoutError

    cp = 1
    while cp <= layout["world"]:
        if seq % cp == 0 and layout["world"] % (cp * layout["tp"]) == 0:
            cfg = dataclasses.replace(sft_cfg, seq_len=seq, context_parallel=cp)
            try:
                memory_plan(model_config(cfg), cfg, layout["world"], layout["nproc_per_node"],
                            device_limit=DEVICE_MEMORY_BYTES["nvidia-b200"], host_limit=1 << 50, on_gpu=True)
                return cp
            except (MemoryPlanError, ParallelLayoutError):   # does not fit, or EP does not divide this layout
                pass
        cp *= 2
    return None


def measure(args, kinds, sft_cfg, first, layouts, experts_per_rank, device, dtype, rows, save) -> float | None:
    """The anchor (TF/s, CUDA only), then per CP size of ``layouts`` the layers and head built as one rank of
    it and :func:`measure_all` of its lengths into ``rows`` (stopped early by SIGINT, keeping what was
    measured); returns the anchor."""
    anchor = None
    if device.type == "cuda":
        from sft_profile import matmul_tflops

        anchor = matmul_tflops()
        gpu = gpu_name(device)
        print(f"matmul anchor (bf16 8192^3, this process): {anchor:.0f} TF/s on {gpu}; datasheet "
              f"{datasheet(gpu)['bf16_tflops']:.0f}", flush=True)

    init_single_process(seed=0)
    from megatron.core.transformer.spec_utils import build_module

    from model.glm5_next import layer_spec
    from tasks.sft import model_config

    try:
        for cp in dict.fromkeys(layouts[seq]["cp"] for seq in args.seq_lens):   # in the order of --seq-lens
            seqs = [seq for seq in args.seq_lens if layouts[seq]["cp"] == cp]
            cp_cfg = dataclasses.replace(sft_cfg, context_parallel=cp)
            full_cfg = model_config(cp_cfg)
            cfg = bench_config(full_cfg, kinds, experts_per_rank)
            cp_layout = ParallelLayout(cp=EmulatedCP(cp - 1, cp))
            started = time.perf_counter()
            layers = [to_device(build_module(layer_spec(cfg, i), config=cfg, layer_number=i + 1, layout=cp_layout),
                                device, dtype) for i in range(len(kinds))]
            head = head_model(cfg, device, dtype)
            print(f"CP={cp}: built {len(layers)} layers and the head in {time.perf_counter() - started:.1f} s",
                  flush=True)
            measure_all(args, seqs, kinds, layers, head, cfg, full_cfg, cp_cfg, first, cp, device, dtype,
                        CollectiveLog(), rows, save)
            del layers, head
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except KeyboardInterrupt:   # the session's time limit (SIGINT): report what was measured
        # where it was stopped (a kernel's compile or autotune, usually) tells the next run what to seed
        traceback.print_exc(limit=-6)
        print("interrupted: the table and projections cover the lengths measured in full", flush=True)
    return anchor


def merged_rows(paths: list[str]) -> tuple[list[dict], float | None]:
    """Rows of earlier ``--out`` files, one per (kind, length), later files winning, each tagged with
    its file; and the last file's matmul anchor (TF/s; rows from other calls had their own)."""
    rows, anchor = {}, None
    for path in paths:
        data = json.loads(Path(path).read_text())
        anchor = data.get("anchor_tflops") or anchor
        for row in data["rows"]:
            rows[(row["kind"], row["seq_len"])] = dict(row, source=path)
    for (kind, seq), row in rows.items():
        print(f"  {kind} at {seq:,}: from {row['source']}")
    return list(rows.values()), anchor


def measure_all(args, seqs, kinds, layers, head, cfg, full_cfg, sft_cfg, first, cp, device, dtype, log, rows, save):
    """Every layer kind, then the head, at every length of ``seqs`` (as rank ``cp - 1`` of ``cp``); a row
    appended (and saved) per measurement."""
    for seq in seqs:
        topk = None
        for kind, layer in zip(kinds, layers):
            if not wanted(args, kind_label(kind)):
                continue
            print(f"{kind_label(kind)} at {seq:,} tokens", flush=True)
            started = time.perf_counter()
            row, selected = measure_layer(layer, cfg, kind, seq, cp, device, dtype, args, log,
                                          topk if kind[2] == "shared" else None, sft_cfg.indexer_kl_coeff)
            if kind[0] == "indexed_attention" and kind[2] == "full":
                topk = selected
            row["flops_per_token"] = layer_flops_per_token(full_cfg, seq, first[kind])
            row["wall_s"] = time.perf_counter() - started
            row["gpu"] = gpu_name(device)
            rows.append(row)
            save()
            print(json.dumps({k: v for k, v in row.items() if k != "times_s"}), flush=True)
        if not wanted(args, HEAD_LABEL):
            continue
        row = measure_head(head, seq, cp, device, args)
        row["flops_per_token"] = head_flops_per_token(full_cfg)
        row["gpu"] = gpu_name(device)
        rows.append(row)
        save()
        print(json.dumps({k: v for k, v in row.items() if k != "times_s"}), flush=True)


def report(args, rows, seq_lens, kinds, counts, first, full_cfg, sft_cfg, layouts, anchor, result) -> None:
    """The FLOP-split check, the table and, per length, the projection and the memory plan in that length's layout."""
    from tasks.memory_plan import MemoryPlanError, memory_plan
    from tasks.presets import DEVICE_MEMORY_BYTES
    from tasks.sft import model_config
    from tasks.trainer import model_flops_per_token


    print("\nFLOPs per token: each layer's share of tasks.trainer.model_flops_per_token (6 x active parameters, "
          "sparse MLA 6 x 2 x H x W x 2 x kv_lora, indexer 2 x H_I x D_I x (seq/2) / kpool, KDA 6 x 4 x H x d^2)")
    for seq in seq_lens:
        split = sum(counts[k] * layer_flops_per_token(full_cfg, seq, first[k]) for k in kinds)
        whole = model_flops_per_token(full_cfg, seq)
        print(f"  {seq:,}: layers by kind + head = {(split + head_flops_per_token(full_cfg)) / 1e9:.3f} GFLOP/token; "
              f"model_flops_per_token = {whole / 1e9:.3f}")
    print("\n| layer | tokens/seq | local tokens | fwd+bwd s | model TF/s | % of anchor | peak GiB (above resident) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        tflops = r["local_tokens"] * r["flops_per_token"] / r["step_s"] / 1e12
        pct = f"{100 * tflops / anchor:.1f}%" if anchor else "-"
        above = f" ({r['above_resident_gib']:.1f})" if r["above_resident_gib"] is not None else ""
        print(f"| {r['kind']} | {r['seq_len']:,} | {r['local_tokens']:,} | {r['step_s']:.4f} | {tflops:.1f} | {pct} | "
              f"{r['peak_gib']:.1f}{above} |")
        r["model_tflops"] = tflops
    print("model TF/s = local tokens x the layer's FLOPs per token above / fwd+bwd s; peak: max allocated in the "
          "measurement, every benchmarked layer's weights and grads and the head resident (in brackets: above them)")
    for seq in seq_lens:
        layout = layouts[seq]
        cfg = dataclasses.replace(sft_cfg, seq_len=seq, context_parallel=layout["cp"])
        seq_cfg = model_config(cfg)
        projection = project(rows, seq_cfg, counts, kinds, seq, layout, args, cfg.overlap_grad_reduce,
                             cfg.overlap_param_gather, cfg.recompute)
        result["projections"].append(projection)
        print()
        print("\n".join(projection["lines"]))
        try:
            plan = memory_plan(seq_cfg, cfg, layout["world"], layout["nproc_per_node"],
                               device_limit=DEVICE_MEMORY_BYTES["nvidia-b200"], host_limit=1 << 50, on_gpu=True)
            print(f"  memory plan per B200 at this length: {plan.device_total / 2**30:.1f} GiB "
                  f"(activations {plan.activations / 2**30:.1f}, workspace {plan.workspace / 2**30:.1f}), "
                  f"pinned host {plan.pinned_host / 2**30:.1f} GiB")
        except MemoryPlanError as err:
            print(f"  memory plan: {str(err).splitlines()[0]}")


if __name__ == "__main__":
    main()
