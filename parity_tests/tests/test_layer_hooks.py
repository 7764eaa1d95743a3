"""Activations without writing anything: layer hooks for plugins (issue 10, point 2).

A torch plugin built from ``nn.Sequential`` under DDP and a TensorFlow plugin built from a Keras
``Sequential`` (plugins/layer_hooks_torch.py, plugins/layer_hooks_tf.py) pass no ``activations=``;
at the captured step the tool records every leaf layer's output itself (``torchref.plugin.LayerHooks``,
``tfpar.plugin.KerasLayerHooks``), groups them into layers the same way on both sides
(``parity_tests.running.plugins.layer_outputs``) and the stage chain names the layer where a seeded
forward bug (``sigmoid`` instead of ``tanh`` after the second dense layer) lives.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from parity_tests.judging.localise import _gap
from parity_tests.running.harness import run_impl
from parity_tests.running.plugins import device_arrays, hooks_line_up, layer_outputs
from parity_tests.session.comparison import compare_case
from parity_tests.tests.helpers import MLP, make

PLUGINS = Path(__file__).parent / "plugins"
TORCH = f"{PLUGINS / 'layer_hooks_torch.py'}"
TF = f"{PLUGINS / 'layer_hooks_tf.py'}"
# dense 6 tanh -> dense 6 tanh -> dense 1: layer 1's activation is where the bug is seeded; 16 rows
# over 4 devices (4 each), 2 steps, float64
CASE = make(MLP, model__layers=[{"type": "dense", "units": 6, "activation": "tanh"},
                                {"type": "dense", "units": 6, "activation": "tanh"},
                                {"type": "dense", "units": 1}],
            data__global_batch=16, steps=2, optimizer={"name": "sgd", "lr": 0.1})


def _forward(where: dict) -> tuple:
    return where["first_bad_step"], where["stage"], _case_layer(where["name"]), where["device"]


def _case_layer(name: str) -> str:
    """``layer 1 dense`` of ``layer 1 dense (module.2 Linear / sequential_3/dense_7 Dense)``: the hooks' own names
    (Keras numbers its layer names per process) are checked by :func:`_own`."""
    return name.split(" (", 1)[0]


def _own(name: str, *kinds: str) -> list[str]:
    """The plugins' own names in ``name``, reference first, each checked to end in its layer class."""
    own = name.split(" (", 1)[1].rstrip(")").split(" / ")
    assert [o.rsplit(" ", 1)[1] for o in own] == list(kinds), name
    return own


def test_leaf_outputs_group_into_layers_as_keras_folds_activations():
    """A layer starts at a leaf that holds weights or changes the shape; weightless, shape-keeping leaves join it."""
    def leaf(name, weights, kept):
        return {"name": name, "weights": weights, "kept": kept, "out": np.full(1, float(len(name)))}

    leaves = [leaf("relu", False, True),        # before any layer: a layer of its own
              leaf("conv", True, False), leaf("relu1", False, True), leaf("pool", False, False),
              leaf("flatten_", False, False), leaf("dropout_", False, True),
              leaf("linear", True, False), leaf("tanh", False, True), leaf("bn", True, True)]
    got = layer_outputs(leaves)
    assert {k: float(v[0]) for k, v in got.items()} == {"0": 4.0, "1": 5.0, "2": 4.0, "3": 8.0, "4": 4.0, "5": 2.0}
    # code between two layers (torch.relu in a forward): layer 0 is what layer 1 received
    fed = [{**leaf("l0", True, False), "fed": False, "in": None},
           {**leaf("l1", True, False), "fed": False, "in": np.full(1, -1.0)}]
    assert {k: float(v[0]) for k, v in layer_outputs(fed).items()} == {"0": -1.0, "1": 2.0}
    fed[1]["fed"] = True  # fed the very tensor l0 returned: l0's own output
    assert {k: float(v[0]) for k, v in layer_outputs(fed).items()} == {"0": 2.0, "1": 2.0}


