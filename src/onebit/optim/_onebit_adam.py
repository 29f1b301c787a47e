"""1-bit Adam (Tang et al., 2021): Adam warm-up, then frozen variance and 1-bit momentum."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any

from torch import Tensor

from .. import comm
from ._base import OnebitOptimizer, check_adam_args, check_betas, check_bool, check_optional_positive
from ._freeze import TwoStage
from ._functional import _ema_, adam_denominator, onebit_adam
from ._overlap import OverlappedExchange

__all__ = ["OnebitAdam", "OnebitAdamNaive"]


class _AdamFamily(OnebitOptimizer):
    """Argument checks and the flat gradient buffer shared by the Adam variants."""

    _flat_names = ("exp_avg", "exp_avg_sq")
    clip_update: float | None = None  # only OnebitAdam's compression stage clips
    _frozen_at: int | None = None  # OnebitAdamNaive never freezes

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        bias_correction: bool,
        group: comm.Group,
        timeout: float | timedelta | None,
        broadcast_parameters: bool,
        on_nonfinite: str,
        check_replicas_every: int,
        max_grad_norm: float | None,
    ) -> None:
        check_adam_args(lr, betas, eps, weight_decay)
        self.bias_correction = check_bool("bias_correction", bias_correction)
        self.eps = float(eps)
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
        super().__init__(
            params, defaults, group=group, timeout=timeout, broadcast_parameters=broadcast_parameters,
            on_nonfinite=on_nonfinite,
            check_replicas_every=check_replicas_every,
            max_grad_norm=max_grad_norm,
        )
        # The averaged gradient (the fp32 all-reduce needs one flat buffer); OnebitAdam drops it
        # at the freeze, when each rank's momentum takes its own gradient where it lies.
        self._grad: Tensor | None = self._new_grad_buffer()

    def _run(self, grads: list[Tensor | None] | None, *, exchange: Callable[[Tensor], object] | None = None,
             frozen_denom: Tensor | None = None) -> None:
        onebit_adam(
            self.flat.params,
            self.flat.offsets,
            grads=grads,
            active=self._active,
            exp_avg=self.flat.buffers["exp_avg"],
            exp_avg_sq=self.flat.buffers.get("exp_avg_sq"),
            frozen_denom=frozen_denom,
            exchange=exchange,
            step=self._step_count,
            lrs=self._hyper("lr"),
            betas=self._hyper("betas"),
            weight_decays=self._hyper("weight_decay"),
            eps=self.eps,
            bias_correction=self.bias_correction,
            clip_update=self.clip_update,
            frozen_at=self._frozen_at or 0,
        )


class OnebitAdam(TwoStage, OverlappedExchange, _AdamFamily):
    """1-bit Adam (Algorithm 1 of Tang et al., 2021). Use it WITHOUT DDP.

    * Warm-up (steps ``1 .. freeze_step``): gradients are averaged with a full-precision
      all-reduce and exact Adam, eq. (1), runs. With ``bias_correction=True`` (the default)
      this is ``torch.optim.AdamW`` (decoupled weight decay: ``x <- x - lr * wd * x``) and the
      variance is frozen bias-corrected. ``False`` is the paper's BERT setting (and
      DeepSpeed's): safe only when the freeze comes after ``1 - beta2^T`` is near 1 (thousands
      of steps); frozen earlier, the raw variance is too small and every compressed step too
      large (a short run diverged to NaN on the byte-LM task of ``onebit bench convergence``),
      so freezing with ``1 - beta2^T < 0.5`` warns.
    * Compression (after the freeze): the variance is frozen as a preconditioner; each
      rank updates its momentum with its local gradient; the momentum of all parameters,
      one fused flat buffer, is exchanged by :class:`onebit.comm.CompressedAllReduce` with
      worker and server error feedback (1-bit signs + one scale per chunk), replacing the
      momentum on every rank; then ``x <- x - lr * m / (sqrt(v_frozen) + eps)``. Values
      whose variance is exactly zero at the freeze (no gradient during the whole warm-up,
      e.g. unused embedding rows) keep a zero momentum -- DeepSpeed's ``exp_avg_mask``,
      derived instead of asked for. At the freeze the variance buffer becomes the
      preconditioner ``sqrt(v_T / (1 - beta2^T)) + eps`` itself (``state[p]["frozen_denom"]``
      from then on): the compression stage holds ``m``, that, and the collective's worker
      and server errors -- 3 + 1/w model sizes (README, "Memory").

    Args:
        params: parameters or param groups (options ``lr``, ``betas``, ``weight_decay``).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (``lr`` is read every step,
            so LR schedulers work).
        freeze_step: last warm-up step (an int), or ``"auto"`` for the paper's variance
            stability criterion (see :class:`onebit.optim.FreezeSchedule`).
        bias_correction: Adam's bias correction (see above).
        group: process group (``None``: default; no process group: world size 1), an
            :class:`onebit.comm.MPIGroup`, or a backend name (``"mpi"``: mpi4py's ``COMM_WORLD``).
        freeze_threshold, freeze_window: the auto criterion's threshold (0.96) and window
            ``D`` (``None``: ``round(1 / (1 - beta2))``).
        min_freeze_step: "auto" never freezes before this step (set it to the LR warm-up).
        max_freeze_step: "auto" freezes at this step at the latest (``None``: no limit).
        compressor: compressor of the momentum exchange (``"sign"``; ``"identity"`` gives the
            paper's "1-bit Adam (32-bits)" ablation).
        clip_update: clip each value's compressed step to this many times Adam's own largest
            step, ``lr (1 - beta1) / sqrt(1 - beta2)`` (:func:`onebit.optim.clip_to_adam_step_`;
            not in the paper; ``None``: no clip). Without it, values whose frozen variance is
            tiny take steps of ``lr * scale / sqrt(v)`` from the 1-bit exchange.
        hierarchical, ranks_per_node: exchange with Birder's Hierarchical-1-bit-All-Reduce
            (:func:`onebit.comm.compressed_allreduce`: ``True``, ``False`` or ``"auto"``).
        overlap: start each bucket's exchange during backward, as soon as its gradients are
            accumulated (see below); ``False``: one exchange of the whole model in ``step()``.
        bucket_cap_mb: bucket size of the overlapped exchange, in MB of fp32 state (as DDP's).
        timeout: per-collective timeout in seconds (default 300).
        broadcast_parameters: copy rank 0's parameters to all ranks at construction, so
            replicas start equal.

    ``stats`` reports the stage, the bytes this rank sent in the last step and the step
    the warm-up ended (also logged at INFO on ``onebit.optim``).

    **Overlapped exchange** (``overlap=True``, DDP's scheme): the parameters are grouped into
    buckets in reverse order; a post-accumulate-grad hook starts a bucket's exchange once
    all its gradients are in -- the exact fp32 all-reduce in the warm-up, ``c = e + beta1 m
    + (1 - beta1) g`` and its compressed all-to-all in the compression stage -- while
    backward computes earlier layers; ``step()`` finishes what is in flight (each bucket is
    chunked and compressed on its own, so the bits differ from ``overlap=False``; every rank
    still gets the same ones). Requirements, each checked: a flat exchange, no
    ``max_grad_norm`` (the local clip needs every gradient before the first bucket leaves),
    no GradScaler, and gradient accumulation inside :meth:`no_sync` for all micro-batches but
    the last. Two behaviours differ from ``overlap=False``: a skipped step (non-finite
    gradient) of the compression stage restarts the error-feedback buffers at zero (they were
    updated before the ranks could agree), and a trainable parameter with no gradient on
    *any* rank still has its momentum decayed by ``beta1`` in the exchange.
    """

    _flat_names = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int | str = "auto",
        bias_correction: bool = True,
        group: comm.Group = None,
        *,
        freeze_threshold: float = 0.96,
        freeze_window: int | None = None,
        min_freeze_step: int = 0,
        max_freeze_step: int | None = None,
        compressor: str = "sign",
        clip_update: float | None = 10.0,
        hierarchical: bool | str = False,
        ranks_per_node: int | None = None,
        overlap: bool = False,
        bucket_cap_mb: float = 25.0,
        timeout: float | timedelta | None = None,
        broadcast_parameters: bool = True,
        on_nonfinite: str = "skip",
        check_replicas_every: int = 0,
        max_grad_norm: float | None = None,
    ) -> None:
        self.clip_update = check_optional_positive("clip_update", clip_update)
        check_bool("overlap", overlap)
        self._init_two_stage(
            freeze_step,
            check_betas(betas)[1],
            threshold=freeze_threshold,
            window=freeze_window,
            min_step=min_freeze_step,
            max_step=max_freeze_step,
        )
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            group=group,
            timeout=timeout,
            broadcast_parameters=broadcast_parameters,
            on_nonfinite=on_nonfinite,
            check_replicas_every=check_replicas_every,
            max_grad_norm=max_grad_norm,
        )
        def collective() -> Any:
            return comm.compressed_allreduce(compressor, self.process_group, hierarchical=hierarchical,
                                             ranks_per_node=ranks_per_node, timeout=self.timeout)

        self.allreduce = collective()
        self.allreduce.warm_up(self.flat.device)  # kernels loaded now, not at the first compressed step
        if overlap:
            self._use_buckets(bucket_cap_mb, collective, hierarchical=hierarchical)

    def _bucket_input(self, i: int, lo: int, hi: int, grad: Tensor | None, live: bool, options: dict[str, Any],
                      scratch: Tensor) -> Tensor:
        """``m' = beta1 m + (1 - beta1) g`` in scratch, ``m`` untouched (a frozen parameter's ``m``
        as it is): with one bucket, the one-shot exchange's bits."""
        m = self.flat.buffers["exp_avg"][lo:hi]
        return _ema_(m, grad, options["betas"][0], out=scratch[0]) if live else m

    def _on_freeze(self) -> None:
        """Freeze the variance (Algorithm 1 line 2)."""
        self._freeze_denominator()
        if not self.bias_correction:
            self._warn_early_freeze()

    def _freeze_denominator(self) -> None:
        """Turn the variance, in place, into the frozen preconditioner ``sqrt(v_T / (1 - beta2^T)) + eps``
        (``1`` for ``1 - beta2^T`` without bias correction), registered as ``"frozen_denom"``.

        The compression stage only ever divides by it, so it takes ``v``'s buffer rather than a
        second model-sized one, and costs nothing per step."""
        v = self.flat.buffers["exp_avg_sq"]
        for (lo, hi), (_, beta2) in zip(self.flat.offsets, self._hyper("betas")):
            bc2 = 1.0 - beta2**self._frozen_at if self.bias_correction else 1.0
            adam_denominator(v[lo:hi], eps=self.eps, bias_correction2=bc2, out=v[lo:hi])
        self._use_frozen_layout(True)
        self._note_unused()

    def _use_frozen_layout(self, frozen: bool) -> None:
        names = ("exp_avg_sq", "frozen_denom") if frozen else ("frozen_denom", "exp_avg_sq")
        if names[0] in self.flat.buffers:
            self.flat.rename(*names)
            self._link_state()

    def _unused_marker(self) -> tuple[Tensor, float]:
        # sqrt(v_hat) + eps == eps: no gradient through the warm-up (or one below eps's rounding)
        return self.flat.buffers["frozen_denom"], self.eps

    def _step(self) -> None:
        if self._buckets is not None:  # the exchanges started during backward
            self._finish_buckets(out=self.flat.buffers["exp_avg"])
        if self._frozen_at is None:
            if self._buckets is None:
                grads = self._averaged_grads(self._clipped(self._allreduce))
            else:  # averaged by the buckets' all-reduces (overlap refuses max_grad_norm)
                grads = self.flat.split(self._grad)
            self._run(grads)
            self._after_warmup_step(self.flat.buffers["exp_avg_sq"])
        elif self._buckets is None:  # no averaged gradient in this stage: the local one, clipped locally
            self._run(self._local_grads(), exchange=self._exchange_momentum,
                      frozen_denom=self.flat.buffers["frozen_denom"])
        else:
            self._mask_unused(self.flat.buffers["exp_avg"])
            self._run(None, frozen_denom=self.flat.buffers["frozen_denom"])

    def _extra_state(self) -> dict[str, Any]:
        return {**self._two_stage_state(), **self._collectives_state()}

    def _layout_for(self, state: Mapping[str, Any]) -> None:
        self._use_frozen_layout(state.get("frozen_at") is not None)

    def _load_extra_state(self, state: Mapping[str, Any], own_state: bool) -> None:
        self._load_two_stage_state(state)
        self._load_collectives_state(state, own_state)


class OnebitAdamNaive(OverlappedExchange, _AdamFamily):
    """The paper's control "Adam (1-bit naive)" (sections 3.2 and 7.2): error-compensated
    1-bit compression of the *gradient*, with both Adam moments updated from the
    compressed average. It shows why 1-bit Adam freezes the variance: the squared
    compression error enters ``v`` and does not cancel (section 4.2).

    Every step exchanges the gradient with :class:`onebit.comm.CompressedAllReduce` (worker
    and server error feedback) and runs Adam, eq. (1), on the result. Arguments as
    :class:`OnebitAdam`, without the freeze options; with ``overlap=True`` each bucket's
    gradients leave during backward, and ``max_grad_norm`` (which clips the average) is
    allowed.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        group: comm.Group = None,
        *,
        compressor: str = "sign",
        hierarchical: bool | str = False,
        ranks_per_node: int | None = None,
        overlap: bool = False,
        bucket_cap_mb: float = 25.0,
        timeout: float | timedelta | None = None,
        broadcast_parameters: bool = True,
        on_nonfinite: str = "skip",
        check_replicas_every: int = 0,
        max_grad_norm: float | None = None,
    ) -> None:
        check_bool("overlap", overlap)
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            group=group,
            timeout=timeout,
            broadcast_parameters=broadcast_parameters,
            on_nonfinite=on_nonfinite,
            check_replicas_every=check_replicas_every,
            max_grad_norm=max_grad_norm,
        )
        def collective() -> Any:
            return comm.compressed_allreduce(compressor, self.process_group, hierarchical=hierarchical,
                                             ranks_per_node=ranks_per_node, timeout=self.timeout)

        self.allreduce = collective()
        self.allreduce.warm_up(self.flat.device)  # kernels loaded now, not at the first compressed step
        if overlap:  # the clip is on the average, which step() has in full
            self._use_buckets(bucket_cap_mb, collective, hierarchical=hierarchical, clips_locally=False)

    def _bucket_input(self, i: int, lo: int, hi: int, grad: Tensor | None, live: bool, options: dict[str, Any],
                      scratch: Tensor) -> Tensor | None:
        """The gradient itself: what the naive variant compresses."""
        return grad

    def _exchange_gradient(self, buffer: Tensor) -> Tensor:
        return self.allreduce(buffer, out=buffer)

    def _step(self) -> None:
        if self._buckets is None:
            self._run(self._averaged_grads(self._clipped(self._exchange_gradient)))
            return
        self._finish_buckets(out=self._grad)  # the exchanges started during backward
        self._run(self.flat.split(self._clip_grad_(self._grad)))

    def _extra_state(self) -> dict[str, Any]:
        return self._collectives_state()

    def _load_extra_state(self, state: Mapping[str, Any], own_state: bool) -> None:
        self._load_collectives_state(state, own_state)
