"""The common "rank 0 saves, every rank loads" pattern: per-rank buffers are not copied across ranks."""

import io
import logging

import pytest
import torch

import onebit
from _harness import run_ranks
from _problem import digest, grads, initial_params


def _worker(rank, world, name, kw):
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("onebit.optim").addHandler(handler)
    params = [p.clone().requires_grad_() for p in initial_params()]
    opt = getattr(onebit, name)(params, **kw)
    for step in range(1, 6):
        for p, g in zip(params, grads([p.detach() for p in params], rank, step)):
            p.grad = g
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    # rank 0's checkpoint, handed to every rank
    shared = [buf.getvalue()]
    torch.distributed.broadcast_object_list(shared, src=0)
    fresh = getattr(onebit, name)(params, **kw)
    fresh.load_state_dict(torch.load(io.BytesIO(shared[0]), weights_only=True))
    error = fresh.allreduce.state_dict()["worker_error"]["error"]
    mine = opt.allreduce.state_dict()["worker_error"]["error"]
    for step in range(6, 9):
        for p, g in zip(params, grads([p.detach() for p in params], rank, step)):
            p.grad = g
        fresh.step()
    return {
        "kept_own_error": error is not None and torch.equal(error, mine),
        "error_zero": error is None or not error.any(),
        "warned": any("by rank 0, loaded on world size 2 by rank 1" in m for m in records),
        "digest": digest(params),
    }


@pytest.mark.parametrize("name,kw", [("OnebitAdam", dict(lr=0.01, freeze_step=2)), ("Birder", dict(lr=0.01))])
def test_another_ranks_state_restarts_per_rank_buffers_with_a_warning(name, kw):
    r0, r1 = run_ranks(_worker, 2, name, kw)
    assert r0["kept_own_error"] and not r0["warned"]
    assert r1["error_zero"] and r1["warned"]
    assert r0["digest"] == r1["digest"]
