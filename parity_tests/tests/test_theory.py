"""theory.predict: every prediction appears where its condition holds and vanishes where the values make it zero.

Each row is one prediction, a case where it must be made and the edge value that makes the
difference exactly zero (epsilon 0, beta2 0, weight decay 0, momentum 0, a learning rate of 0,
even shards, a hyperparameter float32 holds exactly, momentum 1 in batch norm, ...). The
judge-level tests (``test_pair.py``) show the verdicts that follow at those values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from parity_tests.judging.theory import mapping_changes, predict
from parity_tests.tests.helpers import CNN, MLP, POLY, make
from parity_tests.tests.processes import HANG_DEADLINE

ADAM = {"name": "adam", "lr": 0.01, "epsilon": 1e-3}
COSINE = {"name": "sgd", "lr": 0.05, "schedule": {"kind": "warmup_cosine", "warmup_steps": 2, "decay_steps": 3,
                                                  "min_lr": 0.005}}
ROWS = [
    # id, base, changes where it holds, changes where it vanishes, pair, words of the prediction
    ("adam-epsilon", MLP, {"optimizer": ADAM}, {"optimizer": dict(ADAM, epsilon=0.0)},
     ("tf.towers", "torch.ddp"), "Adam epsilon placement"),
    ("adam-beta2-0", MLP, {"optimizer": ADAM}, {"optimizer": dict(ADAM, beta2=0.0)},
     ("tf.towers", "torch.ddp"), "Adam epsilon placement"),
    ("amsgrad-epsilon", MLP, {"optimizer": dict(ADAM, name="amsgrad")},
     {"optimizer": dict(ADAM, name="amsgrad", epsilon=0.0)}, ("tf.towers", "torch.ddp"), "AMSGrad epsilon placement"),
    ("rmsprop-epsilon", MLP, {"optimizer": {"name": "rmsprop", "lr": 0.01}},
     {"optimizer": {"name": "rmsprop", "lr": 0.01, "epsilon": 0.0}}, ("tf.towers", "torch.ddp"), "RMSprop epsilon"),
    ("adagrad-epsilon", MLP, {"optimizer": {"name": "adagrad", "lr": 0.01}},
     {"optimizer": {"name": "adagrad", "lr": 0.01, "epsilon": 0.0}}, ("tf.towers", "torch.ddp"), "Adagrad epsilon"),
    ("weight-decay", MLP, {"optimizer": {"name": "momentum", "lr": 0.01, "weight_decay": 0.01}},
     {"optimizer": {"name": "momentum", "lr": 0.01, "weight_decay": 0.0}}, ("tf.towers", "torch.ddp"), "weight decay"),
    ("weight-decay-momentum-0", MLP, {"optimizer": {"name": "momentum", "lr": 0.01, "weight_decay": 0.01}},
     {"optimizer": {"name": "momentum", "lr": 0.01, "momentum": 0.0, "weight_decay": 0.01}},
     ("tf.towers", "torch.ddp"), "weight decay"),
    ("momentum-holds-lr", MLP,
     {"optimizer": {"name": "momentum", "lr": 0.01, "schedule": {"kind": "warmup_linear", "warmup_steps": 3}}},
     {"optimizer": {"name": "momentum", "lr": 0.01, "momentum": 0.0, "schedule": {"kind": "warmup_linear",
                                                                                  "warmup_steps": 3}}},
     ("tf.towers", "torch.ddp"), "momentum holds lr"),
    ("lr-0", MLP, {"optimizer": ADAM}, {"optimizer": dict(ADAM, lr=0.0)}, ("tf.towers", "torch.ddp"), "epsilon"),
    ("keras-float32-lr", MLP, {"optimizer": {"name": "sgd", "lr": 0.01}}, {"optimizer": {"name": "sgd", "lr": 0.5}},
     ("tf.towers", "torch.ddp"), "Keras rounds"),
    ("uneven-shards", MLP, {"data.global_batch": 50}, {"data.global_batch": 48},
     ("tf.towers", "tf.single"), "uneven shards"),
    ("clip-per-device", MLP, {"parallel.clip": {"global_norm": 0.1, "where": "per_device"}},
     {"parallel.clip": {"global_norm": 0.1, "where": "per_device"}, "optimizer": {"name": "sgd", "lr": 0.0}},
     ("tf.towers", "tf.single"), "clipping before vs after"),
    ("bn-moving-variance", CNN, {"model.layers.1.semantics": "native"}, {"model.layers.1.momentum": 1.0},
     ("tf.towers", "torch.ddp"), "moving variance"),
    ("param-mean-adam", POLY, {"parallel.combine": "param_mean"},
     {"parallel.combine": "param_mean", "optimizer": {"name": "adam", "lr": 0.0}}, ("tf.towers", "tf.single"),
     "param_mean with adam"),
    ("cosine-keras-one-step-late", MLP, {"optimizer": dict(COSINE, semantics="native")},
     {"optimizer": dict(COSINE, semantics="torch")}, ("tf.towers", "torch.ddp"), "one step late"),
    ("cosine-keras-one-step-late-tf", MLP, {"optimizer": dict(COSINE, semantics="native")},
     {"optimizer": dict(COSINE, semantics="tf")}, ("tf.towers", "torch.ddp"), "one step late"),
    ("cosine-recursion-float64", MLP, {"optimizer": dict(COSINE, semantics="native")},
     {"optimizer": dict(COSINE, semantics="native"), "dtype": "float32"}, ("tf.towers", "torch.ddp"),
     "CosineAnnealingLR are recursive"),
    ("v1-adam", POLY, {"optimizer": {"name": "adam", "lr": 0.05}},
     {"optimizer": {"name": "adam", "lr": 0.05, "beta1": 0.5, "beta2": 0.75, "epsilon": 0.25}},
     ("tf.v1", "tf.towers"), "tf.compat.v1 AdamOptimizer"),
]


def _case(base: dict, changes: dict[str, Any]):
    return make(base, **{k.replace(".", "__"): v for k, v in changes.items()})


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_a_prediction_appears_where_it_holds_and_vanishes_at_the_edge(row):
    _, base, holds, vanishes, (a, b), words = row
    pred = predict(_case(base, holds).spec, a, b)
    assert any(words in d.text for d in pred.differences), pred
    gone = predict(_case(base, vanishes).spec, a, b)
    assert not any(words in d.text for d in gone.differences), gone


def test_the_absent_list_says_why():
    gone = predict(make(MLP, optimizer=dict(ADAM, epsilon=0.0)).spec, "tf.towers", "torch.ddp")
    assert "Adam epsilon placement: epsilon is 0" in gone.absent
    frozen = predict(make(MLP, optimizer={"name": "momentum", "lr": 0.0}).spec, "tf.towers", "torch.ddp")
    assert frozen.absent == ("momentum: every step's learning rate is 0, so no optimizer rule moves the parameters",
                             "Keras' float32 hyperparameters: no step moves the parameters")


def test_certain_predictions_are_those_the_loss_or_state_shows_at_step_1():
    sum_red = predict(make(MLP, model__reduction="sum").spec, "torch.ddp", "torch.single")
    assert [d.certain for d in sum_red.differences] == [True]
    adam = predict(make(MLP, optimizer=ADAM).spec, "tf.towers", "torch.ddp")
    assert not any(d.certain for d in adam.differences if d.expected)  # its size depends on the gradients


def test_differences_of_the_bfloat16_roundings_alone_are_marked_so():
    """Keras' bias gradient summed in bfloat16 and the recipes' known roundings exist only in bfloat16 arithmetic
    (``Difference.only_in``): the float64 runs a mixed pair is held against compute none of them, so
    ``pair.resolve`` lets none explain a gap between those runs. A difference of the formulas is in every dtype."""
    mixed = make(MLP, dtype="mixed_bfloat16", parallel__devices=4, data__global_batch=50, optimizer=ADAM)
    pred = predict(mixed.spec, "tf.towers", "torch.single")  # no kernel probe: the bias sum is assumed bfloat16
    only = {d.text.split(":")[0]: d.only_in for d in pred.differences}
    assert only["bias gradient summed in bfloat16"] == "bfloat16"
    assert only["mixed precision, dense bias"] == "bfloat16"
    assert only["uneven shards with equal weighting"] is None and only["Adam epsilon placement"] is None, only


@pytest.mark.parametrize(("kind", "side", "other", "changes"), [
    ("optimizer", "tf.towers", "torch.ddp", {"optimizer.semantics": "torch"}),
    ("optimizer", "torch.ddp", "tf.towers", {"optimizer.semantics": "tf", "optimizer.keras_rounding": "floatx_float32"}),
    ("optimizer", "torch.ddp", "torch.single", None),
    ("weighting", "tf.towers", "tf.single", {"parallel.weighting": "by_size"}),
    ("weighting", "tf.single", "tf.towers", None),  # one device cannot weight N shards equally
    ("batch_norm", "torch.ddp", "torch.single", {"parallel.batch_norm": "sync"}),
])
def test_mapping_changes_make_a_side_compute_the_other(kind, side, other, changes):
    assert mapping_changes(kind, make(MLP).spec, side, other) == changes


def test_a_tf_plugin_that_held_no_keras_optimizer_is_mapped_to_exact_numbers():
    spec = make(MLP).spec
    assert mapping_changes("optimizer", spec, "torch.ddp", "tf.towers", "none") == {
        "optimizer.semantics": "tf", "optimizer.keras_rounding": "none"}
    assert mapping_changes("optimizer", spec, "torch.ddp", "tf.towers", "floatx_float64")[
        "optimizer.keras_rounding"] == "floatx_float64"


def test_warmup_cosine_lateness_is_predicted_across_frameworks_only_and_never_mapped_onto_keras():
    spec = make(MLP, optimizer=dict(COSINE, semantics="native")).spec
    across = predict(spec, "tf.towers", "torch.ddp")
    late = [d for d in across.differences if "one step late" in d.text]
    assert len(late) == 1 and late[0].expected and late[0].mapping == "optimizer" and late[0].stage == "update"
    assert "lr first at step 3, min_lr from step 6" in late[0].text
    for a, b in (("tf.towers", "tf.single"), ("tf.mirrored", "tf.towers"), ("torch.ddp", "torch.single")):
        assert not any("one step late" in d.text or "recursive" in d.text for d in predict(spec, a, b).differences)
    # Keras' float32 cos kernel is not reproducible elsewhere: the torch side is never mapped onto it,
    # the Keras side is mapped onto torch's rule instead (and a Keras rule with exact numbers stays possible)
    assert mapping_changes("optimizer", spec, "torch.ddp", "tf.towers") is None
    assert mapping_changes("optimizer", spec, "tf.towers", "torch.ddp") == {"optimizer.semantics": "torch"}
    assert mapping_changes("optimizer", spec, "torch.ddp", "tf.towers", "none") == {
        "optimizer.semantics": "tf", "optimizer.keras_rounding": "none"}
    assert mapping_changes("optimizer", make(MLP).spec, "torch.ddp", "tf.towers") is not None  # other schedules still map
    # a Keras built-in is never mapped onto a rule written out under native warmup_cosine: semantics tf would swap
    # its CosineDecay (a step late) for the curve, mapping away a lateness theory does not name for that pair
    own = f"{Path(__file__).parent / 'plugins' / 'mapping_tf.py'}:own_adamw"
    from parity_tests.running.registry import resolve

    resolve(own, "impls")  # a TensorFlow plugin (its framework decides whether it can run CosineDecay)
    assert mapping_changes("optimizer", spec, "tf.towers", own, "none") is None
    # ... but where the plugin's rate is its own (own_schedule: it runs no CosineDecay), the lateness is predicted by
    # name, and the mapping onto the curve maps exactly that away (the residual then judges the rest)
    assert mapping_changes("optimizer", spec, "tf.towers", own, "none", own_schedule=[own]) == {
        "optimizer.semantics": "tf", "optimizer.keras_rounding": "none"}
    assert mapping_changes("optimizer", make(MLP).spec, "tf.towers", own, "none") == {
        "optimizer.semantics": "tf", "optimizer.keras_rounding": "none"}  # without a schedule it maps as before


def test_warmup_cosine_lateness_is_predicted_where_exactly_one_side_runs_cosine_decay():
    # between two TensorFlow sides too: a Keras optimizer (CosineDecay, a step late) against a plugin whose rate is its
    # own code's (own_schedule: it made no Keras optimizer, whether or not its written-out rule is Keras' class)
    from parity_tests.running.registry import resolve

    spec = make(MLP, optimizer=dict(COSINE, semantics="native")).spec
    own = f"{Path(__file__).parent / 'plugins' / 'mapping_tf.py'}:own_adamw"
    resolve(own, "impls")
    late = lambda pred: [d for d in pred.differences if "one step late" in d.text]  # noqa: E731
    for a, b in (("tf.towers", own), (own, "tf.single")):
        found = late(predict(spec, a, b, own_schedule=[own]))
        assert len(found) == 1 and found[0].expected and f"{own} computes its own rate" in found[0].text, (a, b)
        assert late(predict(spec, a, b, own=[own])), (a, b)          # its rule found its own: its rate too
        assert not late(predict(spec, a, b))                         # a plugin with a Keras optimizer: both late
        assert any("both sides run it" in x for x in predict(spec, a, b).absent)
    # a TensorFlow rule written out against torch: neither runs CosineDecay (before: nothing said either way)
    pred = predict(spec, own, "torch.ddp", own_schedule=[own])
    assert not late(pred) and any("neither side runs it" in x for x in pred.absent)
    # under tf or torch semantics every side computes the curve, a plugin's own or not
    for sem in ("tf", "torch"):
        s = make(MLP, optimizer=dict(COSINE, semantics=sem)).spec
        assert not late(predict(s, "tf.towers", own, own_schedule=[own]))


def test_theory_refuses_to_guess_what_an_undeclared_builtin_is():
    """Theory reads what engines declare (protocol.engine); a built-in's name that nothing declared in
    the process is a LookupError, never a silent guess (a non-parallel, non-Keras engine)."""
    import subprocess
    import sys

    code = ("from parity_tests.judging.theory import is_parallel\n"
            "try:\n    is_parallel('tf.towers')\nexcept LookupError as e:\n    print('refused:', e)\n"
            "from parity_tests.running import registry\nregistry.builtin_names()\n"
            "print(is_parallel('tf.towers'), is_parallel('tf.single'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_DEADLINE)
    assert out.returncode == 0, out.stderr[-2000:]
    first, second = out.stdout.strip().splitlines()
    assert first.startswith("refused: tf.towers: no declaration") and second == "True False"


def test_theory_reads_the_declaration_it_is_handed_not_the_registry():
    """The session hands theory each side's resolved EngineSpec (``theory.engine`` once per name): what that
    declaration says decides, with nothing declared under its name (``mine.py:fn`` never was)."""
    from parity_tests.judging.theory import UNDECLARED, engine
    from parity_tests.protocol.engine import EngineSpec, declared
    from parity_tests.running import registry

    uneven = make(MLP, data__global_batch=50).spec  # 50 rows over the case's devices: uneven shards
    ref = registry.resolve("torch.ddp").spec
    assert engine(ref) is ref and declared("mine.py:fn") is None
    one = EngineSpec("mine.py:fn", "plugin", "torch", parallel=False, dtypes=("float32",))
    split = EngineSpec("mine.py:fn", "plugin", "torch", parallel=True, dtypes=("float32",))
    assert any("uneven shards" in d.text for d in predict(uneven, ref, one).differences)
    assert not any("uneven shards" in d.text for d in predict(uneven, ref, split).differences)
    assert mapping_changes("weighting", uneven, ref, one) == {"parallel.weighting": "by_size"}
    assert mapping_changes("weighting", uneven, ref, split) is None
    # a name nothing declared: theory assumes nothing of it (one device, its framework the name's first part)
    assumed = engine("mine.py:fn")
    assert (assumed.kind, assumed.framework, assumed.parallel) == (UNDECLARED, "mine", False)
