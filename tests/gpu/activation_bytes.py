"""Measure the activation bytes autograd saves per token, per layer and module, against the SFT memory plan.

    python tests/gpu/activation_bytes.py --preset small --seq 4096 [--dtype bfloat16]

One training forward of a freshly built model (no recompute, no offload) runs under
``torch.autograd.graph.saved_tensors_hooks``; every tensor saved for backward is attributed to
the innermost module running when it was saved (parameters and views of a storage already
counted are skipped). The table prints saved bytes per token for each layer, split into the
mHC / mixer / MLP parts, next to :func:`tasks.sft.activation_bytes_per_token`, so the plan can be checked on any machine: on CPU the mixers run the
plain-torch KDA and blockwise DSA, on CUDA fla ``chunk_kda`` and the Triton DSA kernels (their
saved tensors differ; the mHC, norms, projections and MoE are the same code on both).
"""

from __future__ import annotations

import argparse
import collections
import json

import torch


def measure(model, ids: torch.Tensor) -> dict[str, dict[str, int]]:
    """Saved-for-backward bytes of ``model(ids[:, :-1], labels=ids[:, 1:])`` by layer and part.

    Returns ``{layer_key: {part: bytes}}``; layer keys ``"0".."L-1"`` and ``"head"`` (embedding,
    final norm, loss); parts ``mhc``, ``mixer`` (projections, convolutions, gates, norms),
    ``kda_core`` / ``dsa_core`` (the recurrence, the indexer and sparse attention: the paths that
    differ between CPU and CUDA), ``mlp``, ``other`` (layer norms, stream merges).
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
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
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--mlp-chunk-tokens", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from flyte_standin import install_flytekit_stand_in

    install_flytekit_stand_in()
    from model.config import preset
    from model.glm5_next import build_model
    from tasks.sft import activation_bytes_per_token

    dtype = getattr(torch, args.dtype)
    cfg = preset(args.preset, mlp_chunk_tokens=args.mlp_chunk_tokens)
    model = build_model(cfg, seed=0, dtype=dtype).train()
    device = next(model.parameters()).device
    ids = torch.randint(4, 9, (1, args.seq + 1), device=device)
    totals = measure(model, ids)
    width = torch.finfo(dtype).bits // 8
    rows = []
    print(f"{args.preset} {args.dtype} on {device}, {args.seq} tokens: saved bytes per token")
    print(f"{'layer':>5} {'kind':<18} {'mhc':>7} {'mixer':>7} {'core':>7} {'mlp':>7} {'other':>7} {'total':>8} "
          f"{'plan':>8} {'x plan':>7}")
    for i in range(cfg.num_layers):
        got = {k: v / args.seq for k, v in totals.get(str(i), {}).items()}
        planned = activation_bytes_per_token(cfg, i, 1, width, on_gpu=device.type == "cuda")
        plan = sum(v for k, v in planned.items() if k != "mlp_input")
        total = sum(got.values())
        kind = f"{cfg.layer_types[i][:6]}/{cfg.mlp_layer_types[i]}"
        core = got.get("kda_core", 0) + got.get("dsa_core", 0)
        print(f"{i:>5} {kind:<18} {got.get('mhc', 0):7.0f} {got.get('mixer', 0):7.0f} {core:7.0f} {got.get('mlp', 0):7.0f} "
              f"{got.get('other', 0):7.0f} {total:8.0f} {plan:8.0f} {total / plan:7.2f}")
        rows.append({"layer": i, "kind": kind, **{k: round(v) for k, v in got.items()}, "plan": plan})
    head = sum(totals.get("head", {}).values()) / args.seq
    print(f" head (embedding, final norm, loss): {head:.0f} B/token")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "dtype": args.dtype, "seq": args.seq, "device": str(device),
                       "layers": rows, "head": head}, f, indent=1)


if __name__ == "__main__":
    main()
