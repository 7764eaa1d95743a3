"""``parity_tests.protocol.layouts``: canonical parameters in the layouts torch's own classes hold, by name.

Each conversion is checked against the torch class computing what the canonical parameter computes on the
TensorFlow side (``nn.Linear``, ``nn.Conv2d`` with groups, ``nn.Embedding``, ``nn.MultiheadAttention``'s
packed projections), and ``to_tf`` inverts ``to_torch`` exactly, numpy and torch tensors alike.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.contract.generators import draw_init
from parity_tests.contract.layouts import NamedLayouts, layout_of, to_tf_named, to_torch_named
from parity_tests.contract.model import validate_model
from parity_tests.contract.specs import param_specs

LAYERS = [
    {"type": "embedding", "input_dim": 7, "output_dim": 6},
    {"type": "residual", "body": [{"type": "attention", "num_heads": 2, "key_dim": 3, "semantics": "torch"},
                                  {"type": "dense", "units": 6}]},  # torch: the exact attention scale, as nn does
    {"type": "reshape", "shape": [2, 2, 6]},
    {"type": "depthwise_conv2d", "kernel_size": 2, "depth_multiplier": 2},
    {"type": "conv2d", "filters": 4, "kernel_size": 1},
]


class _Run(NamedLayouts):
    def __init__(self, spec):
        self.spec = spec

    _rank_to_torch = staticmethod(lambda a: "by rank")
    _rank_to_tf = staticmethod(lambda a: "by rank")


def _spec():
    model, _, _ = validate_model({"input_shape": [4], "layers": LAYERS, "loss": "mse"})
    return {"model": model}


def _params(spec):
    m = spec["model"]
    return draw_init(param_specs(m["input_shape"], m["layers"]), 0, "normal", 0.5)


def test_each_parameter_gets_its_layers_conversion():
    spec = _spec()
    kinds = {name: layout_of(spec, name)[0] for name in _params(spec)}
    assert kinds["0.embeddings"] == "none" and kinds["1.body.1.kernel"] == "dense"
    assert kinds["1.body.0.q.kernel"] == "heads_in" and kinds["1.body.0.o.kernel"] == "heads_out"
    assert kinds["1.body.0.k.bias"] == "heads_bias" and kinds["1.body.0.o.bias"] == "none"
    assert kinds["3.kernel"] == "depthwise" and kinds["4.kernel"] == "conv" and kinds["4.bias"] == "none"
    with pytest.raises(ValueError, match=r"^name: expected a canonical parameter name of this case .*got '9.kernel'$"):
        layout_of(spec, "9.kernel")


def test_the_torch_classes_compute_what_the_canonical_parameters_do():
    import tensorflow as tf
    import torch
    from torch import nn

    from tfpar.models import forward

    spec = _spec()
    params = _params(spec)
    run = _Run(spec)
    t = {k: torch.as_tensor(run.to_torch(v, name=k)) for k, v in params.items()}
    ids = np.array([[0, 3, 6, 2]])
    ref = forward(spec["model"]["layers"], {k: tf.constant(v) for k, v in params.items()}, tf.constant(ids))
    emb = nn.Embedding(7, 6, _weight=t["0.embeddings"])
    h = emb(torch.as_tensor(ids))
    mha = nn.MultiheadAttention(6, 2, batch_first=True, dtype=torch.float64)
    lin = nn.Linear(6, 6, dtype=torch.float64)
    dw = nn.Conv2d(6, 12, 2, groups=6, dtype=torch.float64)
    conv = nn.Conv2d(12, 4, 1, dtype=torch.float64)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([t[f"1.body.0.{n}.kernel"] for n in "qkv"]))
        mha.in_proj_bias.copy_(torch.cat([t[f"1.body.0.{n}.bias"] for n in "qkv"]))
        mha.out_proj.weight.copy_(t["1.body.0.o.kernel"])
        mha.out_proj.bias.copy_(t["1.body.0.o.bias"])
        lin.weight.copy_(t["1.body.1.kernel"])
        lin.bias.copy_(t["1.body.1.bias"])
        dw.weight.copy_(t["3.kernel"])
        dw.bias.copy_(t["3.bias"])
        conv.weight.copy_(t["4.kernel"])
        conv.bias.copy_(t["4.bias"])
        h = h + lin(mha(h, h, h, need_weights=False)[0])
        img = h.reshape(1, 2, 2, 6).permute(0, 3, 1, 2)  # NHWC -> NCHW
        out = conv(dw(img)).permute(0, 2, 3, 1)
    np.testing.assert_allclose(out.numpy(), np.asarray(ref), rtol=1e-12, atol=1e-13)


def test_to_tf_inverts_to_torch_for_numpy_and_tensors():
    import torch

    spec = _spec()
    run = _Run(spec)
    for name, v in _params(spec).items():
        conversion, shape = layout_of(spec, name)
        back = run.to_tf(run.to_torch(v, name=name), name=name)
        np.testing.assert_array_equal(back, v, err_msg=name)
        tensor = to_tf_named(to_torch_named(torch.as_tensor(v), conversion, shape), conversion, shape)
        np.testing.assert_array_equal(tensor.numpy(), v, err_msg=name)
    assert run.to_torch(np.ones((2, 3))) == "by rank" and run.to_tf(np.ones((2, 3))) == "by rank"


def test_an_external_models_arrays_take_a_layout_and_refuse_a_guess_by_rank():
    """An external model (no layers to read a name's layer from) is told each array's layout; without one, an
    array of 2 or more dimensions is refused in one line (a 2-D array is a dense kernel or a table alike); a
    case model keeps CONTRACT section 5's ``run.to_torch(a)`` by rank."""
    from parity_tests.contract.layouts import LayoutError

    class Run(NamedLayouts):
        def __init__(self, spec):
            self.spec = spec

        _rank_to_torch = staticmethod(lambda a: a.T)
        _rank_to_tf = staticmethod(lambda a: a.T)

    ext = Run({"model": {"external": "a GPT", "loss": "softmax_ce"}})
    k, conv, b = np.arange(6.0).reshape(2, 3), np.arange(24.0).reshape(1, 2, 3, 4), np.arange(3.0)
    assert ext.to_torch(k, layout="dense").shape == (3, 2) and np.array_equal(ext.to_tf(ext.to_torch(k, layout="dense"),
                                                                                          layout="dense"), k)
    assert ext.to_torch(k, layout="none") is k and ext.to_torch(conv, layout="conv").shape == (4, 3, 1, 2)
    assert np.array_equal(ext.to_tf(ext.to_torch(conv, layout="conv"), layout="conv"), conv)
    assert np.array_equal(ext.to_torch(b), b)  # 1-D: nothing to guess
    with pytest.raises(LayoutError, match=r"^layout: expected run\.to_torch\(a, layout=\.\.\.\) for an external model's"
                                          r" 2-D array: 'dense' .* got 'shape \[2, 3\]'$"):
        ext.to_torch(k)
    with pytest.raises(LayoutError, match=r"^layout: expected run\.to_tf\(a, layout=\.\.\.\) for an external model's 4-D"):
        ext.to_tf(conv)
    with pytest.raises(LayoutError, match=r"^layout: expected a 2-D array for layout 'dense', got 'shape \[3\]'$"):
        ext.to_torch(b, layout="dense")
    with pytest.raises(LayoutError, match=r"^layout: expected one of 'dense', 'conv', 'none', got 'table'$"):
        ext.to_torch(k, layout="table")
    with pytest.raises(LayoutError, match=r"^name: expected a case model's parameter name; an external model's"):
        ext.to_torch(k, name="0.kernel")
    case = Run(_spec())
    assert case.to_torch(k).shape == (3, 2)  # a case model: by rank, as CONTRACT section 5 says
    with pytest.raises(LayoutError, match="not both"):
        case.to_torch(k, name="0.embeddings", layout="none")
