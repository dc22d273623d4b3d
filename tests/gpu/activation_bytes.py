"""Measure the activation bytes autograd saves per token, per layer and module, against the SFT memory plan.

    python tests/gpu/activation_bytes.py --preset small --seq 4096 [--dtype bfloat16]

One training forward of a freshly built model (no recompute, no offload) runs under
``torch.autograd.graph.saved_tensors_hooks``; every tensor saved for backward is attributed to
the innermost module running when it was saved (parameters and views of a storage already
counted are skipped). The table prints saved bytes per token for each layer, split into the
mHC / mixer / MLP parts, next to :func:`tasks.memory_plan.activation_bytes_per_token`, so the plan can be checked on any machine: on CPU the mixers run the
plain-torch KDA and blockwise DSA, on CUDA fla ``chunk_kda`` and the Triton DSA kernels (their
saved tensors differ; the mHC, norms, projections and MoE are the same code on both).

``--offload`` adds, per layer, the host bytes the activation offload copies when every layer is
offloaded (one more training forward of the same model and batch each): through
``torch.autograd.graph.save_on_cpu`` (a copy per save) and through
:class:`model.offload.OffloadActivations` (a copy per storage), exact and rounded up to powers of
two as CUDA's caching host allocator allocates pinned blocks; the totals over distinct saved
bytes calibrate ``tasks.memory_plan.OFFLOAD_PINNED_FACTOR``. ``--recompute-mlp`` measures with every MLP
chunk checkpointed (``recompute="selective"``, the offload runs' setting).
"""

from __future__ import annotations

import argparse
import collections
import json
import weakref

import torch


