"""``protocol.case_read``: which fields of its case a plugin read (the judge maps a difference on a plugin only so)."""

from __future__ import annotations

import copy
import json
import pickle

from parity_tests.protocol.case_read import ReadSpec, paths_read, reads

SPEC = {"dtype": "float64", "parallel": {"devices": 4, "weighting": "equal",
                                         "clip": {"global_norm": 0.5, "where": "per_device"}},
        "model": {"layers": [{"type": "dense", "units": 2}], "reduction": "mean"}}


def test_a_field_asked_for_by_name_is_read_and_nothing_else_is():
    """``spec[...]``, ``.get`` and ``in`` mark the field (also one the case leaves out); nested mappings record into
    the same set; a copy, an iteration or a serialisation marks nothing (it cannot tell which field the program
    uses), so the judge never maps a value on a plugin that may not have read it."""
    spec = ReadSpec(SPEC)
    par = spec["parallel"]
    assert par["weighting"] == "equal" and par.get("accumulate", 1) == 1 and "batch_norm" not in par
    assert par["clip"]["where"] == "per_device"
    seen = paths_read(spec)
    assert {"parallel", "parallel.weighting", "parallel.accumulate", "parallel.batch_norm", "parallel.clip",
            "parallel.clip.where"} <= set(seen), seen
    assert reads(seen, "parallel.clip.where") and not reads(seen, "parallel.clip.global_norm")
    other = ReadSpec(SPEC)
    dict(other["parallel"])
    list(other["model"].items())
    json.dumps(other)
    assert paths_read(other) == ["model", "parallel"], paths_read(other)
    assert not reads(paths_read(other), "parallel.weighting")


def test_the_case_is_the_case_and_a_copy_of_it_is_plain():
    """It compares, serialises and indexes as the dict it wraps; pickled or deep-copied it is that plain dict (a
    process it is sent to records nothing of ours); a plain dict reports nothing (``None``: not a plugin's run)."""
    spec = ReadSpec(SPEC)
    assert spec == SPEC and json.loads(json.dumps(spec)) == SPEC and isinstance(spec["parallel"], dict)
    for again in (pickle.loads(pickle.dumps(spec)), copy.deepcopy(spec)):
        assert again == SPEC and type(again) is dict and type(again["parallel"]["clip"]) is dict
    assert paths_read(dict(SPEC)) is None
