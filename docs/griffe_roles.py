"""A griffe extension for the API pages: the docstrings name other objects with
Sphinx roles (:func:`~jaxhistory.step_flops`), which mkdocstrings would show as
written, role and tilde included. Each becomes a code span of the name as Sphinx
shows it: the last part after a ``~``, else the whole name. A paragraph that
introduces a literal block with ``::`` ends in one colon, as Sphinx shows it."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")
LITERAL = re.compile(r"(\S)::$", re.MULTILINE)


def plain(text: str) -> str:
    """The docstring text with every Sphinx role as a code span, and ``::``
    before a literal block as ``:``."""

    def name(match: re.Match) -> str:
        tilde, target = match.groups()
        return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"

    return LITERAL.sub(r"\1:", ROLE.sub(name, text))


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
