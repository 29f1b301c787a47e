"""``onebit.from_deepspeed_config``: every DeepSpeed OneBitAdam/OneBitLamb argument mapped, and
what does not apply refused; on 2 ranks the result trains as DeepSpeed's update rule."""

import json
import math

import pytest
import torch

import onebit
from _harness import run_ranks
from _problem import grads, initial_params


def _cfg(kind="OneBitAdam", clipping=None, **params):
    cfg = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": kind, "params": params}}
    if clipping is not None:
        cfg["gradient_clipping"] = clipping
    return cfg


def _params():
    return [torch.zeros(3, requires_grad=True)]


def test_onebit_adam_arguments_map():
    opt = onebit.from_deepspeed_config(_cfg(clipping=0, lr=2e-4, betas=[0.8, 0.98], eps=1e-6, weight_decay=0.01,
                                            freeze_step=7, bias_correction=True, cuda_aware=False,
                                            comm_backend_name="nccl", amsgrad=False, eps_inside_sqrt=False,
                                            max_grad_norm=0.0),
                                       _params())
    assert isinstance(opt, onebit.OnebitAdam)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (2e-4, (0.8, 0.98), 0.01)
    assert opt.eps == 1e-6 and opt.max_grad_norm is None  # "gradient_clipping": 0 does not clip
    assert opt.bias_correction is False  # DeepSpeed's update never bias-corrected
    assert opt.refresh_every is None  # nor refreshed its frozen variance
    assert opt.stats["freeze_step"] is None and opt.freeze.freeze_step == 7


def test_onebit_lamb_arguments_map_from_a_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_cfg("onebitlamb", clipping=1.0, lr=1e-3, max_coeff=0.3, min_coeff=0.02, coeff_beta=0.8,
                                    factor_max=3.0, factor_min=0.6, factor_threshold=0.2, comm_backend_name="compressed")))
    opt = onebit.from_deepspeed_config(path, _params())
    assert isinstance(opt, onebit.OnebitLamb)
    assert opt.max_grad_norm == 1.0
    assert opt.freeze.freeze_step == 100_000  # DeepSpeed's default
    assert {k: opt.options[k] for k in ("max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min",
                                         "factor_threshold")} == dict(max_coeff=0.3, min_coeff=0.02, coeff_beta=0.8,
                                                                      factor_max=3.0, factor_min=0.6,
                                                                      factor_threshold=0.2)


def test_zero_one_adam_arguments_map():
    opt = onebit.from_deepspeed_config(_cfg("ZeroOneAdam", clipping=2.0, lr=3e-4, weight_decay=0.01,
                                            var_freeze_step=400, var_update_scaler=8, local_step_scaler=100,
                                            local_step_clipper=4, bias_correction=True), _params())
    assert isinstance(opt, onebit.ZeroOneAdam)
    s = opt.schedule
    assert (s.var_freeze_step, s.var_update_scaler, s.local_step_scaler, s.local_step_clipper) == (400, 8, 100, 4)
    assert opt.bias_correction is False and opt.max_grad_norm == 2.0
    # DeepSpeed's refreshes: the interval doubles without bound, each refresh one step's weight
    assert s.max_refresh_interval is None and s.refresh_weight == "refresh"
    defaults = onebit.from_deepspeed_config(_cfg("zerooneadam", clipping=1.0), _params()).schedule
    assert (defaults.var_freeze_step, defaults.var_update_scaler, defaults.local_step_scaler,
            defaults.local_step_clipper) == (100_000, 16, 32678, 16)  # DeepSpeed's defaults
    with pytest.raises(ValueError, match=r"no argument\(s\) \['freeze_step'\]"):
        onebit.from_deepspeed_config(_cfg("ZeroOneAdam", freeze_step=10), _params())


def test_overrides_win():
    opt = onebit.from_deepspeed_config(_cfg(lr=1e-3), _params(), bias_correction=True, clip_update=None,
                                       max_grad_norm=None, refresh_every=8)
    assert opt.bias_correction is True and opt.clip_update is None and opt.max_grad_norm is None
    assert opt.refresh_every == 8


