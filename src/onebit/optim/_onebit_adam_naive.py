"""The control "Adam (1-bit naive)" of the 1-bit Adam paper (Tang et al., 2021, sections 3.2 and 7.2)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from .. import comm
from .._checks import check_adam_args, check_bool
from ._onebit_adam import _ADAM, _AdamFamily
from ._stages import COMPRESSED_GRADIENT, OneStage, Stage, Wire

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .._checks import CommonOptions

__all__ = ["OnebitAdamNaive"]


class OnebitAdamNaive(_AdamFamily):
    """The paper's control "Adam (1-bit naive)" (sections 3.2 and 7.2): error-compensated
    1-bit compression of the *gradient*, with both Adam moments updated from the
    compressed average. It shows why 1-bit Adam freezes the variance: the squared
    compression error enters ``v`` and does not cancel (section 4.2).

    Every step exchanges the gradient with :class:`onebit.comm.CompressedAllReduce` (worker
    and server error feedback) and runs Adam, eq. (1), on the result. With ``overlap=True``
    each bucket's gradients leave during backward, and ``max_grad_norm`` (which clips the
    average) is allowed.

    Args:
        params: parameters or param groups (options ``lr``, ``betas``, ``weight_decay``).
        lr: learning rate (read every step).
        betas: Adam's ``(beta1, beta2)``.
        eps: added to ``sqrt(v)`` in the denominator.
        weight_decay: decoupled weight decay.
        bias_correction: Adam's bias correction.
        group: process group (``None``: default), an :class:`onebit.comm.MPIGroup`, or a
            backend name (``"mpi"``).
        compressor: compressor of the gradient exchange (``"sign"``).
        scales: ``"tensor"``: a compressor with scales (``"sign"``) gives each parameter's
            piece of a rank's chunk its own, as DeepSpeed's per-tensor exchange (4 bytes more per
            piece); ``"chunk"``: one per rank's chunk of the fused buffer, which gives a layer of
            small values the magnitude of its larger neighbours.
        hierarchical: Birder's Hierarchical-1-bit-All-Reduce (``True``, ``False`` or ``"auto"``).
        ranks_per_node: ranks on each node, for the hierarchical exchange (``None``: detected).
        overlap: start each bucket's exchange during backward.
        bucket_cap_mb: bucket size of the overlapped exchange, in MB of fp32 state (as DDP's).
        **options: :class:`onebit.optim.CommonOptions`.

    Examples:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = onebit.OnebitAdamNaive(model.parameters(), lr=1e-3)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
        >>> opt.stats["stage"]
        'compressed'
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
        scales: str = "tensor",
        hierarchical: bool | str = False,
        ranks_per_node: int | None = None,
        overlap: bool = False,
        bucket_cap_mb: float = 25.0,
        **options: Unpack[CommonOptions],
    ) -> None:
        check_bool("overlap", overlap)
        check_adam_args(lr, betas, eps, weight_decay)
        self._stages = OneStage(Stage(COMPRESSED_GRADIENT, _ADAM, averages=True))
        self._init_adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, group=group, options=options)
        self._drive(self._allreduce(compressor, hierarchical=hierarchical, ranks_per_node=ranks_per_node,
                                    overlap=overlap, scales=scales), overlap=overlap, bucket_cap_mb=bucket_cap_mb)

    def _landing(self, wire: Wire) -> Tensor:
        return self._grad

    def _apply(self, wire: Wire, average: Tensor | None, members: Sequence[int] | None = None) -> None:
        self._adam(average)