def test_hook_activations_are_kept_apart_where_the_case_numbers_layers_otherwise():
    """A plugin applies the case's dropout masks in code: its numbering would run one short of the case's. A
    standalone activation joins the layer before it; a residual's add is code and its inner layers have paths.
    There the hooks' layers are ``hooks.<i>``: compared with another plugin's hooks, never with a built-in's."""
    dropout = make(MLP, model__layers=[{"type": "dense", "units": 6, "activation": "relu"},
                                       {"type": "dropout", "rate": 0.5}, {"type": "dense", "units": 1}])
    activation = make(MLP, model__layers=[{"type": "dense", "units": 6}, {"type": "activation", "fn": "relu"},
                                          {"type": "dense", "units": 1}])
    residual = make(MLP, model__layers=[{"type": "dense", "units": 6},
                                        {"type": "residual", "body": [{"type": "dense", "units": 6}]},
                                        {"type": "dense", "units": 1}])
    assert hooks_line_up(CASE.spec) and not any(hooks_line_up(c.spec) for c in (dropout, activation, residual))
    leaves = [{"name": "module.l0", "kind": "Linear", "weights": True, "kept": False, "fed": False, "in": None,
               "out": np.ones((4, 6))}]
    device = [{"grads": None, "acts": None, "losses": None, "inputs": None, "leaves": leaves}]
    got = device_arrays(device, 1, "p", {})
    assert sorted(got) == ["device/act/0", "device/name/0", "device/sizes", "device/step"]
    assert str(got["device/name/0"]) == "module.l0 Linear"
    assert sorted(device_arrays(device, 1, "p", {}, hooks=False)) == \
        ["device/act/hooks.0", "device/name/hooks.0", "device/sizes", "device/step"]


def test_torch_hooks_keep_the_first_training_pass_in_tensorflow_layout():
    """Evaluation under no_grad and a loss module start no pass; a second forward is not kept; images
    come out channels-last and ``nn.Flatten`` of an image in Keras' order (expected values from torch itself)."""
    import torch
    from torch.nn.modules import module as nn_module

    from torchref.plugin import LayerHooks

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(12, 1)).double()
    x = torch.randn(4, 2, 4, 4, dtype=torch.float64)
    before = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))
    hooks = LayerHooks()
    hooks.install()
    hooks.armed = True
    try:
        with torch.no_grad():
            net(x)
        assert hooks.leaves is None
        torch.nn.MSELoss()(net(x), torch.zeros(4, 1, dtype=torch.float64)).backward()
        net(2 * x)
    finally:
        hooks.remove()
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == before
    assert [leaf["name"] for leaf in hooks.leaves] == ["0", "1", "2", "3"]
    image = torch.relu(net[0](x)).detach().permute(0, 2, 3, 1)            # [4, 2, 2, 3] NHWC
    assert np.array_equal(hooks.leaves[1]["out"], image.numpy())
    assert np.array_equal(hooks.leaves[2]["out"], image.reshape(4, -1).numpy())
    assert np.array_equal(hooks.leaves[3]["out"], net(x).detach().numpy())
    assert list(layer_outputs(hooks.leaves)) == ["0", "1", "2"]             # conv+relu, flatten, linear
    assert np.array_equal(layer_outputs(hooks.leaves)["1"], image.reshape(4, -1).numpy())


def test_torch_hooks_see_an_activation_written_in_forward():
    """``torch.relu`` in a ``forward`` is no module: layer 0 is what the next ``Linear`` received (also when
    the activation works in place on the very tensor ``l0`` returned)."""
    import torch

    from torchref.plugin import LayerHooks

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l0, self.l1 = torch.nn.Linear(5, 10), torch.nn.Linear(10, 1)

        def forward(self, x):
            h = self.l0(x)
            return self.l1(torch.relu(h)) if self.copy else self.l1(torch.relu_(h))

    torch.manual_seed(0)
    net, x = Net().double(), torch.randn(6, 5, dtype=torch.float64)
    for copy in (True, False):  # torch.relu makes a new tensor; torch.relu_ changes l0's output in place
        net.copy = copy
        hooks = LayerHooks()
        hooks.install()
        hooks.armed = True
        try:
            net(x)
        finally:
            hooks.remove()
        got = layer_outputs(hooks.leaves)
        assert [leaf["name"] for leaf in hooks.leaves] == ["l0", "l1"]
        assert np.array_equal(got["0"], torch.relu(net.l0(x)).detach().numpy()), copy
        assert np.array_equal(got["1"], net(x).detach().numpy()), copy


@pytest.mark.parametrize("bad", ["sigmoid_layer_1", "sigmoid_layer_1_function"])
def test_a_forward_bug_in_keras_towers_is_named_at_its_layer(pool, bad):
    """Eager towers and towers in a tf.function (run eagerly for the captured step only) alike."""
    import keras
    import tensorflow as tf

    call = keras.Layer.__call__
    where = compare_case(CASE, [f"{TORCH}:good", f"{TF}:{bad}"]).pairs[0].localisation
    # the bug changes layer 1's output by O(0.1) (sigmoid(h) - tanh(h) is 0.5 at h = 0) while
    # layer 0 agrees to rounding (~1e-16); the float64 bound is 1e-10
    assert _forward(where) == (1, "forward", "layer 1 dense", None)
    assert _own(where["name"], "Linear", "Dense")[0] == "module.2 Linear"  # nn.Sequential under DDP
    assert "every device" in where["explanation"] and "while layers up to 0 (dense) agree" in where["explanation"]
    assert keras.Layer.__call__ is call and not tf.config.functions_run_eagerly()  # left as found


