"""channels_last and other non-contiguous parameters work in every optimizer and give exactly
what the same values in contiguous parameters give (the math runs in logical order)."""

import pytest
import torch

from _harness import run_ranks
from _problem import OPTIMIZERS, data, digest, initial_params, last_stage, optimizer_class


def _both(rank, world, name, kw):
    return _run(rank, world, name, kw, "strided"), _run(rank, world, name, kw, "contiguous")


def _run(rank, world, name, kw, layout):
    gen = torch.Generator().manual_seed(7)
    conv = torch.randn(4, 3, 2, 2, generator=gen)
    mat = torch.randn(5, 6, generator=gen)
    if layout == "strided":
        conv = conv.to(memory_format=torch.channels_last)
        mat = mat.t().contiguous().t()  # a transposed layout: strides (1, 5)
    params = [conv.requires_grad_(), mat.requires_grad_()]
    assert (not params[0].is_contiguous()) == (layout == "strided")
    opt = optimizer_class(name)(params, weight_decay=0.01, **kw)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(6):
        for p in params:
            p.grad = torch.randn(p.shape, generator=data).to(memory_format=torch.contiguous_format)
        opt.step()
    sd = opt.state_dict()["onebit"]["flat"]
    return [p.detach().contiguous() for p in params], {k: v.clone() for k, v in sd.items()}, opt.stats["stage"]


@pytest.mark.parametrize("name,kw", OPTIMIZERS, ids=[n for n, _ in OPTIMIZERS])
def test_channels_last_and_transposed_parameters_equal_contiguous_ones(name, kw):
    strided, plain = zip(*run_ranks(_both, 2, name, kw))  # both layouts in the same two processes
    for (ps, ss, stage), (pc, sc, _) in zip(strided, plain):
        assert all(torch.equal(a, b) for a, b in zip(ps, pc))
        assert all(torch.equal(ss[k], sc[k]) for k in sc)
        assert all(torch.equal(a, b) for a, b in zip(ps, strided[0][0]))  # replicas
        assert stage == last_stage(name)


@pytest.mark.parametrize("name,kw", OPTIMIZERS, ids=[n for n, _ in OPTIMIZERS])
def test_options_that_would_be_ignored_are_refused(name, kw):
    make = optimizer_class(name)
    w, v = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    option = "sync_every" if name == "diloco" else "eps"  # DiLoCo's groups are its inner AdamW's: eps is theirs
    with pytest.raises(ValueError, match=rf"param group 1 sets \['{option}'\], which .* takes only for all parameters"):
        make([{"params": [w]}, {"params": [v], option: 1}], **kw)
    with pytest.raises(TypeError, match=r"float64 parameters are not supported .* shapes \[\(2,\)\]"):
        make([w, torch.nn.Parameter(torch.ones(2, dtype=torch.float64))], **kw)
    opt = make([{"params": [w], "name": "trunk"}], **kw)  # keys the optimizer does not know are the user's
    with pytest.raises(ValueError, match="cannot add a param group after construction"):
        opt.add_param_group({"params": [v]})


def _closure_and_plain(rank, world, name, kw):
    """The same steps taken as ``step(closure)`` (inside ``no_grad``, as a trainer may call it) and as
    backward then ``step()``."""
    out = []
    for use_closure in (True, False):
        params = [p.clone().requires_grad_() for p in initial_params()]
        opt = optimizer_class(name)(params, **kw)
        losses = []
        for step in range(1, 5):
            x, y = data(rank, step)

            def closure():
                opt.zero_grad()
                loss = 0.5 * (x @ params[0] + params[1] - y).square().mean()
                loss.backward()
                return loss

            if use_closure:
                with torch.no_grad():
                    losses.append(float(opt.step(closure)))
            else:
                losses.append(float(closure()))
                assert opt.step() is None
        out.append((digest(params), losses))
    return out


@pytest.mark.parametrize("name,kw", OPTIMIZERS, ids=[n for n, _ in OPTIMIZERS])
def test_step_with_a_closure_returns_its_loss_and_takes_the_same_step(name, kw):
    for (with_closure, closure_losses), (plain, plain_losses) in run_ranks(_closure_and_plain, 2, name, kw):
        assert with_closure == plain and closure_losses == plain_losses
