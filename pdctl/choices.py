"""Closed sets of words (``(str, Enum)``: they compare equal to their strings, so files, JSON and
command lines keep spelling them as text) and one way to read them."""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

E = TypeVar("E", bound=Enum)


class Choice(str, Enum):
    """A closed set of words: equal to its strings, printed as them (``f"{mode}"`` is ``abort``)."""

    def __str__(self) -> str:
        return str(self.value)


def parse_choice(cls: type[E], value: object, what: str) -> E:
    """``value`` as a member of ``cls``; ValueError naming ``what`` and the choices otherwise."""
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(str(m.value) for m in cls)
        raise ValueError(f"{what} must be one of {choices}, not {value!r}") from None
