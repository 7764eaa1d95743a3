"""``torchref.torch_seen``: which torch optimizers a run made, and whether each is torch's class for the case.

In-process and small: the records are built from real ``torch.optim`` objects (the judge's reading of them
is in ``test_mapping.py``, on DDP plugins). Each answer is checked both ways: the case's own class at the
case's values is the case's rule, and every changed class or value is not.
"""

from __future__ import annotations

import pytest
import torch

from parity_tests.session.comparison import torch_rule_from
from parity_tests.tests.helpers import MLP, make
from torchref.optimizers import KerasRule
from torchref.torch_seen import check_against_case, describe, mark_handed, torch_optimizers_seen

ADAMW = {"name": "adamw", "lr": 0.01, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-3, "weight_decay": 0.05}  # not torch AdamW's default 0.01


def _case_opt(optimizer):
    return make(MLP, optimizer=optimizer).spec["optimizer"]


def _params():
    return [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(1))]


def test_every_optimizer_made_in_the_block_is_recorded_with_its_rule_and_groups():
    with torch_optimizers_seen() as (seen, made):
        adamw = torch.optim.AdamW(_params(), lr=torch.tensor(0.01), eps=1e-3)
        sgd = torch.optim.SGD(_params(), lr=0.1, momentum=0.9, nesterov=True)
    assert made == [adamw, sgd]
    assert seen[0]["class"] == "AdamW" and seen[0]["rule"] == "torch.optim.Adam" and seen[0]["family"] == "torch.optim"
    group = seen[0]["groups"][0]
    assert group["eps"] == 1e-3 and group["betas"] == [0.9, 0.999] and group["decoupled_weight_decay"] is True
    assert group["lr"] == pytest.approx(0.01) and group["lr_type"] == "float32"  # a tensor rate: its dtype
    assert seen[1]["rule"] == "torch.optim.SGD" and seen[1]["groups"][0]["lr_type"] == "float"
    # restored after the block: nothing made outside it is seen
    torch.optim.Adam(_params())
    assert len(seen) == 2


def test_the_wrap_is_removed_when_the_block_raises():
    original = torch.optim.Optimizer.__init__
    with pytest.raises(RuntimeError), torch_optimizers_seen():
        raise RuntimeError("the plugin raised")
    assert torch.optim.Optimizer.__init__ is original


def test_a_subclass_with_its_own_step_is_its_own_rule():
    """KerasRule subclasses torch.optim.Optimizer but defines its step: Keras' rule, never the case's torch class."""
    spec = _case_opt(ADAMW)
    with torch_optimizers_seen() as (seen, _):
        KerasRule(_params(), {**spec, "semantics": "tf", "keras_rounding": "none"})
    assert seen[0]["family"] == "own" and seen[0]["rule"].endswith("KerasRule")
    assert check_against_case(seen[0], spec) == (False, f"{seen[0]['rule']} (its own step)")


@pytest.mark.parametrize(("make_opt", "ok", "says"), [
    (lambda p, o: torch.optim.AdamW(p, lr=o["lr"], eps=o["epsilon"], weight_decay=o["weight_decay"]), True, ""),
    # torch 2.13's Adam with decoupled decay is AdamW's rule (AdamW steps with Adam's step)
    (lambda p, o: torch.optim.Adam(p, lr=o["lr"], eps=o["epsilon"], weight_decay=o["weight_decay"],
                                   decoupled_weight_decay=True), True, ""),
    (lambda p, o: torch.optim.AdamW(p, lr=0.5, eps=o["epsilon"], weight_decay=o["weight_decay"]), True, ""),  # lr: set per step
    (lambda p, o: torch.optim.Adam(p, lr=o["lr"], eps=o["epsilon"], weight_decay=o["weight_decay"]), False,
     "decoupled_weight_decay=False"),
    (lambda p, o: torch.optim.AdamW(p, lr=o["lr"], weight_decay=o["weight_decay"]), False, "eps=1e-08"),
    (lambda p, o: torch.optim.AdamW(p, lr=o["lr"], eps=o["epsilon"]), False, "weight_decay=0.01"),
    (lambda p, o: torch.optim.SGD(p, lr=o["lr"]), False, "steps with torch.optim.SGD"),
])
def test_the_case_rule_is_torchs_class_at_the_case_values(make_opt, ok, says):
    spec = _case_opt(ADAMW)
    with torch_optimizers_seen() as (seen, _):
        make_opt(_params(), spec)
    got, why = check_against_case(seen[0], spec)
    assert got is ok and says in why, why


def test_no_decay_groups_may_hold_weight_decay_zero_only_where_the_case_says_so():
    params = _params()
    with torch_optimizers_seen() as (seen, _):
        torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=0.01, eps=1e-3,
                          weight_decay=0.05)
    assert check_against_case(seen[0], _case_opt({**ADAMW, "no_decay": ["bias"]}))[0]
    ok, why = check_against_case(seen[0], _case_opt(ADAMW))
    assert not ok and "group 1" in why


def test_the_handed_optimizer_decides_and_the_judge_reads_the_record():
    """``run.use_optimizer``'s optimizer is the one that steps; a probe optimizer beside it is not read. The judge's
    :func:`torch_rule_from`: ``None`` for torch's class at the case's values, a reason for another and for none."""
    spec = _case_opt(ADAMW)
    with torch_optimizers_seen() as (seen, made):
        probe = torch.optim.SGD(_params(), lr=1.0)
        real = torch.optim.AdamW(_params(), lr=0.01, eps=1e-3, weight_decay=0.05)
    assert probe is made[0]
    records = mark_handed(seen, made, real, spec)
    assert [r["handed"] for r in records] == [False, True] and [r["case_rule"] for r in records] == [False, True]
    assert torch_rule_from(records) is None  # the handed AdamW decides
    unhanded = mark_handed(seen, made, None, spec)
    assert "torch.optim.SGD" in torch_rule_from(unhanded)  # without it, every torch.optim optimizer counts
    assert torch_rule_from([]) == "made no torch.optim optimizer, so its update rule is its own code's"
    with torch_optimizers_seen() as (own, own_made):
        KerasRule(_params(), {**spec, "semantics": "tf", "keras_rounding": "none"})
    assert "made no torch.optim optimizer (only" in torch_rule_from(mark_handed(own, own_made, None, spec))
    # handed over beside a torch.optim probe, the rule with a step of its own is what steps
    with torch_optimizers_seen() as (both, both_made):
        torch.optim.AdamW(_params(), lr=0.01, eps=1e-3, weight_decay=0.05)
        keras = KerasRule(_params(), {**spec, "semantics": "tf", "keras_rounding": "none"})
    said = torch_rule_from(mark_handed(both, both_made, keras, spec))
    assert said.startswith("made no torch.optim optimizer (only torchref.optimizers.KerasRule"), said
    assert torch_rule_from(mark_handed(both, both_made, None, spec)) is None  # unhanded: the torch.optim one steps
    assert describe(real)["rule"] == "torch.optim.Adam"
