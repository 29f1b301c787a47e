"""DDP communication hooks built on onebit's compressors and compressed all-reduce."""

# No ``from __future__ import annotations``: DDP compares the hooks' annotations with the
# real ``dist.GradBucket`` and ``Future[Tensor]`` objects, not strings.
import logging
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import comm
from ..comm import _dist
from ..compress import Compressor, StochasticSignCompressor, get
from ..optim._base import check_positive
from ..optim._birder import check_beta, check_seed, soft_sign_direction

__all__ = ["BirderState", "ErrorFeedbackState", "birder_hook", "error_feedback_hook"]

_log = logging.getLogger(__name__)


class _HookState:
    """Shared bookkeeping: iteration count, per-bucket collectives keyed by bucket index, pickling.

    Per-bucket state is keyed by ``bucket.index()``. DDP builds its buckets in reverse
    parameter order, then rebuilds them once from the order gradients became ready in the
    first iteration, so an index names the same parameters only from iteration 1 on;
    compression therefore starts at ``start_iter >= 2`` (as PowerSGD requires with error
    feedback), and iterations before it use an exact fp32 all-reduce.
    """

    __slots__ = ("process_group", "start_iter", "iter", "hierarchical", "ranks_per_node", "timeout", "_buckets",
                 "_saved", "_restore_iters")
    _unpickled: tuple[str, ...] = ("process_group",)  # objects of the live job, None after unpickling

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        start_iter: int,
        hierarchical: bool | str,
        ranks_per_node: int | None,
        timeout: float | timedelta | None,
    ) -> None:
        if isinstance(start_iter, bool) or not isinstance(start_iter, int):
            raise TypeError(f"start_iter must be an int, got {start_iter!r}")
        if start_iter < 2:
            raise ValueError(
                f"start_iter must be >= 2, got {start_iter}: DDP rebuilds its buckets after the first "
                "iteration, and state kept per bucket index must not start before that"
            )
        if hierarchical not in (True, False, "auto"):
            raise ValueError(f"hierarchical must be True, False or 'auto', got {hierarchical!r}")
        if _dist.backend_of(process_group) != "torch":
            # DDP itself (bucketing, the backward-pass futures) runs on torch.distributed.
            raise ValueError(f"process_group must be a torch.distributed process group, got {process_group!r}")
        self.process_group = process_group
        self.start_iter = start_iter
        self.iter = 0
        self.hierarchical = hierarchical
        self.ranks_per_node = ranks_per_node
        self.timeout = _dist.to_timedelta(timeout)
        self._buckets: dict[int, dict[str, Any]] = {}
        self._saved: dict[int, dict[str, Any]] = {}
        self._restore_iters = 0

    # ------------------------------------------------------------------ per bucket
    def _compressor(self, index: int) -> str | Compressor:
        raise NotImplementedError

    def _bucket(self, index: int, grad: Tensor) -> dict[str, Any] | None:
        """The bucket's collective and buffers, created on first use or restored from a checkpoint.

        ``None`` means "exchange this bucket exactly": a restored state is waiting for the new
        DDP instance to rebuild its buckets (its first iteration uses DDP's initial layout,
        which generally differs from the rebuilt one the state was saved with).
        """
        entry = self._buckets.get(index)
        if entry is not None:
            return entry
        saved = self._saved.get(index)
        if self._saved and (saved is None or saved["numel"] != grad.numel()):
            if self._restore_iters >= 1:
                have = "no saved state" if saved is None else f"{saved['numel']} values when saved"
                raise ValueError(
                    f"bucket {index} has {grad.numel()} values but {have}: the DDP bucket layout "
                    "differs from the checkpoint's (bucket_cap_mb or the model changed)"
                )
            return None
        allreduce = comm.compressed_allreduce(
            self._compressor(index),
            self.process_group,
            hierarchical=self.hierarchical,
            ranks_per_node=self.ranks_per_node,
            timeout=self.timeout,
        )
        entry = self._buckets[index] = {"allreduce": allreduce, **self._new_buffers(grad)}
        if saved is not None:
            del self._saved[index]
            allreduce.load_state_dict(saved["allreduce"])
            for name, value in saved["buffers"].items():
                entry[name].copy_(value)
        return entry

    def _new_buffers(self, grad: Tensor) -> dict[str, Tensor]:
        return {}

    def _advance(self, bucket: dist.GradBucket) -> None:
        # Bucket 0 is the last one DDP reduces in an iteration.
        if bucket.is_last():
            self.iter += 1
            if self._saved:
                self._restore_iters += 1

    def _compressing(self, grad: Tensor) -> bool:
        """Compress this bucket: past ``start_iter`` and finite on every rank.

        A non-finite bucket anywhere (an fp16 overflow, say) is all-reduced exactly instead:
        the NaN/Inf reaches every rank, so every rank's GradScaler skips the step, and no
        rank's error feedback (or Birder's moments) takes in the non-finite values.
        """
        if self.iter < self.start_iter:
            return False
        flag = (~torch.isfinite(grad)).any().float().reshape(1)
        comm.all_reduce_max(flag, self.process_group, self.timeout)
        return not flag.item()

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Iteration count and every bucket's errors, random state and buffers (plain tensors and dicts)."""
        buckets = dict(self._saved)
        for index, entry in self._buckets.items():
            collective = entry["allreduce"].state_dict()
            buffers = {k: v.clone() for k, v in entry.items() if k != "allreduce"}
            buckets[index] = {"index": index, "numel": collective["numel"], "allreduce": collective, "buffers": buffers}
        return {"iter": self.iter, "buckets": buckets}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (into a state registered on a new DDP instance).

        Buckets are restored when the hook first meets them with their saved size; the new
        DDP instance's first iteration, before it rebuilds its buckets, is exchanged exactly
        (fp32 all-reduce; Birder: the soft sign of the average), and the saved errors and
        moments take over from the next iteration. A layout that still differs then raises.
        """
        self.iter = int(state["iter"])
        self._buckets = {}
        self._saved = dict(state["buckets"])
        self._restore_iters = 0

    def __getstate__(self) -> dict[str, Any]:
        """Everything but the process group, which cannot be pickled (as ``PowerSGDState``), and the
        other live objects in ``_unpickled``."""
        _log.warning("the process group is not pickled; the unpickled state uses the default group")
        slots = [s for cls in type(self).__mro__ for s in getattr(cls, "__slots__", ())]
        skip = self._unpickled + ("_buckets", "_saved", "_restore_iters")
        options = {s: getattr(self, s) for s in slots if s not in skip}
        return {**options, "state": self.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for slot in self._unpickled:
            setattr(self, slot, None)
        for slot, value in state.items():
            if slot != "state":
                setattr(self, slot, value)
        self.load_state_dict(state["state"])


def _finished(tensor: Tensor) -> torch.futures.Future[Tensor]:
    fut: torch.futures.Future[Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


class ErrorFeedbackState(_HookState):
    """State of :func:`error_feedback_hook`.

    Args:
        process_group: the DDP model's group (``None``: default).
        compressor: name or instance of the compressor (``"sign"``: 1 bit per value with
            one ``||x||_2 / sqrt(n)`` scale per chunk of each bucket; ``"identity"`` sends
            fp32 and equals plain DDP).
        start_iter: first compressed iteration (>= 2, see the class notes).
        hierarchical, ranks_per_node: Birder's Hierarchical-1-bit-All-Reduce, as
            :func:`onebit.comm.compressed_allreduce`.
        timeout: per-collective timeout.
    """

    __slots__ = ("compressor", "compressor_kwargs")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        compressor: str = "sign",
        start_iter: int = 2,
        *,
        hierarchical: bool | str = False,
        ranks_per_node: int | None = None,
        timeout: float | timedelta | None = None,
        **compressor_kwargs: Any,
    ) -> None:
        super().__init__(process_group, start_iter, hierarchical, ranks_per_node, timeout)
        get(compressor, **compressor_kwargs)  # validate now, not in the middle of a backward pass
        self.compressor = compressor
        self.compressor_kwargs = compressor_kwargs

    def _compressor(self, index: int) -> str | Compressor:
        return get(self.compressor, **self.compressor_kwargs)


def error_feedback_hook(state: ErrorFeedbackState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """signSGD with two-sided error feedback (DoubleSqueeze-style) on each DDP bucket.

    Every worker sends ``C(g + e)`` and keeps ``e <- g + e - C(g + e)``; the owner of each
    chunk averages, adds its server error, re-compresses; everyone decodes the same
    all-gathered bytes (:class:`onebit.comm.CompressedAllReduce`), so replicas stay
    identical. The result replaces the bucket's gradients: use any optimizer on top. The
    hook blocks while it exchanges (no overlap with the rest of the backward pass).
    """
    grad = bucket.buffer()
    entry = state._bucket(bucket.index(), grad) if state._compressing(grad) else None
    if entry is not None:
        entry["allreduce"](grad, out=grad)
    else:
        comm.all_reduce_mean(grad, state.process_group, state.timeout)
    state._advance(bucket)
    return _finished(grad)


class BirderState(_HookState):
    """State of :func:`birder_hook`: per-bucket ``m``, ``b``, errors and random generators.

    Rank ``r``'s quantiser for bucket ``i`` draws from a generator seeded
    ``seed + r * 2**32 + i * 2**48``; ``beta``/``eps`` as :class:`onebit.Birder`.

    ``grad_scaler``: the ``torch.amp.GradScaler`` of a mixed-precision loop. The hook then
    unscales the bucket before it enters ``m`` and ``b`` and multiplies its ``+-1`` output
    by the scale, so that ``scaler.unscale_`` / ``scaler.step`` hand the optimizer exactly
    ``u_bar``: without it the step would shrink by the loss scale (65536x by default). It is
    not pickled with the state (pass it again after loading).
    """

    __slots__ = ("beta", "eps", "seed", "rank", "grad_scaler")
    _unpickled = ("process_group", "grad_scaler")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        beta: float = 0.95,
        eps: float = 1e-8,
        seed: int = 0,
        start_iter: int = 2,
        *,
        hierarchical: bool | str = False,
        ranks_per_node: int | None = None,
        timeout: float | timedelta | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        super().__init__(process_group, start_iter, hierarchical, ranks_per_node, timeout)
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}")
        self.grad_scaler = grad_scaler
        self.beta = check_beta(beta)
        self.eps = check_positive("epsilon", eps)
        self.seed = check_seed(seed)
        self.rank = comm.get_rank(process_group)

    def _compressor(self, index: int) -> Compressor:
        return StochasticSignCompressor(self.seed + self.rank * 2**32 + index * 2**48)

    def _new_buffers(self, grad: Tensor) -> dict[str, Tensor]:
        zeros = torch.zeros(grad.numel(), dtype=torch.float32, device=grad.device)
        return {"exp_avg": zeros, "exp_avg_abs": zeros.clone()}


def birder_hook(state: BirderState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Birder (Algorithm 1) in DDP: the bucket's gradients are replaced by the 1-bit update ``u_bar``.

    Per bucket, every rank updates ``m`` and ``b`` from its local gradient, the update
    ``m / (b + eps)`` goes through the error-compensated stochastic 1-bit all-reduce, and
    ``u_bar`` (``+-1`` per value) is returned in place of the gradient. Pair it with
    ``torch.optim.SGD(params, lr, weight_decay=wd)`` (no momentum): ``x <- x (1 - lr wd) -
    lr u_bar`` is Birder's step with decoupled weight decay. Before ``start_iter`` the
    gradient is averaged exactly and ``g / (|g| + eps)`` (Birder's update from zero
    moments, a soft sign) is returned. The hook blocks while it exchanges.
    """
    grad = bucket.buffer()
    entry = state._bucket(bucket.index(), grad) if state._compressing(grad) else None
    # The loss scale of a GradScaler loop: out of the moments, back onto the +-1 output.
    scale = 1.0 if state.grad_scaler is None or not state.grad_scaler.is_enabled() else state.grad_scaler.get_scale()
    if entry is not None:
        update = soft_sign_direction(
            [(0, grad.numel())],
            grads=[grad.float().div_(scale)],
            active=[True],
            exp_avg=entry["exp_avg"],
            exp_avg_abs=entry["exp_avg_abs"],
            max_exp_avg_abs=None,
            use_max=False,
            betas=[state.beta],
            eps=state.eps,
            out=torch.empty(grad.numel(), dtype=torch.float32, device=grad.device),
        )
        grad.copy_(entry["allreduce"](update, out=update).mul_(scale))
    else:
        comm.all_reduce_mean(grad, state.process_group, state.timeout)
        grad.div_(grad.abs().add_(state.eps * scale)).mul_(scale)
    state._advance(bucket)
    return _finished(grad)