def test_a_forward_bug_in_an_nn_sequential_is_named_at_its_layer(pool):
    where = compare_case(CASE, [f"{TF}:good", f"{TORCH}:sigmoid_layer_1"]).pairs[0].localisation
    # the case's path and type, then what each side's hooks call it (reference first)
    assert _forward(where) == (1, "forward", "layer 1 dense", None) and where["layer"] == "1 dense"
    own = _own(where["name"], "Dense", "Linear")
    assert own[1] == "module.2 Linear" and own[0].count("/") == 1  # the Keras layer path: model/layer


def test_a_bug_on_one_tower_names_that_tower(pool):
    """Passes are filed under the tower whose device holds the model's output."""
    where = compare_case(CASE, [f"{TORCH}:good", f"{TF}:sigmoid_layer_1_tower_2"]).pairs[0].localisation
    assert _forward(where) == (1, "forward", "layer 1 dense", 2)


def test_activations_given_by_hand_are_not_overridden(pool):
    """``by_hand`` passes ``{"logits": output}``: that is all it reports, and it is the model's output,
    which the hooks of the same model (``good``) record as layer 2."""
    captured = dataclasses.replace(CASE, capture=1)
    for side in (TORCH, TF):
        hand, auto = run_impl(captured, f"{side}:by_hand"), run_impl(captured, f"{side}:good")
        assert sorted(k for k in hand if k.startswith("device/act/")) == ["device/act/logits"], side
        assert sorted(k for k in auto if k.startswith("device/act/")) == [f"device/act/{i}" for i in range(3)], side
        assert hand["device/act/logits"].shape == (16, 1)
        assert _gap(hand["device/act/logits"], auto["device/act/2"]) == 0.0, side  # same code, same numbers


def test_mirrored_strategy_replicas_are_filed_under_their_towers(pool):
    """Step 1 runs as a graph, the captured step 2 eagerly (replicas on their threads): each replica's
    layer outputs land on its tower, as the eager towers record them. Float64, one SGD step from the
    same weights, the same arithmetic in another order: rounding of ~1e-16; a replica filed under the
    wrong tower would differ by O(1) (other rows)."""
    captured = dataclasses.replace(CASE, capture=2)
    towers, mirrored = run_impl(captured, f"{TF}:good"), run_impl(captured, f"{TF}:mirrored")
    assert mirrored["device/sizes"].tolist() == [4, 4, 4, 4]
    for i in range(3):
        assert _gap(towers[f"device/act/{i}"], mirrored[f"device/act/{i}"]) < 1e-12, i


def test_a_plugin_with_its_activation_in_forward_lines_up_with_the_builtins(pool):
    """``ddp_no_grads`` writes ``self.l1(torch.relu(self.l0(x)))`` and passes no activations: its layers 0
    and 1 are the built-in ``tf.towers``' (``dense relu``, ``dense``) and agree to rounding (float64,
    ~1e-16 against the bound 1e-10), so the chain goes on to the real bug (every rank's gradient 4x)."""
    case = make(MLP, steps=2, optimizer={"name": "sgd", "lr": 0.01, "semantics": "tf"})
    where = compare_case(case, ["tf.towers", f"{PLUGINS / 'ddp_no_grads.py'}:train"]).pairs[0].localisation
    chain = {c["stage"]: c for c in where["chain"]}
    assert chain["forward"]["name"] == "layer 1 dense (module.l1 Linear)" and chain["forward"]["gap"] < 1e-12
    assert where["stage"] == "device_grads" and "forward agrees" in where["explanation"]


def test_torch_hooks_count_every_micro_batch_the_step_backpropagates():
    """Gradient accumulation: the step's k backpropagated passes are the rows the rank read, merged in call order
    (issue 35: the hooks kept the first micro-batch, and the rank was said to read 8 rows of 16); a forward that
    nothing differentiates (a logged evaluation with autograd on) is no micro-batch."""
    import torch

    from torchref.plugin import LayerHooks

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1)).double()
    x = torch.randn(8, 5, dtype=torch.float64)
    hooks = LayerHooks()
    hooks.install()
    hooks.armed = True
    try:
        for xj in (x[:4], x[4:]):  # two micro-batches, each backpropagated
            (net(xj).sum() / 2).backward()
        net(x[:2])  # looked at, never differentiated
    finally:
        hooks.remove()
    assert len(hooks.passes) == 3
    assert [leaf["name"] for leaf in hooks.leaves] == ["0", "1", "2"]
    assert np.array_equal(hooks.leaves[0]["in"], x.numpy())  # the 8 rows read, in order
    assert np.array_equal(hooks.leaves[2]["out"], net(x).detach().numpy())
    assert sum(len(v) for v in [layer_outputs(hooks.leaves)["0"]]) == 8


