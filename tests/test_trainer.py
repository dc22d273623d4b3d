"""tasks.trainer.finish_parallel: a job of several ranks ends with its groups destroyed; one process keeps its group.

Each case runs in spawned processes, so the pytest process's own group (other tests') is untouched.
"""

import os

import torch.multiprocessing as mp

from rendezvous import free_port


def _job(rank: int, world: int, port: int, queue) -> None:
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    from megatron.core import parallel_state as ps

    from tasks.trainer import finish_parallel, init_parallel

    init_parallel(context_parallel=world)
    total = torch.tensor([rank + 1.0])
    torch.distributed.all_reduce(total)
    finish_parallel()
    queue.put((rank, float(total), torch.distributed.is_initialized(), ps.model_parallel_is_initialized()))


def _run_job(world: int) -> list[tuple]:
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_job, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * world
    return results


def test_a_two_rank_job_ends_with_its_groups_destroyed():
    # 1 + 2 summed over the two ranks; then neither torch.distributed nor megatron has a group left.
    assert _run_job(2) == [(0, 3.0, False, False), (1, 3.0, False, False)]


def test_one_process_keeps_its_group_for_the_next_stage():
    assert _run_job(1) == [(0, 1.0, True, True)]
