"""``assert_parity``: a parity check for users' own tests, failing like ``torch.testing.assert_close``.

    from parity_tests import assert_parity

    def test_my_towers_match_ddp():
        assert_parity("cases/mlp.json", ["my_towers.py:train", "torch.ddp"])

The first implementation is the reference; every other one is judged against
it (:func:`parity_tests.session.comparison.compare_case`). When any pair is not at
parity the ``AssertionError`` carries the judge's summary: the table of pairs,
then the first failing place (step, parameter, mismatched elements, greatest
absolute and relative differences and the bound allowed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from parity_tests.contract.case import Case, case_from_dict, load_case
from parity_tests.protocol.errors import CaseError
from parity_tests.session.comparison import CaseResult, compare_case

__all__ = ["assert_parity"]


def _as_case(case: Any) -> Case:
    if isinstance(case, Case):
        return case
    if isinstance(case, dict):
        return case_from_dict(case)
    if isinstance(case, str | os.PathLike):
        return load_case(case)
    raise CaseError("case", "a Case, a case dict or the path of a case.json", type(case).__name__)


def _as_names(impls: Any) -> list[str]:
    names = [n.strip() for n in impls.split(",")] if isinstance(impls, str) else list(impls)
    if len(names) < 2 or not all(isinstance(n, str) and n for n in names):
        raise CaseError("impls", "at least two implementation names, the reference first", impls)
    return names


def assert_parity(case: Case | dict | str | os.PathLike, impls: Sequence[str] | str, **compare_kwargs: Any) -> CaseResult:
    """Run ``case`` on every implementation of ``impls`` and assert that each is at parity with the first.

    Args:
        case: a validated :class:`~parity_tests.contract.case.Case` (e.g. one a strategy drew),
            a case dict, or the path of a ``case.json``.
        impls: implementation names (built-ins, ``file.py:function``, ``module:function``,
            installed short names, ``recorded:run.npz``), or one comma-separated string.
        compare_kwargs: passed to :func:`~parity_tests.session.comparison.compare_case`
            (``progress``, ``runner``, ``skip_unsupported``).

    Returns:
        The :class:`~parity_tests.session.comparison.CaseResult` (every pair at parity).

    Raises:
        AssertionError: some pair is not at parity (a divergence, an expected difference, an error);
            the message is the judge's summary, naming the step, the parameter, the greatest
            differences and the bound.
        CaseError: bad input (a case that does not validate, an unknown implementation).
    """
    __tracebackhide__ = True  # pytest shows the caller's line and the summary, not this frame
    result = compare_case(_as_case(case), _as_names(impls), **compare_kwargs)
    if not result.parity:
        raise AssertionError(result.summary())
    return result
