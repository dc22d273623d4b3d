"""GPU check of the glm5_next model: ``small`` preset forward+backward at 16k and 64k tokens.

Run on one H200 (fla-core 0.6.0 and megatron-core 0.19.2 wheels installed, see the device
README)::

    python tests/gpu/model_small.py --out $OUT/model_small.json

1. Equivalence on a short input: the same weights, bf16 on CUDA (fla ``chunk_kda``, kernels.dsa
   CUDA paths) vs float32 on CPU (the project's plain-torch KDA and blockwise DSA): max |diff| of
   logits and of per-token log-probs (bf16 tolerance).
2. Throughput: bf16 forward+backward (loss = summed token NLL) at each sequence length: seconds
   per step (median of timed steps after one warm-up), tokens/s, peak GPU memory (GiB,
   ``torch.cuda.max_memory_allocated``).

Prints one JSON line per measurement and writes them all to ``--out``. On a machine without a GPU
it runs the same steps on CPU with ``--preset tiny`` and short lengths (a dry run of the script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch


def _report(rows, row):
    print(json.dumps(row), flush=True)
    rows.append(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq", type=int, nargs="*", default=[16384, 65536])
    parser.add_argument("--check-seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--mlp-chunk-tokens", type=int, default=16384)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from model.config import parameter_count, preset
    from model.glm5_next import Glm5NextModel, build_model
    from model.logprobs import token_logprobs

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    cfg = preset(args.preset, mlp_chunk_tokens=args.mlp_chunk_tokens)
    rows: list[dict] = []
    model = build_model(cfg, seed=0)
    counts = parameter_count(cfg)
    _report(rows, {"what": "model", "preset": args.preset, "params_total": counts["total"],
                   "params_active": counts["active"], "device": torch.cuda.get_device_name() if cuda else "cpu"})

    # 1. bf16 on the device vs float32 plain-torch on CPU, same weights, short input.
    ids = torch.randint(4, 9, (1, args.check_seq), generator=torch.Generator().manual_seed(0))
    try:
        # Megatron modules hold process groups and cannot be deep-copied: rebuild and load.
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        from model.cpu_compat import cpu_reference

        with cpu_reference(), torch.no_grad():
            ref_model = Glm5NextModel(cfg).cpu().float().eval()
            ref_model.load_state_dict(state, strict=False)
            ref_logits = ref_model.logits(ref_model.hidden_states(ids)).float()
            ref_lp = token_logprobs(ref_model, ids)
        del ref_model
        test_model = Glm5NextModel(cfg).to(device=device, dtype=torch.bfloat16).eval()
        test_model.load_state_dict(state, strict=False)
        for layer in test_model.layers:
            if layer.is_moe:
                layer.mlp.router._maintain_float32_expert_bias()
        with torch.no_grad():
            dev_ids = ids.to(device)
            logits = test_model.logits(test_model.hidden_states(dev_ids)).float().cpu()
            lp = token_logprobs(test_model, dev_ids).float().cpu()
        del test_model
        _report(rows, {"what": "bf16 device vs fp32 torch path", "seq": args.check_seq,
                       "logits_max_abs_diff": (logits - ref_logits).abs().max().item(),
                       "logits_ref_max_abs": ref_logits.abs().max().item(),
                       "logprob_max_abs_diff": (lp - ref_lp).abs().max().item(),
                       "logprob_mean_abs_diff": (lp - ref_lp).abs().mean().item()})
    except Exception as err:  # report and go on to the throughput runs
        traceback.print_exc()
        _report(rows, {"what": "bf16 device vs fp32 torch path", "error": repr(err)[:500]})

    # 2. bf16 forward+backward throughput and peak memory.
    model = model.to(torch.bfloat16).train()
    for layer in model.layers:
        if layer.is_moe:
            layer.mlp.router._maintain_float32_expert_bias()
    for seq in args.seq:
        ids = torch.randint(4, 9, (1, seq + 1), device=device)
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for step in range(args.steps + 1):
                model.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                loss = model(ids[:, :-1], labels=ids[:, 1:]).sum()
                loss.backward()
                if cuda:
                    torch.cuda.synchronize()
                if step:
                    times.append(time.perf_counter() - t0)
            step_s = statistics.median(times)
            _report(rows, {"what": "fwd+bwd bf16", "seq": seq, "step_s": round(step_s, 4),
                           "tokens_per_s": round(seq / step_s), "loss_per_token": loss.item() / seq,
                           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None})
        except Exception as err:
            traceback.print_exc()
            _report(rows, {"what": "fwd+bwd bf16", "seq": seq, "error": repr(err)[:500],
                           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
