"""The plugin base both sides extend: what a plugin's decorator declares, checked and read once.

``@tfpar.plugin.tensorflow`` and ``@torchref.plugin.distributed`` / ``.single`` are each one call of
:func:`decorator`: it checks the arguments (``dtypes=`` with :func:`check_dtypes`, the flags with
:func:`check_flag`) and sets :data:`MARK` on the function to a :class:`PluginMark`; the parity tool
reads it back with :func:`describe`, in whichever process imported the user's module. A plugin that
raises is reported as a :class:`PluginRaised` (each side subclasses it, naming its own side), its
moment worded by :func:`when_raised`. So the two sides accept and refuse the same declarations with
the same one-line messages, and what only one framework can do stays in its own ``plugin`` module.
Standard library only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from parity_tests.protocol.errors import TfparError

__all__ = ["MARK", "DTYPES", "KINDS", "PluginDeclarationError", "PluginMark", "PluginRaised", "check_dtypes",
           "check_flag", "decorator", "describe", "when_raised"]

#: the attribute a plugin decorator sets on the function it marks
MARK = "__tfpar_plugin__"
#: the case dtypes a plugin may declare
DTYPES = ("float32", "float64")
#: each kind of plugin and the decorator that marks it
KINDS = {"tensorflow": "@tfpar.plugin.tensorflow", "distributed": "@torchref.plugin.distributed",
         "single": "@torchref.plugin.single"}


class PluginDeclarationError(TfparError, ValueError):
    """A decorator was given something it cannot accept (e.g. an unknown dtype)."""


@dataclass(frozen=True)
class PluginMark:
    """Where a plugin runs (``tensorflow``, ``distributed`` or ``single``) and what it declares."""

    kind: str
    dtypes: tuple[str, ...]
    keras: bool = False  #: its optimizers are Keras' (the tool then maps Keras' float32 hyperparameters)
    #: ``False``: it cannot run deterministically (op determinism is then off for its runs, and the
    #: judge measures its run-to-run spread: docs/plugins.md "Determinism")
    deterministic: bool = True


def check_dtypes(dtypes: Any, decorator: str) -> tuple[str, ...]:
    """``dtypes`` as a tuple of names of :data:`DTYPES`, or :class:`PluginDeclarationError` naming the bad one.

    Args:
        dtypes: what the decorator was given: one name or an iterable of names.
        decorator: the decorator as the user wrote it (``"tfpar.plugin.tensorflow"``), for the message.
    """
    if isinstance(dtypes, str):
        dtypes = (dtypes,)
    try:
        out = tuple(dtypes)
    except TypeError:
        raise PluginDeclarationError(f"{decorator}(dtypes=...) takes a tuple of dtype names, got {dtypes!r}") from None
    if not out:
        raise PluginDeclarationError(f"{decorator}(dtypes=...) needs at least one of {', '.join(DTYPES)}")
    for d in out:
        if d not in DTYPES:
            raise PluginDeclarationError(f"{decorator}(dtypes=...): unknown dtype {d!r}; expected among {', '.join(DTYPES)}")
    return out


def check_flag(value: Any, decorator: str, name: str) -> bool:
    """``value`` if it is ``True`` or ``False``, else :class:`PluginDeclarationError` naming ``name``."""
    if not isinstance(value, bool):
        raise PluginDeclarationError(f"{decorator}({name}=...) takes True or False, got {value!r}")
    return value


def decorator(kind: str, name: str, fn: Callable | None, dtypes: Any, **flags: bool) -> Callable:
    """``fn`` marked as a plugin of ``kind`` (or, ``fn`` being ``None``, the decorator that marks it).

    Args:
        kind: a key of :data:`KINDS`.
        name: the decorator as the user writes it (``"tfpar.plugin.tensorflow"``), for messages.
        dtypes: as given (:func:`check_dtypes`).
        flags: ``keras``, ``deterministic``: as given, each checked by :func:`check_flag` in the order given.
    """
    checked = check_dtypes(dtypes, name)
    for flag, value in flags.items():
        check_flag(value, name, flag)
    mark = PluginMark(kind, checked, **flags)

    def marked(f: Callable) -> Callable:
        setattr(f, MARK, mark)
        return f

    return marked(fn) if fn is not None else marked


def describe(fn: Any) -> dict[str, Any]:
    """What the parity tool needs to know of a module's attribute: is it there, callable, marked, and how."""
    mark = getattr(fn, MARK, None)
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    return {"found": fn is not None, "callable": callable(fn), "type": type(fn).__name__,
            "mark": None if getattr(mark, "kind", None) not in KINDS else
            {"kind": mark.kind, "dtypes": tuple(mark.dtypes), "keras": bool(getattr(mark, "keras", False)),
             "deterministic": bool(getattr(mark, "deterministic", True))},
            "file": getattr(module, "__file__", None)}


def when_raised(begun: bool, recorded: int, steps: int) -> tuple[int, str]:
    """(the step, ``"before step 1"`` / ``"at step k"`` / ``"after step N"``) of a plugin that raised after
    ``run.begin`` (``begun``) and ``recorded`` of its ``steps`` steps."""
    when = "before step 1" if not begun else (f"after step {steps}" if recorded >= steps else f"at step {recorded + 1}")
    return (recorded + 1 if begun else 0), when


class PluginRaised(TfparError, RuntimeError):
    """The plugin raised: when (``"at step 3"``, ``"before step 1"``), the exception's last line, the user's frames.

    Each side raises its own subclass (``tfpar.plugin.PluginRaised``, ``torchref.plugin.PluginRaised``), whose
    name ends the line the parent reads (``PluginRaised: at step 3: KeyError: 'lr'``).

    Attributes:
        step: the step it was on (recorded steps + 1; 0 before ``run.begin``).
        when: ``"before step 1"`` (before ``run.begin``), ``"at step k"``, or ``"after step N"``
            (every step recorded).
        line: ``"KeyError: 'lr'"`` (or what to do about a known cause).
        frames: the traceback of the user's own frames (``parity_tests.protocol.frames.user_traceback``).
    """

    def __init__(self, step: int, line: str, when: str = "", frames: str = "") -> None:
        self.step, self.line, self.when, self.frames = step, line, when or f"at step {step}", frames
        super().__init__(f"{self.when}: {line}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.step, self.line, self.when, self.frames))