def measure(model, ids: torch.Tensor) -> dict[str, dict[str, int]]:
    """Saved-for-backward bytes of ``model(ids[:, :-1], labels=ids[:, 1:])`` by layer and part.

    Returns ``{layer_key: {part: bytes}}``; layer keys ``"0".."L-1"`` and ``"head"`` (embedding,
    final norm, loss); parts ``mhc``, ``mixer`` (projections, convolutions, gates, norms),
    ``kda_core`` / ``dsa_core`` (the recurrence, the indexer and sparse attention: the paths that
    differ between CPU and CUDA), ``mlp``, ``other`` (layer norms, stream merges).
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    # Storage pointer -> a weak reference to the tensor that was counted at it. A tensor saved
    # by a subgraph whose output is dropped (the indexer's scores behind an integer top-k) is
    # freed inside the forward, and the allocator may hand its address to a later saved tensor:
    # that one is new, not a view of a counted storage.
    seen: dict[int, weakref.ref] = {}
    stack: list[tuple[str, str]] = [("head", "other")]
    totals: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.Counter())
    hooks = []

    def part_of(name: str) -> str:
        if "attn_hc" in name or "ffn_hc" in name:
            return "mhc"
        if ".mixer" in name:
            return "mixer"
        if ".mlp" in name:
            return "mlp"
        return "other"

    for name, module in model.named_modules():
        if not name.startswith("layers."):
            continue
        layer = name.split(".")[1]

        def pre(mod, args, key=(layer, part_of(name))):
            stack.append(key)

        def post(mod, args, out):
            stack.pop()

        hooks.append(module.register_forward_pre_hook(pre))
        hooks.append(module.register_forward_hook(post))

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        counted = seen.get(ptr)
        if ptr not in params and (counted is None or counted() is None):
            seen[ptr] = weakref.ref(t)
            layer, part = stack[-1]
            totals[layer][part] += t.untyped_storage().nbytes()
        return t

    # The KDA recurrence and the DSA kernels are the parts whose saved tensors differ between the
    # CPU (plain torch) and CUDA (fla, Triton) paths: count them separately.
    from model import layers

    originals = {}

    def marked(name, fn):
        def wrapper(*args, **kwargs):
            stack.append((stack[-1][0], name))
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()
        return wrapper

    for cls, attr, name in ((layers.KDAMixer, "_recurrence", "kda_core"), (layers.DSAMixer, "select", "dsa_core")):
        originals[(cls, attr)] = getattr(cls, attr)
        setattr(cls, attr, marked(name, originals[(cls, attr)]))
    import kernels.dsa as dsa

    originals[(dsa, "sparse_mla_attention")] = dsa.sparse_mla_attention
    dsa.sparse_mla_attention = marked("dsa_core", dsa.sparse_mla_attention)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids[:, :-1], labels=ids[:, 1:]).sum()
    finally:
        for h in hooks:
            h.remove()
        for (owner, attr), fn in originals.items():
            setattr(owner, attr, fn)
    del loss
    return {k: dict(v) for k, v in totals.items()}


def offload_host_bytes(model, ids: torch.Tensor) -> dict[str, list[int]]:
    """Host bytes per layer that offloading every layer of ``model`` copies in one training forward.

    Keys ``save_on_cpu`` and ``dedupe`` (:class:`model.offload.OffloadActivations`), each also
    ``..._pow2``: the copies rounded up to powers of two (CUDA's caching host allocator rounds
    pinned blocks so). Each context instance is one layer's forward.
    """
    import model.glm5_next as glm5_next
    from model.offload import OffloadActivations
    from tasks.memory_plan import pinned_block_bytes

    counts: dict[str, list[int]] = {}

    def count(kind: str, nbytes: int) -> None:
        counts[kind][-1] += nbytes
        counts[kind + "_pow2"][-1] += pinned_block_bytes(nbytes)

    class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
        def __init__(self):
            super().__init__(pin_memory=True)
            counts["save_on_cpu"].append(0)
            counts["save_on_cpu_pow2"].append(0)
            pack = self.pack_hook

            def counting_pack(tensor):
                count("save_on_cpu", tensor.numel() * tensor.element_size())
                return pack(tensor)

            self.pack_hook = counting_pack

    class CountingOffload(OffloadActivations):
        def __init__(self):
            super().__init__()
            counts["dedupe"].append(0)
            counts["dedupe_pow2"].append(0)

        def _copy_to_host(self, tensor, pin):
            count("dedupe", tensor.numel() * tensor.element_size())
            return super()._copy_to_host(tensor, pin)

    config = model.config
    saved = config.cpu_offloading, config.cpu_offloading_num_layers
    config.cpu_offloading, config.cpu_offloading_num_layers = True, config.num_layers
    try:
        for kind, hook in (("save_on_cpu", CountingSaveOnCpu), ("dedupe", CountingOffload)):
            counts[kind], counts[kind + "_pow2"] = [], []
            glm5_next.OffloadActivations = hook
            loss = model(ids[:, :-1], labels=ids[:, 1:]).sum()
            del loss
    finally:
        glm5_next.OffloadActivations = OffloadActivations
        config.cpu_offloading, config.cpu_offloading_num_layers = saved
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--mlp-chunk-tokens", type=int, default=0)
    parser.add_argument("--recompute-mlp", action="store_true", help="checkpoint every MLP chunk")
    parser.add_argument("--offload", action="store_true", help="also count the offload's host copies")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from flyte_standin import install_flytekit_stand_in

    install_flytekit_stand_in()
    from model.config import preset
    from model.glm5_next import build_model
    from tasks.memory_plan import activation_bytes_per_token

    dtype = getattr(torch, args.dtype)
    recompute = dict(recompute_granularity="selective", recompute_modules=["mlp"]) if args.recompute_mlp else {}
    cfg = preset(args.preset, mlp_chunk_tokens=args.mlp_chunk_tokens, **recompute)
    model = build_model(cfg, seed=0, dtype=dtype).train()
    device = next(model.parameters()).device
    ids = torch.randint(4, 9, (1, args.seq + 1), device=device)
    totals = measure(model, ids)
    host = offload_host_bytes(model, ids) if args.offload else {}
    width = torch.finfo(dtype).bits // 8
    rows = []
    print(f"{args.preset} {args.dtype} on {device}, {args.seq} tokens: saved bytes per token")
    print(f"{'layer':>5} {'kind':<18} {'mhc':>7} {'mixer':>7} {'core':>7} {'mlp':>7} {'other':>7} {'total':>8} "
          f"{'plan':>8} {'x plan':>7}")
    for i in range(cfg.num_layers):
        got = {k: v / args.seq for k, v in totals.get(str(i), {}).items()}
        planned = activation_bytes_per_token(cfg, i, 1, width, on_gpu=device.type == "cuda")
        plan = sum(v for k, v in planned.items() if k != ("mlp" if args.recompute_mlp else "mlp_input"))
        total = sum(got.values())
        kind = f"{cfg.layer_types[i][:6]}/{cfg.mlp_layer_types[i]}"
        core = got.get("kda_core", 0) + got.get("dsa_core", 0)
        print(f"{i:>5} {kind:<18} {got.get('mhc', 0):7.0f} {got.get('mixer', 0):7.0f} {core:7.0f} {got.get('mlp', 0):7.0f} "
              f"{got.get('other', 0):7.0f} {total:8.0f} {plan:8.0f} {total / plan:7.2f}")
        rows.append({"layer": i, "kind": kind, **{k: round(v) for k, v in got.items()}, "plan": plan})
    head = sum(totals.get("head", {}).values()) / args.seq
    print(f" head (embedding, final norm, loss): {head:.0f} B/token")
    offload = {}
    if host:
        distinct = sum(sum(totals.get(str(i), {}).values()) for i in range(cfg.num_layers))
        offload = {kind: round(sum(v) / distinct, 4) for kind, v in host.items()}
        print("host bytes per distinct saved byte, every layer offloaded: "
              + ", ".join(f"{kind} {ratio:.3f}" for kind, ratio in offload.items()))
        for row, i in zip(rows, range(cfg.num_layers)):
            row["offload"] = {kind: round(v[i] / args.seq) for kind, v in host.items()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "dtype": args.dtype, "seq": args.seq, "device": str(device),
                       "recompute_mlp": args.recompute_mlp, "layers": rows, "head": head,
                       "offload_host_per_distinct_byte": offload}, f, indent=1)
    if torch.distributed.is_initialized():   # build_model's one-rank group: its threads end before exit
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
