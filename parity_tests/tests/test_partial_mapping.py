"""``session.partial_mapping``: the parallel set-up's differences mapped on the plugin itself, the rest held to its stage.

The 10,000-pair hunt's s3-1181..1183 (``next_batch@tf.single`` against ``tf_side.py:add_n``, equal weighting of uneven
shards and Keras' ``CosineDecay`` a step late under ``native``): no one side takes both differences, so no residual
was judged, and the pair as it ran parts at step 1's loss, where the uneven shards may show first:
``expected_difference``. With the weighting mapped on the plugin itself (``by_size``) only the late schedule is left,
which cannot touch step 1's loss or gradients. Each rule with a case where it must fire and one where it must not.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from parity_tests.contract.case import case_from_dict
from parity_tests.judging.theory import predict
from parity_tests.running import registry
from parity_tests.session.comparison import compare_case
from parity_tests.session.partial_mapping import partial_mapping
from parity_tests.tests.test_scale_rerun import UNEVEN

HUNT_TF = str(Path(__file__).parent / "hunt" / "tf_side.py")
ADD_N = f"{HUNT_TF}:add_n"

#: :data:`test_scale_rerun.UNEVEN` with ``reduction: mean`` and ``equal`` weighting: 3 devices on 4 rows (2, 1, 1),
#: so "uneven shards with equal weighting" (a mapping onto the parallel side only) beside Keras' late CosineDecay of
#: tf.single (the plugins' written-out rules run the curve), which no mapping onto the plugin's side takes
EQUAL = copy.deepcopy(UNEVEN)
EQUAL["model"]["reduction"] = "mean"
EQUAL["parallel"]["weighting"] = "equal"


def _partial(raw, a="tf.single", b=ADD_N):
    for name in (a, b):  # declared, as the session resolves every name before theory reads its kind
        registry.resolve(name, "impls")
    case = case_from_dict(raw)
    # the hunt's rewrite writes its rule and rate out (as the session reads from its run: ``mapping.own_rules``)
    own = {n for n in (a, b) if n.startswith(HUNT_TF)}
    return partial_mapping(case, predict(case.spec, a, b, own=own, own_schedule=own), a, b)


def test_the_weighting_is_mapped_on_the_plugin_and_the_late_schedule_left_to_its_stage():
    p = _partial(EQUAL)
    assert p is not None and p.mapping.itself and p.mapping.side == ADD_N
    assert p.mapping.changes == {"parallel.weighting": "by_size"}
    assert p.earliest == "update" and len(p.rest.expected) == 1 and "one step late" in p.rest.expected[0]
    swapped = _partial(EQUAL, a=ADD_N, b="tf.single")
    assert swapped is not None and swapped.mapping.side == ADD_N


def test_no_partial_mapping_where_the_rest_could_show_before_the_update_or_nothing_is_left():
    """Not where nothing of the parallel set-up is predicted (even shards), where it is all that is predicted (the
    plugin is then mapped on itself whole: ``mapping.on_itself``), where the parallel side is a built-in, or where a
    difference left may show at step 1's loss or gradients (the sum reduction, whose mapping is no case value every
    program runs): the localiser could not tell it from a bug there."""
    even = copy.deepcopy(EQUAL)
    even["data"]["global_batch"] = 6
    assert _partial(even) is None
    plain = copy.deepcopy(EQUAL)
    plain["optimizer"] = {"name": "sgd", "semantics": "native", "lr": 0.1}
    assert _partial(plain) is None
    assert _partial(EQUAL, b="tf.towers") is None
    summed = copy.deepcopy(UNEVEN)
    summed["parallel"]["clip"] = {"global_norm": 0.5, "where": "per_device"}
    assert _partial(summed) is None


@pytest.mark.usefixtures("pool")
def test_a_bug_that_parts_before_the_update_is_a_divergence_and_correct_plugins_are_not():
    """tf.single against the hunt's plugins on :data:`EQUAL`. ``missing_activation`` parts at step 1's loss, as the
    uneven shards may: it was ``expected_difference``; rerun with ``by_size`` it still parts at step 1's loss,
    where the late schedule cannot act: a divergence. ``unshared_towers`` likewise at the combined gradient.
    ``add_n`` and ``stack_mean`` (correct) part from tf.single only at the update once rerun: expected_difference."""
    r = compare_case(case_from_dict(EQUAL), ["tf.single", ADD_N, f"{HUNT_TF}:stack_mean",
                                             f"{HUNT_TF}:missing_activation", f"{HUNT_TF}:unshared_towers"])
    pairs, summary = {p.impl.rsplit(":", 1)[-1]: p for p in r.pairs}, r.summary()
    for name in ("add_n", "stack_mean"):
        assert pairs[name].verdict.status == "expected_difference", summary
        assert any("run with parallel.weighting by_size: the runs part first at update" in n
                   for n in pairs[name].notes), summary
    for name, stage in (("missing_activation", "loss"), ("unshared_towers", "combined_grads")):
        bug = pairs[name].verdict
        assert bug.status == "divergence", summary
        assert "run with parallel.weighting by_size" in bug.detail, summary
        assert f"first at update, but it appeared first at {stage}" in bug.detail, summary