def test_hook_layers_take_the_case_layer_they_are():
    """A plugin that flattens (or pools) in code has no module there: its first ``Linear`` is the case's layer 1
    (after ``flatten``), not layer 0 (issue 35: a where-line named ``layer 0 flatten`` for the hooks' first
    dense). Keras' ``Flatten`` layer is the case's 0; a layer with parameters the hooks never saw: no numbering."""
    from parity_tests.contract.model import validate_model
    from parity_tests.running.plugins import case_numbering

    def model(shape, layers):
        return {"model": validate_model({"input_shape": shape, "layers": layers, "loss": "mse"})[0]}

    spec = model([2, 3], [{"type": "flatten"}, {"type": "dense", "units": 4, "activation": "relu"},
                          {"type": "dense", "units": 1}])
    torch_side = {"0": np.zeros((5, 4)), "1": np.zeros((5, 1))}
    assert case_numbering(spec, torch_side, {"0": True, "1": True}) == {"0": "1", "1": "2"}
    keras_side = {"0": np.zeros((5, 6)), "1": np.zeros((5, 4)), "2": np.zeros((5, 1))}
    assert case_numbering(spec, keras_side, {"0": False, "1": True, "2": True}) == {"0": "0", "1": "1", "2": "2"}
    assert case_numbering(spec, {"0": np.zeros((5, 1))}, {"0": True}) is None  # dense 4 unseen
    cnn = model([4, 4, 1], [{"type": "conv2d", "filters": 2, "kernel_size": 3, "padding": "same"},
                            {"type": "max_pool2d", "pool_size": 2}, {"type": "flatten"}, {"type": "dense", "units": 1}])
    # Conv2d, pooled and flattened in code, then Linear: the conv's layer is what Linear received (flatten's output)
    assert case_numbering(cnn, {"0": np.zeros((5, 8)), "1": np.zeros((5, 1))}, {"0": True, "1": True}) == \
        {"0": "2", "1": "3"}
    leaves = [{"name": "module.0", "kind": "Linear", "weights": True, "kept": False, "fed": True, "in": np.ones((4, 6)),
               "out": np.ones((4, 4))},
              {"name": "module.1", "kind": "Linear", "weights": True, "kept": False, "fed": True, "in": np.ones((4, 4)),
               "out": np.ones((4, 1))}]
    device = [{"grads": None, "acts": None, "losses": None, "inputs": None, "leaves": leaves}]
    got = device_arrays(device, 1, "p", {}, spec=spec)
    assert sorted(k for k in got if k.startswith("device/act/")) == ["device/act/1", "device/act/2"]
    assert str(got["device/name/1"]) == "module.0 Linear" and got["device/rows"].shape == (4, 6)


def test_keras_hooks_merge_a_towers_micro_batches():
    """Under ``parallel.accumulate: k`` a tower's first k passes are its micro-batches: their rows merged in call
    order (rows read, as ``tf.towers`` records them); without accumulation a tower's first pass alone."""
    from tfpar.plugin import KerasLayerHooks

    def pass_(rows):
        return [{"name": "sequential/dense", "kind": "Dense", "weights": True, "kept": False, "fed": False,
                 "in": rows, "out": rows * 2.0}]

    rows = [np.full((4, 5), float(i)) for i in range(4)]
    devices = ["/device:CPU:0", "/device:CPU:1"]
    hooks = KerasLayerHooks()
    hooks.passes = [(devices[0], pass_(rows[0])), (devices[1], pass_(rows[1])),
                    (devices[0], pass_(rows[2])), (devices[1], pass_(rows[3]))]
    merged = hooks.by_tower(devices, micro=2)
    assert [m[0]["in"].shape for m in merged] == [(8, 5), (8, 5)]
    assert np.array_equal(merged[1][0]["out"], 2.0 * np.concatenate([rows[1], rows[3]]))
    assert [m[0]["in"].shape for m in hooks.by_tower(devices)] == [(4, 5), (4, 5)]  # one micro-batch: the first
