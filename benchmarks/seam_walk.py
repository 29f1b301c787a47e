"""Walk one optimizer step through the code: which functions and files it visits, and what the
optimizer floor reads across its seam.

Traced (``sys.setprofile``, one process, world size 1, which runs the same code as more ranks):
one compressed 1-bit Adam step (after the freeze, the one-shot exchange), one local step of
0/1 Adam and one DiLoCo synchronisation (its inner step, the 1-bit all-gather, the outer step).
For each: the distinct functions of ``onebit`` entered, the files they live in, the
file switches (consecutive function entries in different files) and how often each file is
re-entered -- inside ``onebit/optim`` and end to end -- and how often the walk alternates between
the optimizer's base and its exchange (``optim/_base.py`` and ``optim/_exchange.py``). Then the
calls back into the optimizer from the exchange (``optim/_exchange.py`` or ``comm``: a function
of an optimizer's file entered straight from one of theirs), and, read from the source, the
attributes the exchange reads off the optimizer.

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


# The exchange's file (``_driver.py`` before it became a service of the step: run this script on
# an older checkout to compare).
_EXCHANGE_FILE = "optim/_exchange.py" if os.path.exists(os.path.join(_ROOT, "optim", "_exchange.py")) \
    else "optim/_driver.py"
_EXCHANGE = (_EXCHANGE_FILE, "comm/")
_NOT_THE_OPTIMIZER = (_EXCHANGE_FILE, "optim/_buckets.py", "optim/_stages.py", "optim/_flat.py")
_BACK: list[str] = []  # calls from the exchange into an optimizer's file, as "caller -> callee"


def _walk(step: Callable[[], Any]) -> list[tuple[str, str]]:
    """``(file relative to onebit, function)`` of every onebit function (not comprehension) entered
    during ``step()``."""
    calls: list[tuple[str, str]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        name = frame.f_code.co_qualname
        if event == "call" and frame.f_code.co_filename.startswith(_ROOT) and not name.endswith(_COMPREHENSIONS):
            where = os.path.relpath(frame.f_code.co_filename, _ROOT)
            calls.append((where, name))
            caller = frame.f_back
            came = os.path.relpath(caller.f_code.co_filename, _ROOT) if caller is not None else ""
            if came.startswith(_EXCHANGE) and where.startswith("optim/") and where not in _NOT_THE_OPTIMIZER:
                _BACK.append(f"{came}:{caller.f_code.co_qualname} -> {where}:{name}")

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
    seam = [f for f in files if f in ("optim/_base.py", _EXCHANGE_FILE)]
    alternations = sum(a != b for a, b in zip(seam, seam[1:]))
    return (f"{len(set(calls))} functions in {len(set(files))} files, {len(calls)} calls, {switches} file switches, "
            f"{alternations} base<->exchange alternations{'; re-entered: ' + again if again else ''}")


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
    """The calls back into the optimizer from the exchange during the walks, and what the
    exchange's file reads off the optimizer."""
    tree = ast.parse(open(os.path.join(_ROOT, _EXCHANGE_FILE)).read())
    names = sorted({node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name) and node.value.id in ("opt", "optimizer")})
    back = collections.Counter(_BACK)
    return [f"calls from the exchange back into the optimizer: {sum(back.values())}"
            + "".join(f"\n  {n}x {call}" for call, n in back.items()),
            f"attributes the exchange reads off the optimizer: {len(names)} {names}"]


def main() -> None:
    """Print the walks and the seam (``--calls``: every call of the 1-bit Adam step, in order)."""
    adam = _traced(lambda p: onebit.OnebitAdam(p, lr=1e-3, freeze_step=2), 3, "compressed")
    local = _traced(lambda p: onebit.ZeroOneAdam(p, lr=1e-3, var_freeze_step=2, var_update_scaler=1,
                                                 local_step_scaler=1, local_step_clipper=4), 4, "local")
    diloco = _traced(lambda p: onebit.DiLoCo(p, lr=1e-3, sync_every=2), 1, "outer")
    for label, calls in (("compressed 1-bit Adam step", adam), ("0/1 Adam local step", local),
                         ("DiLoCo synchronisation", diloco)):
        print(f"{label}: optim/ {_summary(calls, 'optim')}")
        print(f"{' ' * len(label)}  end to end {_summary(calls, '')}")
    for line in _seam():
        print(line)
    if "--calls" in sys.argv:
        print("\n".join(f"{f}:{name}" for f, name in adam if f.startswith("optim")))


if __name__ == "__main__":
    main()
