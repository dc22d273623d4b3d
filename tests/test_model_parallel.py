"""TP=2, CP=2 and EP=2 (2 gloo ranks each) forward+backward equal world size 1: loss and every gradient.

Each rank builds the tiny model from the same HF weights (model.convert shards them), runs the
same 512 tokens (CP: its contiguous half), and returns its loss and gradients in HF names. The
world-size-1 run is the reference. Gradients of weights replicated over CP are summed over the
CP ranks (what megatron's DDP all-reduce does); under TP, sharded gradients are concatenated by
model.convert and replicated ones must already agree.
"""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from rendezvous import free_port

SEQ = 512


def _grads_hf(model, cfg):
    """Gradients keyed like the megatron state dict (zeros for buffers and weights without one)."""
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    for k, p in model.named_parameters():
        if p.grad is not None:
            sd[k] = p.grad.detach().clone()
    return sd


def _run(rank, world, tp, cp, port, hf_weights, ids, queue, ep=1, dispatcher=None):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    from model import cpu_compat
    from model.config import preset
    from model.convert import hf_to_megatron, load_megatron_state
    from model.glm5_next import build_model

    cpu_compat.init_process_group(rank, world)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    cfg = preset("tiny", index_topk=32, tensor_model_parallel_size=tp, context_parallel_size=cp,
                 expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                 **({"moe_token_dispatcher_type": dispatcher} if dispatcher else {}))
    model = build_model(cfg)
    load_megatron_state(model, hf_to_megatron(hf_weights, cfg, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
                                              ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ep))
    cp_rank = ps.get_context_parallel_rank()
    local = SEQ // cp
    # Data parallelism (the EP run): each DP rank takes its own rows of the batch.
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    rows = slice(dp_rank * ids.shape[0] // dp, (dp_rank + 1) * ids.shape[0] // dp)
    x = ids[rows, cp_rank * local:(cp_rank + 1) * local]
    y = ids[rows, cp_rank * local + 1:(cp_rank + 1) * local + 1]
    loss = model(x, labels=y).sum()
    loss.backward()
    # What megatron's finalize_model_grads does under DDP: weights that saw only this rank's
    # sequence part (router under the MoE's sequence parallelism, experts replicated over TP with
    # expert TP 1) are summed over the TP ranks.
    for p in model.parameters():
        if p.grad is not None and (getattr(p, "sequence_parallel", False) or not getattr(p, "allreduce", True)):
            torch.distributed.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        # DDP's data-parallel all-reduce (non-expert weights; each expert lives on one EP rank).
        if p.grad is not None and dp > 1 and getattr(p, "allreduce", True):
            torch.distributed.all_reduce(p.grad, group=ps.get_data_parallel_group())
    # numpy arrays travel by value; torch tensors would be shared memory that dies with this process.
    grads = {k: v.numpy() for k, v in _grads_hf(model, cfg).items()}
    ep_rank = ps.get_expert_model_parallel_rank()
    queue.put((rank, ps.get_tensor_model_parallel_rank(), cp_rank, loss.item(), grads, ep_rank))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _spawn(tp, cp, hf_weights, ids, ep=1, dispatcher=None):
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_run, args=(r, 2, tp, cp, port, hf_weights, ids, queue, ep, dispatcher)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted((queue.get(timeout=600) for _ in procs), key=lambda r: r[0])
    results = [r[:4] + ({k: torch.from_numpy(v) for k, v in r[4].items()}, r[5]) for r in results]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


def _reference(batch):
    from model.config import preset
    from model.convert import megatron_to_hf
    from model.glm5_next import build_model

    cfg = preset("tiny", index_topk=32)
    model = build_model(cfg, seed=7)
    with torch.no_grad():  # move norms/biases off their init so every weight matters
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    hf = megatron_to_hf([[model.state_dict()]], cfg)
    ids = torch.randint(4, 9, (batch, SEQ + 1), generator=torch.Generator().manual_seed(5))
    loss = model(ids[:, :SEQ], labels=ids[:, 1:]).sum()
    loss.backward()
    grads = megatron_to_hf([[_grads_hf(model, cfg)]], cfg)
    return cfg, hf, ids, loss.item(), grads


@pytest.fixture(scope="module")
def reference():
    return _reference(batch=1)


def _compare(grads, ref, label):
    worst = 0.0
    for k, g in ref.items():
        d = (grads[k] - g).abs().max().item()
        scale = g.abs().max().item() + 1e-6
        worst = max(worst, d / scale)
        assert d <= 1e-4 * scale + 1e-6, f"{label}: {k} max|diff| {d:.2e} (grad scale {scale:.2e})"
    print(f"{label}: worst relative grad diff {worst:.2e}")


def test_tensor_parallel_2_equals_world_size_1(reference):
    cfg, hf, ids, ref_loss, ref_grads = reference
    from model.convert import megatron_to_hf

    results = _spawn(2, 1, hf, ids)
    losses = [r[3] for r in results]
    print(f"TP=2 loss {losses} vs {ref_loss}")
    assert all(abs(l - ref_loss) <= 1e-4 * abs(ref_loss) for l in losses)
    by_tp = [r[4] for r in sorted(results, key=lambda r: r[1])]
    _compare(megatron_to_hf([by_tp], cfg), ref_grads, "TP=2")


def test_context_parallel_2_equals_world_size_1(reference):
    cfg, hf, ids, ref_loss, ref_grads = reference
    from model.convert import megatron_to_hf

    results = _spawn(1, 2, hf, ids)
    loss = sum(r[3] for r in results)
    print(f"CP=2 loss {loss} vs {ref_loss}")
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss)
    summed = {k: results[0][4][k] + results[1][4][k] for k in results[0][4]}
    _compare(megatron_to_hf([[summed]], cfg), ref_grads, "CP=2")


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_expert_parallel_2_with_data_parallel_equals_world_size_1(dispatcher):
    """EP=2 (experts 0-3 on rank 0, 4-7 on rank 1), DP=2 over a batch of 2 rows, vs one process;
    megatron's alltoall dispatcher (the default under EP) and its allgather one."""
    cfg, hf, ids, ref_loss, ref_grads = _reference(batch=2)
    from model.config import preset
    from model.convert import megatron_to_hf

    assert preset("tiny", expert_model_parallel_size=2).moe_token_dispatcher_type == "alltoall"
    results = _spawn(1, 1, hf, ids, ep=2, dispatcher=dispatcher)
    loss = sum(r[3] for r in results)
    print(f"EP=2 ({dispatcher}) loss {loss} vs {ref_loss}")
    assert abs(loss - ref_loss) <= 1e-4 * abs(ref_loss)
    by_ep = [[r[4]] for r in sorted(results, key=lambda r: r[5])]
    _compare(megatron_to_hf(by_ep, cfg), ref_grads, "EP=2")


def test_single_process_ignores_a_stale_master_port_held_by_another_process():
    """One process needs no port: a MASTER_PORT another process listens on (the CI failure,
    a pytest process's gloo store inherited by `pyflyte run`) must not stop it."""
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        code = ("import torch; from model import cpu_compat; cpu_compat.init_process_group(0, 1); "
                "t = torch.ones(3); torch.distributed.all_reduce(t); print(torch.distributed.get_world_size(), t.sum().item())")
        out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=env,
                             capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["1", "3.0"]
