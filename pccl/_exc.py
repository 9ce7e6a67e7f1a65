"""Exception-group helpers: a user sees the one error that happened, not trio's nursery wrapping."""

from __future__ import annotations


def sole_exception(exc: BaseException) -> BaseException | None:
    """The single leaf of ``exc`` when it is an exception group (nested groups included) wrapping
    exactly one exception; ``exc`` itself when it is not a group; else None."""
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) != 1:
            return None
        exc = exc.exceptions[0]
    return exc


__all__ = ["sole_exception"]
