"""DDP communication hooks: ``model.register_comm_hook(state, hook)`` for users who keep DDP.

* :func:`error_feedback_hook` with :class:`ErrorFeedbackState` -- 1-bit signs with worker
  and server error feedback on the gradients (signSGD with EF, two-sided as DoubleSqueeze).
* :func:`birder_hook` with :class:`BirderState` -- Birder's stochastic 1-bit update.

Both states pickle without their process group (like PyTorch's ``PowerSGDState``) and
also offer ``state_dict()``/``load_state_dict()`` for ``torch.load(weights_only=True)``.
"""

from ._hooks import BirderState, ErrorFeedbackState, birder_hook, error_feedback_hook

__all__ = ["BirderState", "ErrorFeedbackState", "birder_hook", "error_feedback_hook"]
