"""Every refusal of a case happens before any implementation runs (issue 35, item 7).

``tfpar.refusals`` decides from the spec alone what each TensorFlow engine's ``run_case``
refuses (no TensorFlow imported for it); ``harness.check_refusals`` / ``harness.refusal`` ask
every named implementation before the first runs: ``compare`` (and lockstep, and the matrix,
which records a refusing implementation's pairs as ``unsupported``) never runs ``torch.ddp``
for 10-60 s only to learn that ``tf.mirrored``, named after it, refuses ``data.order:
distributed_sampler``. The tests count runs through the real runner rather than time them.
"""

from __future__ import annotations

import pytest

from parity_tests.cli import main
from parity_tests.contract.case import write_case
from parity_tests.protocol.errors import CaseError
from parity_tests.running import harness
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import MLP, make

SAMPLER = {"data__order": "distributed_sampler", "parallel__shard": "strided"}


def _counting(calls: list[str]):
    def runner(case, impl):
        calls.append(impl)
        return harness.run_impl(case, impl)

    return runner


def test_compare_refuses_before_the_first_implementation_runs():
    case = make(MLP, parallel__devices=2, steps=1, **SAMPLER)
    calls: list[str] = []
    with pytest.raises(CaseError) as e:
        compare_case(case, ["torch.ddp", "tf.mirrored"], runner=_counting(calls))
    assert e.value.field == "data.order" and "tf.mirrored" in str(e.value) and "\n" not in str(e.value)
    assert calls == []  # not one run: torch.ddp, listed first, would have run first


def test_cli_compare_exits_2_before_any_run_or_the_pool_starts(tmp_path, capsys, monkeypatch):
    runs: list[str] = []
    monkeypatch.setattr("parity_tests.session.comparison.run_impl", lambda c, i, **k: runs.append(i))
    monkeypatch.setattr(harness, "prestart_torch", lambda *a: runs.append("pool"))
    path = write_case(make(MLP, parallel__devices=2, steps=1, **SAMPLER), tmp_path / "c")
    assert main(["compare", str(path), "--impls", "torch.ddp,tf.mirrored"]) == 2
    out, err = capsys.readouterr()
    assert "data.order" in err and "tf.mirrored" in err
    assert runs == [] and "run 1/" not in err + out  # no run, no progress line, no pool started for it


def test_the_matrix_records_a_refusing_implementation_without_running_it(pool):
    """``skip_unsupported`` (the matrix): the refusing implementation's pair is ``unsupported``, and
    none of its runs is made; the reference and the others run as before."""
    case = make(MLP, parallel__devices=2, steps=1, **SAMPLER)
    calls: list[str] = []
    result = compare_case(case, ["torch.ddp", "tf.mirrored", "torch.single"], runner=_counting(calls),
                          skip_unsupported=True)
    assert "tf.mirrored" not in calls and "torch.ddp" in calls and "torch.single" in calls
    statuses = {p.impl: p.verdict.status for p in result.pairs}
    assert statuses["tf.mirrored"] == "unsupported" and "data.order" in result.pairs[0].verdict.detail
    assert statuses["torch.single"] != "unsupported"


@pytest.mark.parametrize(("changes", "impl", "field"), [
    (SAMPLER, "tf.mirrored", "data.order"),
    (SAMPLER, "tf.v1", "data.order"),
    ({"parallel__combine": "param_mean"}, "tf.mirrored", "parallel.combine"),
    ({"optimizer": {"name": "sgd", "lr": 0.1, "weight_decay": 0.01}}, "tf.v1", "optimizer.weight_decay"),
    ({"dtype": "mixed_bfloat16"}, "tf.v1", "dtype"),
    ({}, "tf.multiworker", "--impl"),
], ids=["mirrored-sampler", "v1-sampler", "mirrored-param_mean", "v1-weight-decay", "v1-bfloat16", "multiworker"])
def test_each_refusal_is_one_line_naming_the_field(changes, impl, field):
    case = make(MLP, parallel__devices=2, steps=1, **changes)
    with pytest.raises(CaseError) as e:
        harness.check_refusals(case, ["tf.towers", impl])
    assert e.value.field == field and "\n" not in str(e.value)


def test_nothing_is_refused_of_a_case_every_implementation_runs():
    """The must-not-fire side: the plain case passes every built-in's refusal, and the sampler case
    the engines that declare it."""
    harness.check_refusals(make(MLP, parallel__devices=2, steps=1),
                           ["tf.towers", "tf.single", "tf.v1", "tf.mirrored", "torch.ddp", "torch.single"])
    harness.check_refusals(make(MLP, parallel__devices=2, steps=1, **SAMPLER),
                           ["tf.towers", "tf.single", "torch.ddp", "torch.single"])


def test_the_refusal_is_the_one_run_case_makes():
    """``tfpar.run_case`` refuses through the same function: the same field and words, run or asked."""
    import tfpar
    from parity_tests.running.backends import tf_module

    tf_module()
    case = make(MLP, parallel__devices=2, steps=1, **SAMPLER)
    with pytest.raises(tfpar.Unsupported) as ran:
        tfpar.run_case(case.payload(), "tf.mirrored")
    asked = harness.refusal(case, "tf.mirrored")
    assert (asked.field, str(asked)) == (ran.value.field, str(CaseError(ran.value.field, ran.value.expected)))
