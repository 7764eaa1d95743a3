"""JUnit XML for CI: ``tfpar compare --junit FILE`` and ``tfpar matrix --junit FILE``.

One ``<testsuite>`` per case, one ``<testcase>`` per pair (``classname``: the case's name,
``name``: ``reference vs impl``), in the form CI tools read (Jenkins, GitLab, GitHub
Actions' test reporters)::

    <testsuites name="tfpar compare" tests="3" failures="1" errors="1" skipped="0" time="12.3">
      <testsuite name="mlp" tests="3" failures="1" errors="1" skipped="0" time="12.3">
        <testcase classname="mlp" name="tf.towers vs torch.ddp"/>
        <testcase classname="mlp" name="tf.towers vs tf.single">
          <failure type="divergence" message="tf.single: where: loss at step 1 (...)">...</failure>
        </testcase>
        ...

Each status becomes:

| status | element | why |
| --- | --- | --- |
| ``parity``, ``expected_difference`` | none (passed) | exit 0 |
| ``divergence``, ``unexpected_parity`` | ``<failure>`` | exit 1: something wrong was shown |
| ``inconclusive``, ``error`` | ``<error>`` | exit 3: nothing could be judged; a ``<skipped>`` would read as fine in most CI views while the command fails |
| ``unsupported`` (matrix) | ``<skipped>`` | the implementation does not run that row; the matrix counts it as expected |

The failure's or error's ``message`` and the first line of its text are the pair's where-line
(the stage and step where the runs part, as ``tfpar compare`` prints it, or the verdict's first
line where nothing was localised); the verdict's detail follows. The file is written atomically.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from parity_tests.judging.verdict import EXIT_STATUS
from parity_tests.protocol.atomic import atomic_write_bytes

if TYPE_CHECKING:
    from parity_tests.session.comparison import CaseResult
    from parity_tests.session.lockstep import LockstepResult

__all__ = ["JUnitCase", "cases_of", "lockstep_cases_of", "failed_run_cases", "junit_xml", "write_junit"]

#: characters XML 1.0 cannot hold (a control character from a plugin's exception message)
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


@dataclass(frozen=True)
class JUnitCase:
    """One pair as a test case: ``suite`` (the case's name), ``name`` (``ref vs impl``), its ``status``,
    the ``where`` line and the ``detail`` lines that follow it, and the case's ``seconds``."""

    suite: str
    name: str
    status: str
    where: str = ""
    detail: str = ""
    seconds: float = 0.0


def cases_of(result: CaseResult) -> list[JUnitCase]:
    """The pairs of one compared case."""
    return [JUnitCase(result.case.name, f"{p.reference} vs {p.impl}", p.verdict.status, p.where(), p.verdict.detail,
                      result.seconds) for p in result.pairs]


def lockstep_cases_of(result: LockstepResult) -> list[JUnitCase]:
    """Lockstep's pairs (``tfpar compare --lockstep`` takes its exit status from them): the where-line is
    the first bad step's localisation, else that step's verdict line."""
    out = []
    for p in result.pairs:
        first = p.detail.splitlines()[0] if p.detail else p.status
        where = p.where_line() or ("" if p.first_bad_step is None else f"{p.impl}: step {p.first_bad_step}: {first}")
        out.append(JUnitCase(f"{result.free.case.name} (lockstep)", f"{p.reference} vs {p.impl}", p.status,
                             where or f"{p.impl}: {first}", p.detail, result.seconds_free + result.seconds_lockstep))
    return out


def failed_run_cases(case_name: str, impls: Sequence[str], message: str) -> list[JUnitCase]:
    """An implementation failed before any verdict (``tfpar: run failed: ...``): every pair is an ``error``."""
    return [JUnitCase(case_name, f"{impls[0]} vs {impl}", "error", message) for impl in impls[1:]]


def _text(s: str) -> str:
    return _NOT_XML.sub("?", s)


def junit_xml(cases: Sequence[JUnitCase], *, name: str) -> bytes:
    """The JUnit XML document (UTF-8, with its declaration) for ``cases``, grouped by ``suite`` in order."""

    def counts(of: Sequence[JUnitCase]) -> dict[str, str]:
        kinds = [_element(c.status) for c in of]
        return {"tests": str(len(of)), "failures": str(kinds.count("failure")), "errors": str(kinds.count("error")),
                "skipped": str(kinds.count("skipped"))}

    suites: dict[str, list[JUnitCase]] = {}
    for c in cases:
        suites.setdefault(c.suite, []).append(c)
    seconds = {s: max((c.seconds for c in cs), default=0.0) for s, cs in suites.items()}
    root = ET.Element("testsuites", {"name": _text(name), **counts(cases), "time": f"{sum(seconds.values()):.3f}"})
    for suite, members in suites.items():
        el = ET.SubElement(root, "testsuite", {"name": _text(suite), **counts(members), "time": f"{seconds[suite]:.3f}"})
        for c in members:
            tc = ET.SubElement(el, "testcase", {"classname": _text(suite), "name": _text(c.name)})
            kind = _element(c.status)
            if kind is None:
                continue
            first = c.where or (c.detail.splitlines()[0] if c.detail else c.status)
            child = ET.SubElement(tc, kind, {"type": c.status, "message": _text(first)})
            if kind != "skipped":
                child.text = _text("\n".join(x for x in (c.where, c.detail) if x))
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True) + b"\n"


def _element(status: str) -> str | None:
    """``None`` (passed), ``failure``, ``error`` or ``skipped`` for a status (module docstring's table)."""
    code = EXIT_STATUS.get(status)
    return None if code == 0 else "failure" if code == 1 else "error" if code == 3 else "skipped"


def write_junit(path: str | os.PathLike, cases: Sequence[JUnitCase], *, name: str) -> Path:
    """Write :func:`junit_xml` to ``path`` atomically (its folder made if missing); returns the path."""
    return atomic_write_bytes(path, junit_xml(cases, name=name))
