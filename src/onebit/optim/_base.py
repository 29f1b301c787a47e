"""What every onebit optimizer shares: argument checks, the fused flat state, the process group.

The optimizers average across the group themselves (on a DDP-wrapped model they switch
DDP's all-reduce off, ``_ddp.py``). Their per-parameter state lives in flat fp32 buffers
(one slot per parameter, parameters in group order, so each param group is one contiguous
segment) and ``self.state[p]`` holds views into them -- the whole model's momentum is one
tensor for one collective.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import zlib
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from .. import comm
from ..comm import _dist
from ..ops import max_abs
from ._ddp import ddp_modules_holding, has_local_gradient_hook, register_local_gradient_hook
from ._overlap import Buckets

__all__ = ["FlatState", "OnebitOptimizer", "ReplicaDivergence", "check_adam_args", "check_betas", "check_bool", "check_nonneg", "check_optional_positive", "check_positive"]

_log = logging.getLogger("onebit.optim")


def check_positive(name: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"Invalid {name} value: {value!r} (expected a number)")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"Invalid {name} value: {value}")
    return float(value)


def check_nonneg(name: str, value: object) -> float:
    return check_positive(name, value, allow_zero=True)


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"Invalid {name} value: {value!r} (expected a bool)")
    return value


def check_optional_positive(name: str, value: object) -> float | None:
    """``None`` (off) or a positive finite number: ``clip_update``, ``max_grad_norm``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"Invalid {name} value: {value!r} (expected None or a positive number)")
    return float(value)


def check_betas(betas: object) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"Invalid betas: {betas!r} (expected a pair of floats)")
    for i, b in enumerate(betas):
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise TypeError(f"Invalid beta parameter at index {i}: {b!r}")
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
    return float(betas[0]), float(betas[1])


def check_adam_args(lr: object, betas: object, eps: object, weight_decay: object) -> tuple[float, float]:
    """Validate the options every Adam-like optimizer takes; returns the betas."""
    check_nonneg("learning rate", lr)
    parsed = check_betas(betas)
    check_nonneg("epsilon", eps)
    check_nonneg("weight_decay", weight_decay)
    return parsed


