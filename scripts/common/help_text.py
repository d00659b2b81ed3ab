"""Help text as a terminal shows it.

The tools' docstrings are reStructuredText (``literal``, :class:`name`);
their ``--help`` shows them without that markup (``plain``), through a help
formatter that strips it from every description, epilog and option help
(``plain_formatter``), and a docstring's first paragraph is said once
(``description_and_epilog``).
"""

from __future__ import annotations

import argparse
import re

#: :role:`target` and :role:`~target` -> target
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`")
#: ``literal`` -> literal (also across a line break)
_LITERAL = re.compile(r"``([^`]+?)``")


def plain(text: str | None) -> str | None:
    """``text`` without reStructuredText roles and literal markup."""
    if not text:
        return text
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text))


def description_and_epilog(doc: str | None) -> tuple[str, str]:
    """A docstring as ``(its first paragraph, the rest)``, for a parser's
    description and epilog (the first paragraph not said twice)."""
    first, _, rest = (doc or "").strip().partition("\n\n")
    return first, rest


class _Plain:
    """Strips the markup from what a help formatter writes."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))  # type: ignore[misc]

    def _expand_help(self, action: argparse.Action) -> str:
        return plain(super()._expand_help(action))  # type: ignore[misc]


def plain_formatter(base: type = argparse.RawDescriptionHelpFormatter) -> type:
    """``base`` (a help formatter class) stripping the markup."""
    return type(f"Plain{base.__name__}", (_Plain, base), {})


#: The tools' help formatter: the docstring's own line breaks, no markup.
PlainHelpFormatter = plain_formatter()
