"""Imported by :func:`onebit.launch.spawn`'s fork server before it forks any rank.

A forked rank starts with what the server has loaded. ``import torch`` does not load what a
rank's first optimizer needs: ``torch.optim.Optimizer`` imports ``torch._dynamo`` at
construction (~3 s), and onebit's compressors load their numba kernels (numba's compiler
context ~1.5 s, then each kernel from its on-disk cache). Done once here, a rank that builds
an optimizer starts in well under a second instead of ~5 s, the most of a multi-rank test.
The server stays free of threads that a fork would break: only numpy's and scipy's idle
OpenBLAS servers run, which OpenBLAS resets in the child.
"""

try:
    import torch._dynamo  # noqa: F401 -- loaded, not used here

    from onebit import ops

    ops.warm_up("cpu")
except Exception:  # noqa: BLE001 -- only time is saved here: a rank that meets the error meets it itself
    pass  # (the fork server survives an ImportError in its preload, but no other exception)