@pytest.mark.parametrize("kind", ["OneBitAdam", "OneBitLamb", "ZeroOneAdam"])
def test_no_gradient_clipping_clips_at_one_as_deepspeed_0_19_6(kind, recwarn):
    """DeepSpeed 0.19.3-0.19.6's engine clips at 1.0 when the config omits gradient_clipping (earlier
    releases did not): the same, said in a warning, which an explicit value or override silences."""
    with pytest.warns(UserWarning, match=r"no 'gradient_clipping': clipping at 1\.0.*before 0\.19\.3 did not clip"):
        opt = onebit.from_deepspeed_config(_cfg(kind, lr=1e-3), _params())
    assert opt.max_grad_norm == 1.0
    recwarn.clear()
    assert onebit.from_deepspeed_config(_cfg(kind, clipping=0.0, lr=1e-3), _params()).max_grad_norm is None
    assert onebit.from_deepspeed_config(_cfg(kind, lr=1e-3), _params(), max_grad_norm=2.0).max_grad_norm == 2.0
    assert not [w for w in recwarn if "gradient_clipping" in str(w.message)]


@pytest.mark.parametrize("cfg,message", [
    ({"train_batch_size": 8}, "no 'optimizer' block"),
    (_cfg("ZeroOneAdam", amsgrad=True), "no AMSGrad variant"),
    (_cfg("AdamW"), "not a 1-bit optimizer"),
    (_cfg(lr=1e-3, momentum=0.9), r"no argument\(s\) \['momentum'\]"),
    (_cfg(max_coeff=1.0), r"no argument\(s\) \['max_coeff'\]"),
    (_cfg(amsgrad=True), "no AMSGrad variant"),
    (_cfg(eps_inside_sqrt=True), "ignored it"),
    (_cfg(cuda_aware=True), "cuda_aware=true does not apply"),
    (_cfg(max_grad_norm=1.0), "gradient_clipping"),
    (_cfg(comm_backend_name="hccl"), "comm_backend_name 'hccl'"),
])
def test_what_does_not_apply_is_refused(cfg, message):
    with pytest.raises(ValueError, match=message):
        onebit.from_deepspeed_config(cfg, _params())


def test_config_type():
    with pytest.raises(TypeError, match="config must be"):
        onebit.from_deepspeed_config(3, _params())


def _ds_rule(rank, world, steps):
    params = [p.clone().requires_grad_() for p in initial_params()]
    cfg = _cfg(clipping=0.05, lr=0.02, betas=[0.9, 0.99], eps=1e-8, weight_decay=0.01, freeze_step=100)
    opt = onebit.from_deepspeed_config(cfg, params)
    for step in range(1, steps + 1):
        for p, g in zip(params, grads([p.detach() for p in params], rank, step)):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def test_warmup_is_deepspeeds_update_rule():
    """DeepSpeed 0.19.6 OneBitAdam's warm-up, written out: the engine averages and clips the
    gradient, then ``m, v`` EMAs, ``update = m / (sqrt(v) + eps) + wd * x``, ``x -= lr * update``."""
    got = run_ranks(_ds_rule, 2, 6)[0]
    x = [p.clone() for p in initial_params()]
    m = [torch.zeros_like(p) for p in x]
    v = [torch.zeros_like(p) for p in x]
    for step in range(1, 7):
        every = [grads(x, r, step) for r in range(2)]
        g = [sum(gs[i] for gs in every) / 2 for i in range(len(x))]
        norm = math.sqrt(sum(float((t * t).sum()) for t in g))
        g = [t * min(1.0, 0.05 / (norm + 1e-6)) for t in g]
        for i in range(len(x)):
            m[i] = 0.9 * m[i] + 0.1 * g[i]
            v[i] = 0.99 * v[i] + 0.01 * g[i] * g[i]
            x[i] = x[i] - 0.02 * (m[i] / (v[i].sqrt() + 1e-8) + 0.01 * x[i])
    for a, b in zip(got, x):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
