"""Walk one optimizer step through the code: which functions and files it visits, and what the
optimizer floor reads across its seam.

Traced (``sys.setprofile``, one process, world size 1, which runs the same code as more ranks):
one compressed 1-bit Adam step (after the freeze, the one-shot exchange) and one local step of
0/1 Adam. For each: the distinct functions of ``onebit`` entered, the files they live in, the
file switches (consecutive function entries in different files) and how often each file is
re-entered -- inside ``onebit/optim`` and end to end. Then, read from the source: the
attributes the exchange driver reads off the optimizer (private ones named) and the optimizer
files that read the driver's.

Usage, from a checkout: ``python benchmarks/seam_walk.py``
"""

from __future__ import annotations

import ast
import collections
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

import onebit

_ROOT = os.path.dirname(onebit.__file__)
_COMPREHENSIONS = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>")  # not steps of the walk


def _walk(step: Callable[[], Any]) -> list[tuple[str, str]]:
    """``(file relative to onebit, function)`` of every onebit function (not comprehension) entered
    during ``step()``."""
    calls: list[tuple[str, str]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        name = frame.f_code.co_qualname
        if event == "call" and frame.f_code.co_filename.startswith(_ROOT) and not name.endswith(_COMPREHENSIONS):
            calls.append((os.path.relpath(frame.f_code.co_filename, _ROOT), name))

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def _summary(calls: list[tuple[str, str]], where: str) -> str:
    calls = [c for c in calls if c[0].startswith(where)]
    files = [f for f, _ in calls]
    switches = sum(a != b for a, b in zip(files, files[1:]))
    entries = collections.Counter(f for i, f in enumerate(files) if i == 0 or files[i - 1] != f)
    again = ", ".join(f"{f} {n}x" for f, n in entries.most_common() if n > 1)
    return (f"{len(set(calls))} functions in {len(set(files))} files, {len(calls)} calls, {switches} file switches"
            f"{'; re-entered: ' + again if again else ''}")


def _model() -> tuple[torch.nn.Module, Callable[[], None]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def backward() -> None:
        model.zero_grad(set_to_none=True)
        model(torch.randn(8, 16)).square().mean().backward()
    return model, backward


def _traced(make: Callable[[Any], Any], warm: int, stage: str) -> list[tuple[str, str]]:
    model, backward = _model()
    opt = make(model.parameters())
    for _ in range(warm):
        backward()
        opt.step()
    backward()
    calls = _walk(opt.step)
    assert opt.stats["stage"] == stage, opt.stats["stage"]
    return calls


def _seam() -> list[str]:
    """What ``optim/_driver.py`` reads off the optimizer, and who reads ``_driver`` back."""
    optim = os.path.join(_ROOT, "optim")
    tree = ast.parse(open(os.path.join(optim, "_driver.py")).read())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (
                (isinstance(node.value, ast.Name) and node.value.id == "opt")
                or (isinstance(node.value, ast.Attribute) and node.value.attr == "opt")):
            names.add(node.attr)
    private = sorted(n for n in names if n.startswith("_"))
    readers = []
    for f in sorted(os.listdir(optim)):
        if f.endswith(".py") and f not in ("_driver.py", "_base.py") and any(
                isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "_driver" for node in ast.walk(ast.parse(open(os.path.join(optim, f)).read()))):
            readers.append(f)
    return [f"the driver reads {len(names)} attributes of the optimizer, {len(private)} private: {private}",
            f"optimizer files other than the base reading self._driver's attributes: {len(readers)} {readers}"]


def main() -> None:
    """Print the walks and the seam (``--calls``: every call of the 1-bit Adam step, in order)."""
    adam = _traced(lambda p: onebit.OnebitAdam(p, lr=1e-3, freeze_step=2), 3, "compressed")
    local = _traced(lambda p: onebit.ZeroOneAdam(p, lr=1e-3, var_freeze_step=2, var_update_scaler=1,
                                                 local_step_scaler=1, local_step_clipper=4), 4, "local")
    for label, calls in (("compressed 1-bit Adam step", adam), ("0/1 Adam local step", local)):
        print(f"{label}: optim/ {_summary(calls, 'optim')}")
        print(f"{' ' * len(label)}  end to end {_summary(calls, '')}")
    for line in _seam():
        print(line)
    if "--calls" in sys.argv:
        print("\n".join(f"{f}:{name}" for f, name in adam if f.startswith("optim")))


if __name__ == "__main__":
    main()