class FlatState:
    """Named flat fp32 buffers laid out like the parameters, with per-parameter views."""

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params
        self.offsets: list[tuple[int, int]] = []
        start = 0
        for p in params:
            self.offsets.append((start, start + p.numel()))
            start += p.numel()
        self.numel = start
        self.device = params[0].device
        self.buffers: dict[str, Tensor] = {}

    def new(self, name: str) -> Tensor:
        """A zeroed flat buffer registered under ``name``."""
        self.buffers[name] = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        return self.buffers[name]

    def views(self, name: str) -> list[Tensor]:
        """Per-parameter views (shaped like the parameters) of buffer ``name``."""
        return self.split(self.buffers[name])

    def split(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views (shaped like the parameters) of a flat buffer laid out like them."""
        return [flat[lo:hi].view(p.shape) for p, (lo, hi) in zip(self.params, self.offsets)]

    def rename(self, old: str, new: str) -> None:
        """Register buffer ``old`` under the name ``new`` (its values unchanged)."""
        self.buffers[new] = self.buffers.pop(old)

    def gather_grads(self, out: Tensor, indices: Iterable[int] | None = None, base: int = 0) -> None:
        """Copy every gradient (cast to fp32) into ``out``, zeros where a grad is None; or only
        those of parameters ``indices``, into ``out`` starting at flat offset ``base``."""
        for i in range(len(self.params)) if indices is None else indices:
            p, (lo, hi) = self.params[i], self.offsets[i]
            if p.grad is None:
                out[lo - base : hi - base].zero_()
            else:
                out[lo - base : hi - base].copy_(p.grad.reshape(-1))


class ReplicaDivergence(RuntimeError):
    """The ranks' parameters are no longer bit-identical."""


class OnebitOptimizer(Optimizer):
    """Base of the onebit optimizers: process group, flat state, stats and checkpoint extras.

    Options every optimizer takes (keyword-only): ``timeout`` (per collective),
    ``broadcast_parameters`` (rank 0's parameters to all at construction), ``on_nonfinite``
    (``"skip"``: a non-finite gradient on any rank makes every rank skip the step, counted
    in ``stats["skipped_steps"]``; ``"raise"``: ``FloatingPointError`` on every rank) and
    ``check_replicas_every`` (K > 0: :meth:`check_replicas` after every K-th step) and
    ``max_grad_norm``.

    ``max_grad_norm`` (gradient clipping, DeepSpeed's ``gradient_clipping``): where the
    optimizer forms the averaged gradient -- the warm-up of 1-bit Adam and 1-bit LAMB,
    SoftSignSGD, Comp-AMS's average of compressed gradients, OnebitAdamNaive's compressed
    average -- that gradient is scaled by ``min(1, max_grad_norm / (norm + 1e-6))`` over all
    parameters, exactly what ``torch.nn.utils.clip_grad_norm_`` does on one process. Where
    it never exists -- the compression stage of 1-bit Adam and 1-bit LAMB, Birder, QAdam,
    which exchange momentum or updates -- each rank clips its own local gradient the same
    way, in place in ``p.grad`` as ``clip_grad_norm_`` would, before it enters its moments
    (what DeepSpeed's engine did in that stage). Calling
    ``clip_grad_norm_`` yourself before ``step()`` clips the *local* gradient of each rank
    (never the average, which does not exist yet), at every stage.

    Missing gradients, one rule for every optimizer: a parameter whose ``.grad`` is ``None``
    on every rank (frozen, or unused this step) is not updated -- no step, no weight decay,
    its moments untouched -- as in ``torch.optim``. A parameter with a gradient on some ranks
    only counts as a zero gradient on the others (the average DDP would form). Which
    parameters have a gradient somewhere travels with the non-finite agreement (one flag
    per parameter in its all-reduce), so every rank takes the same decision.
    Subclasses implement :meth:`_step` and list their flat buffers in ``_flat_names``.
    """

    _flat_names: tuple[str, ...] = ()

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        group: comm.Group,
        timeout: float | timedelta | None,
        broadcast_parameters: bool,
        on_nonfinite: str = "skip",
        check_replicas_every: int = 0,
        max_grad_norm: float | None = None,
    ) -> None:
        if on_nonfinite not in ("skip", "raise"):
            raise ValueError(f"Invalid on_nonfinite value: {on_nonfinite!r} (expected 'skip' or 'raise')")
        if isinstance(check_replicas_every, bool) or not isinstance(check_replicas_every, int) or check_replicas_every < 0:
            raise ValueError(f"Invalid check_replicas_every value: {check_replicas_every!r} (expected an int >= 0)")
        self.max_grad_norm = check_optional_positive("max_grad_norm", max_grad_norm)
        self.on_nonfinite = on_nonfinite
        self.check_replicas_every = check_replicas_every
        super().__init__(params, defaults)
        # Param groups may override the defaults: validate what each group will use.
        # A constructor option that is not per-group (eps, say) given in a group would be ignored: refuse it.
        global_only = set(inspect.signature(type(self).__init__).parameters) - set(defaults) - {"self", "params"}
        for i, g in enumerate(self.param_groups):
            ignored = sorted(global_only & set(g))
            if ignored:
                raise ValueError(
                    f"param group {i} sets {ignored}, which {type(self).__name__} takes only for all "
                    f"parameters (per-group options: {sorted(defaults)})"
                )
            if "lr" in g:
                check_nonneg("learning rate", g["lr"])
            if "betas" in g:
                check_betas(g["betas"])
            if "weight_decay" in g:
                check_nonneg("weight_decay", g["weight_decay"])
        self.process_group = comm.resolve_group(group)
        self.timeout = _dist.to_timedelta(timeout)
        self.world_size = comm.get_world_size(self.process_group)
        self.rank = comm.get_rank(self.process_group)
        params = [p for g in self.param_groups for p in g["params"]]
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        if any(not p.is_floating_point() for p in params):
            raise TypeError("all parameters must be floating-point tensors")
        wide = [tuple(p.shape) for p in params if p.dtype == torch.float64]
        if wide:
            # The state and the math are fp32: an fp64 parameter would be rounded to fp32 every step.
            raise TypeError(f"float64 parameters are not supported (state and updates are fp32), got shapes {wide}; "
                            "use float32, bfloat16 or float16 parameters")
        self._check_same_parameters_everywhere(params)
        if broadcast_parameters:
            with torch.no_grad():
                for p in params:
                    if p.is_contiguous():
                        comm.broadcast(p.data, 0, self.process_group, self.timeout)
                    else:  # channels_last and other layouts travel in logical order
                        buf = p.data.contiguous()
                        comm.broadcast(buf, 0, self.process_group, self.timeout)
                        p.data.copy_(buf)
        self.flat = FlatState(params)
        self._step_count = 0
        self._active: list[bool] = [True] * len(params)
        self._skipped = 0
        self._bytes_total = 0
        self._bytes_last = 0
        self._last_stage: str | None = None
        self._ddp_checked = False
        self._buckets: Buckets | None = None  # the overlapped exchange (_overlap.OverlappedExchange)
        for name in self._flat_names:
            self.flat.new(name)
        self._link_state()
        self._check_ddp(construction=True)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the fused flat state and the collectives are sized for the
        parameters given then, and every rank must add the same ones at the same step."""
        if hasattr(self, "flat"):
            raise ValueError(
                f"{type(self).__name__} cannot add a param group after construction (its flat state and "
                "collectives are sized for the parameters it was built with); pass every group to the "
                "constructor, with lr=0 for groups that start later"
            )
        super().add_param_group(param_group)

    # ------------------------------------------------------------------ helpers
    def _check_same_parameters_everywhere(self, params: list[Tensor]) -> None:
        """Compare parameter count, total size and shapes across ranks with one small all-gather.

        A mismatch would otherwise surface as a hang or a size error deep inside the first
        collective; here every rank raises the same ``ValueError`` at construction.
        """
        if self.world_size == 1:
            return
        shapes = ";".join("x".join(map(str, p.shape)) for p in params)
        mine = [len(params), sum(p.numel() for p in params), zlib.crc32(shapes.encode())]
        table = _dist.all_gather_object_sizes(mine, self.process_group, self.timeout, params[0].device)
        if not bool((table == table[0]).all()):
            rows = ", ".join(f"rank {r}: {int(t[0])} tensors / {int(t[1])} values" for r, t in enumerate(table))
            raise ValueError(f"parameters differ across ranks ({rows}; shape checksums {table[:, 2].tolist()})")

    def attach_ddp(self, model: DistributedDataParallel | None = None) -> list[DistributedDataParallel]:
        """Switch off DDP's all-reduce on ``model`` (default: every DDP module holding these
        parameters) with :func:`onebit.optim.local_gradient_hook`; see :func:`onebit.optim.attach`."""
        found = ddp_modules_holding(self.flat.params)
        if model is not None:
            if not any(ddp is model for ddp in found):
                raise ValueError(f"the DistributedDataParallel model holds none of {type(self).__name__}'s parameters")
            found = [model]
        for ddp in found:
            register_local_gradient_hook(ddp, type(self).__name__)
        return found

    def _check_ddp(self, construction: bool) -> None:
        """A DDP module holding these parameters gets :func:`local_gradient_hook` at construction
        (DDP's fp32 all-reduce would otherwise run before this optimizer's exchange, and nothing
        would be saved); one found at the first step without it raises, because DDP takes a
        hook only before its first backward, which has run by then."""
        if self.world_size == 1:
            return
        if construction:
            if self.attach_ddp():
                _log.info("%s: DDP's gradient all-reduce switched off (local_gradient_hook); the optimizer "
                          "exchanges in step()", type(self).__name__)
            return
        if not all(has_local_gradient_hook(ddp) for ddp in ddp_modules_holding(self.flat.params)):
            raise ValueError(
                f"the parameters of {type(self).__name__} belong to a DistributedDataParallel model wrapped after "
                f"the optimizer was built: DDP all-reduced the gradients in fp32 and {type(self).__name__} would "
                "exchange them again, saving nothing. Call onebit.attach(optimizer) after wrapping the model "
                "and before the first backward (Accelerate: after accelerator.prepare; HF Trainer: "
                "callbacks=[onebit.integrations.transformers.AttachCallback()]), or build the optimizer after wrapping"
            )

    def _link_state(self) -> None:
        """Point ``self.state[p][name]`` at the flat buffers' views (for inspection)."""
        views = {name: self.flat.views(name) for name in self.flat.buffers}
        for i, p in enumerate(self.flat.params):
            self.state[p] = {name: v[i] for name, v in views.items()}

    def _hyper(self, key: str) -> list[Any]:
        """Per-parameter value of a param-group option, read afresh (LR schedulers change it)."""
        return [g[key] for g in self.param_groups for _ in g["params"]]

    # ------------------------------------------------------------------ API
    @property
    def stats(self) -> dict[str, Any]:
        """``step``, ``stage`` (of the last step), ``bytes_sent`` (this rank, last step),
        ``bytes_sent_total`` and ``freeze_step`` (last warm-up step, once known); with
        ``overlap=True`` also ``overlap``, the fraction of the last step's exchange that ran
        alongside backward, and ``buckets_in_backward``, the buckets launched there."""
        overlapped = {} if self._buckets is None else {
            "overlap": self._buckets.overlap, "buckets_in_backward": self._buckets.launched_in_backward}
        return {
            "step": self._step_count,
            "stage": self._last_stage or self._stage(),
            "bytes_sent": self._bytes_last,
            "bytes_sent_total": self._bytes_total,
            "freeze_step": self._freeze_step_stat(),
            "skipped_steps": self._skipped,
            **overlapped,
        }

    def _stage(self) -> str:
        return "compressed"

    def _freeze_step_stat(self) -> int | None:
        return None

    # torch.amp.GradScaler then hands us ``grad_scale`` (gradients still scaled, or None) and
    # ``found_inf`` as attributes and leaves the skip decision to step(): it must be the same
    # decision on every rank, which a rank-local GradScaler cannot make.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One optimizer step (the closure, if given, is evaluated with grad enabled first).

        If any rank has a non-finite gradient (or its GradScaler found one), every rank skips
        the step and leaves all state untouched (``stats["skipped_steps"]`` counts them), or
        raises ``FloatingPointError`` with ``on_nonfinite="raise"``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _dist.check_world_size(self.process_group, self.world_size, type(self).__name__)
        if not self._ddp_checked:  # the model may have been wrapped after the optimizer was built
            self._check_ddp(construction=False)
            self._ddp_checked = True
        if self._buckets is not None and (getattr(self, "grad_scale", None) is not None
                                          or getattr(self, "found_inf", None) is not None):
            raise ValueError(
                f"{type(self).__name__}(overlap=True) exchanged the gradients during backward, before GradScaler "
                "could unscale them or find infs: use overlap=False with GradScaler"
            )
        with comm.measure() as meter:
            if self._buckets is not None:
                self._buckets.flush()  # before the agreement: every rank issues the same sequence
            if self._agree_nonfinite():
                self._skipped += 1
                if self._buckets is not None:
                    self._abandon_buckets()
            else:
                self._step_count += 1
                self._last_stage = self._stage()
                self._step()
                if self.check_replicas_every and self._step_count % self.check_replicas_every == 0:
                    self.check_replicas()
        sent = meter.bytes_sent + (self._buckets.done() if self._buckets is not None else 0)
        self._bytes_last = sent
        self._bytes_total += sent
        return loss

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Gradient accumulation with ``overlap=True``: backward passes inside the block only
        accumulate; the next one outside it starts the exchange (as ``DistributedDataParallel.no_sync``).
        Without overlap the exchange happens in ``step()`` anyway, and the block changes nothing."""
        return self._buckets.no_sync() if self._buckets is not None else contextlib.nullcontext()

    def _abandon_buckets(self) -> None:
        """Every rank skips this step: wait for and drop the exchanges already launched."""
        raise NotImplementedError

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Raise :class:`ReplicaDivergence` naming the first parameter that differs between ranks.

        Cheap: each parameter's bits, read as integers, are summed on its device, and the
        sums (8 bytes per parameter) are all-gathered -- any single-value difference shows.
        """
        if self.world_size == 1:
            return
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
        sums = torch.stack([p.detach().reshape(-1).view(ints[p.element_size()]).sum(dtype=torch.int64)
                            for p in self.flat.params])
        table = _dist.all_gather_object_sizes(sums.tolist(), self.process_group, self.timeout, self.flat.device)
        differs = (table != table[0]).any(dim=0).nonzero()
        if differs.numel():
            i = int(differs[0])
            names = [n for g in self.param_groups for n in g.get("param_names", [None] * len(g["params"]))]
            name = names[i] or f"parameter {i} (shape {tuple(self.flat.params[i].shape)})"
            ranks = [r for r in range(self.world_size) if table[r, i] != table[0, i]]
            raise ReplicaDivergence(f"replicas differ after step {self._step_count}: {name} on ranks {ranks} "
                                    "differs from rank 0")

    def _agree_nonfinite(self) -> bool:
        """Unscale (GradScaler), then one tiny all-reduce(max) of "some gradient here is not finite"."""
        grads = [p.grad for p in self.flat.params if p.grad is not None]
        if any(g.is_sparse for g in grads):
            raise ValueError("onebit optimizers do not support sparse gradients")
        scale = getattr(self, "grad_scale", None)
        if scale is not None and grads:
            torch._foreach_mul_(grads, scale.double().reciprocal().float().to(grads[0].device))
        # flag[0]: some gradient here is not finite; flag[1 + i]: parameter i has a gradient here.
        flag = torch.zeros(1 + len(self.flat.params), dtype=torch.float32, device=self.flat.device)
        if grads:
            peaks = torch.stack([max_abs(g.detach()).float() if g.numel() else flag[0] for g in grads])
            flag[0] = (~torch.isfinite(peaks)).any()
        if len(grads) == len(self.flat.params):
            flag[1:] = 1.0  # the common case, without a host-to-device copy
        else:
            flag[1:] = torch.tensor([p.grad is not None for p in self.flat.params], dtype=torch.float32)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            flag[0] = torch.maximum(flag[0], found_inf.reshape(()).to(flag))
        if self.world_size > 1:
            _dist.all_reduce_max(flag, self.process_group, self.timeout)
        values = flag.tolist()
        self._active = [v > 0 for v in values[1:]]
        if not values[0]:
            return False
        if self.on_nonfinite == "raise":
            local = [i for i, p in enumerate(self.flat.params) if p.grad is not None and not torch.isfinite(p.grad).all()]
            where = f"parameter {local[0]} (shape {tuple(self.flat.params[local[0]].shape)}) on rank {self.rank}" if local \
                else f"another rank than {self.rank}"
            raise FloatingPointError(f"non-finite gradient at step {self._step_count + 1}: {where}")
        _log.warning("step %d skipped on every rank: non-finite gradient", self._step_count + 1)
        return True

    def _step(self) -> None:
        raise NotImplementedError

    def _allreduce(self, buffer: Tensor) -> Tensor:
        """Exact fp32 average over the group, in place (the warm-up exchange)."""
        return comm.all_reduce_mean(buffer, self.process_group, self.timeout)

    def _clip_grad_(self, grad: Tensor) -> Tensor:
        """``clip_grad_norm_`` on the flat gradient buffer (zeros where a parameter has no
        gradient): scaled by ``min(1, max_grad_norm / (||grad|| + 1e-6))``, on the device."""
        if self.max_grad_norm is not None:
            grad.mul_(self._clip_coef(torch.linalg.vector_norm(grad)))
        return grad

    def _clip_coef(self, norm: Tensor) -> Tensor:
        """``min(1, max_grad_norm / (norm + 1e-6))``, as ``clip_grad_norm_`` scales, on the device."""
        return (self.max_grad_norm / (norm + 1e-6)).clamp_(max=1.0)

    def _new_grad_buffer(self) -> Tensor:
        """A flat fp32 buffer for the gradients (``self._grad``), where an exchange averages them."""
        return torch.zeros(self.flat.numel, dtype=torch.float32, device=self.flat.device)

    def _averaged_grads(self, exchange: Callable[[Tensor], Tensor]) -> list[Tensor]:
        """The gradients gathered into ``self._grad`` (zeros where missing), averaged in place by
        ``exchange``, as per-parameter views shaped like the parameters."""
        self.flat.gather_grads(self._grad)
        return self.flat.split(exchange(self._grad))

    def _local_grads(self) -> list[Tensor | None]:
        """This rank's own gradients (``None`` where it has none), read where they lie, with
        no flat copy; with ``max_grad_norm`` first scaled in place by ``min(1, max_grad_norm /
        (||g|| + 1e-6))``, the norm taken in fp32 over all of them -- ``clip_grad_norm_``
        on this rank (the stages whose averaged gradient never exists)."""
        grads = [p.grad for p in self.flat.params]
        present = [g for g in grads if g is not None]
        if self.max_grad_norm is not None and present:
            coef = self._clip_coef(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g, dtype=torch.float32) for g in present])))
            for g in present:
                g.mul_(coef)
        return grads

    def _clipped(self, exchange: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        """``exchange`` (which returns the average of a gradient buffer) followed by clipping it."""
        if self.max_grad_norm is None:
            return exchange
        return lambda buffer: self._clip_grad_(exchange(buffer))

    @staticmethod
    def _restore_collective(collective: Any, state: Mapping[str, Any], own_state: bool) -> None:
        """Restore a compressed collective's errors (and random state), or restart them -- at zero,
        freshly seeded -- when ``state`` is another rank's or from another world size."""
        if own_state:
            collective.load_state_dict(state)
        else:
            collective.reset()

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _layout_for(self, state: Mapping[str, Any]) -> None:
        """Name the flat buffers as in the saved :meth:`_extra_state` ``state`` (1-bit Adam's
        differ between its stages), before they are checked and loaded."""

    def _load_extra_state(self, state: Mapping[str, Any], own_state: bool) -> None:
        """Restore :meth:`_extra_state`; ``own_state`` is False when the state was saved by another
        rank or on another world size (the per-rank buffers then restart)."""

    def state_dict(self) -> dict[str, Any]:
        """Param groups plus everything needed to resume bit-exactly (loads with ``weights_only=True``)."""
        sd = super().state_dict()
        sd["state"] = {}  # the per-parameter views are saved once, as the flat buffers below
        sd["onebit"] = {
            "world_size": self.world_size,
            "rank": self.rank,
            "step": self._step_count,
            "bytes_sent_total": self._bytes_total,
            "flat": {name: buf.clone() for name, buf in self.flat.buffers.items()},
            **self._extra_state(),
        }
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; a state saved by another rank or on another world size
        restarts the per-rank error buffers and random state (with a warning)."""
        if not isinstance(state_dict, Mapping) or "onebit" not in state_dict:
            raise ValueError(
                f"not a {type(self).__name__} state_dict: missing the 'onebit' entry "
                f"(keys: {sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__})"
            )
        extra = state_dict["onebit"]
        missing = {"world_size", "step", "bytes_sent_total", "flat"} - set(extra)
        if missing or "param_groups" not in state_dict:
            raise ValueError(
                f"incomplete {type(self).__name__} state_dict: missing {sorted(missing) or ['param_groups']} "
                "(truncated, or saved by another version)"
            )
        self._layout_for(extra)
        flat = extra["flat"]
        if set(flat) != set(self.flat.buffers):
            raise ValueError(f"state_dict holds buffers {sorted(flat)}, expected {sorted(self.flat.buffers)}")
        for name, buf in flat.items():
            if buf.numel() != self.flat.numel:
                raise ValueError(
                    f"state_dict buffer {name!r} has {buf.numel()} values, the parameters have {self.flat.numel}"
                )
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        for name, buf in flat.items():
            self.flat.buffers[name].copy_(buf)
        self._link_state()
        self._step_count = int(extra["step"])
        self._bytes_total = int(extra["bytes_sent_total"])
        # Worker/server errors (and Birder's random state) belong to the rank that saved them.
        saved_rank = int(extra.get("rank", self.rank))  # checkpoints of earlier versions have no rank
        own_state = int(extra["world_size"]) == self.world_size and saved_rank == self.rank
        if not own_state:
            _log.warning(
                "%s state saved on world size %d by rank %d, loaded on world size %d by rank %d: per-rank "
                "error-feedback buffers re-created as zeros, random state reseeded for this rank; save and "
                "load one state_dict per rank to resume exactly",
                type(self).__name__, extra["world_size"], saved_rank, self.world_size, self.rank,
            )
        try:
            self._load_extra_state(extra, own_state)
        except KeyError as exc:
            raise ValueError(
                f"incomplete {type(self).__name__} state_dict: missing {exc.args[0]!r} "
                "(saved by another optimizer, or truncated)"
            ) from None
