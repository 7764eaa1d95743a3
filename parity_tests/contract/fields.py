"""Field readers for case validation: each checks one value and raises :class:`CaseError` naming it."""

from __future__ import annotations

import math
from typing import Any

from parity_tests.protocol.errors import CaseError

__all__ = ["need", "integer", "number", "choice", "obj", "no_extra", "shape_of"]




def need(d: dict, key: str, path: str) -> Any:
    if key not in d:
        raise CaseError(f"{path}.{key}" if path else key, "a value (the field is missing)")
    return d[key]


def integer(v: Any, path: str, lo: int = 1, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise CaseError(path, f"an integer >= {lo}" + (f" and <= {hi}" if hi else ""), v)
    if v < lo or (hi is not None and v > hi):
        raise CaseError(path, f"an integer >= {lo}" + (f" and <= {hi}" if hi else ""), v)
    return v


def number(v: Any, path: str, *, lo: float = 0.0, lo_open: bool = False, hi: float | None = None, hi_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise CaseError(path, "a finite number", v)
    v = float(v)
    bad = v < lo or (lo_open and v == lo) or (hi is not None and (v > hi or (hi_open and v == hi)))
    if bad:
        lo_s = f"> {lo:g}" if lo_open else f">= {lo:g}"
        hi_s = "" if hi is None else (f" and < {hi:g}" if hi_open else f" and <= {hi:g}")
        raise CaseError(path, f"a number {lo_s}{hi_s}", v)
    return v


def choice(v: Any, path: str, options: tuple[str, ...]) -> str:
    if v not in options:
        raise CaseError(path, "one of " + ", ".join(options), v)
    return v


def obj(v: Any, path: str) -> dict:
    if not isinstance(v, dict):
        raise CaseError(path, "an object", v)
    return v


def no_extra(d: dict, allowed: set[str], path: str) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        where = f"{path}.{extra[0]}" if path else extra[0]
        raise CaseError(where, "no such field (allowed: " + ", ".join(sorted(allowed)) + ")")


def shape_of(v: Any, path: str) -> tuple[int, ...]:
    if not isinstance(v, list) or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in v):
        raise CaseError(path, "a list of positive integers (e.g. [5], or [] for a scalar)", v)
    if len(v) > 3:
        raise CaseError(path, "at most 3 dimensions", v)
    return tuple(v)
