"""The public API's docstrings: every Example runs as written (on one process, world size 1),
every optimizer of the registry has one, and none carries experiment results or points at a
file that is not in the repository."""

import doctest
import inspect
import re

import pytest
import torch

import onebit
import onebit.bench
from onebit.optim import REGISTRY

MODULES = [onebit, onebit.optim, onebit.comm, onebit.compress, onebit.hooks, onebit.ops]


def _public():
    seen = {}
    for module in MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            seen.setdefault(id(obj), (f"{module.__name__}.{name}", obj))
    return sorted(seen.values())


PUBLIC = _public()


@pytest.mark.parametrize("name,obj", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_examples_run(name, obj):
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    torch.manual_seed(0)
    for test in finder.find(obj, name, globs={"torch": torch, "onebit": onebit}):
        runner.run(test)
    assert runner.failures == 0, f"{name}: {runner.failures} example(s) failed (see the output above)"


OPTIMIZERS = sorted({s.cls for s in REGISTRY.values() if s.cls.__module__.startswith("onebit")},
                    key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_every_optimizer_has_an_example_and_its_arguments(cls):
    doc = inspect.getdoc(cls)
    assert "Examples:" in doc and ">>> opt = onebit." in doc, cls.__name__
    documented = set(re.findall(r"^    (\*{0,2}\w+):", doc.split("Args:")[1], re.M)) if "Args:" in doc else set()
    arguments = {("**" if p.kind is p.VAR_KEYWORD else "") + n for n, p in inspect.signature(cls).parameters.items()}
    assert arguments <= documented, f"{cls.__name__}: undocumented {sorted(arguments - documented)}"


@pytest.mark.parametrize("name,obj", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_no_results_or_stale_pointers(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert not re.search(r"README|DESIGN|WITHOUT DDP", doc), name
    assert not re.search(r"[+-]\d+(\.\d+)?% (above|below|worse|better)|\bended [+-]?\d", doc), name


def test_the_library_exposes_no_part_of_the_lab():
    """``import onebit`` and ``onebit.optim`` expose the optimizers and their math; how the
    benchmarks compare and price each optimizer is ``onebit.bench``'s, one row per registry entry."""
    lab = set(onebit.bench.__all__) | {"COUNTERPARTS", "NEVER"}
    for module in (onebit, onebit.optim):
        assert not lab & set(module.__all__), module.__name__
    assert set(onebit.bench.BENCHMARKED) == set(REGISTRY)
