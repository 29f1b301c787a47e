"""A griffe extension for the API reference: the docstrings are written in torch's form, with
Sphinx roles (``:class:`~onebit.OnebitAdam` ``); Markdown shows each role's target as code."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"``\1``", obj.docstring.value)
