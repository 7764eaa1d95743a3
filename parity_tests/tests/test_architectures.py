"""The real architectures of ``examples/architectures/``: parameter counts, names and the files' builders.

Each expected count is written out here from the architecture's own formula (the layer sizes of
the reference implementation named in ``examples/architectures/README.md``), never computed by the
code under test; the count under test is ``contract.specs.param_specs`` of the validated model, the
trainable parameters (batch-norm moving statistics are state, not parameters, in both frameworks'
counts). Where the literature gives a figure it is checked too: ResNet-20 0.27 M (He et al. 2016,
table 6), ResNet-18 for CIFAR 11,173,962 (kuangliu/pytorch-cifar), GPT-2 small 124,439,808
(Hugging Face ``GPT2Model``), nanoGPT-style 29.5 M (issue 27).

The ResNets and the ViT are validated as whole cases (data and initial weights drawn); the two GPTs
by their ``model`` section only (``contract.model.validate_model``, the validator ``case_from_dict``
calls), because a whole GPT-2 case draws 124 M float64 initial values (1 GB) the count does not need.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from parity_tests.contract.case import load_case
from parity_tests.contract.model import validate_model
from parity_tests.contract.specs import param_specs
from parity_tests.reporting.architectures import FULL_SIZE

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "architectures"


def _trainable(input_shape, layers) -> dict[str, tuple[int, ...]]:
    return {s.name: s.shape for s in param_specs(input_shape, layers) if s.trainable}


def _count(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes.values())


def _case_specs(name: str) -> dict[str, tuple[int, ...]]:
    case = load_case(EXAMPLES / name / "case.json")
    return _trainable(case.spec["model"]["input_shape"], case.spec["model"]["layers"])


def _model_specs(name: str) -> dict[str, tuple[int, ...]]:
    raw = json.loads((EXAMPLES / name / "case.json").read_text())
    model, in_shape, _ = validate_model(raw["model"])
    return _trainable(in_shape, model["layers"])


def _resnet_a_count(n: int) -> int:
    """ResNet-(6n+2), option A: no conv bias, BN gamma+beta per channel, dense 64 -> 10."""
    stem = 3 * 3 * 3 * 16 + 2 * 16
    stage1 = 2 * n * (3 * 3 * 16 * 16) + 2 * n * 2 * 16
    stage2 = 3 * 3 * 16 * 32 + (2 * n - 1) * (3 * 3 * 32 * 32) + 2 * n * 2 * 32
    stage3 = 3 * 3 * 32 * 64 + (2 * n - 1) * (3 * 3 * 64 * 64) + 2 * n * 2 * 64
    head = 64 * 10 + 10
    return stem + stage1 + stage2 + stage3 + head


def test_resnet20_has_the_papers_parameter_count():
    specs = _case_specs("resnet20")
    assert _resnet_a_count(3) == 269_722  # the written-out formula agrees with the usual 0.27 M
    assert _count(specs) == 269_722
    # option A shortcuts hold no parameters: only bodies, stem and head do
    assert not [k for k in specs if ".shortcut." in k]
    # stage 2's first block (layer 4) and a repeated block of stage 3 (layer 7, repetition 1)
    assert specs["4.body.0.kernel"] == (3, 3, 16, 32)
    assert specs["7.1.0.body.3.kernel"] == (3, 3, 64, 64)
    assert specs["7.1.0.body.4.gamma"] == (64,)


def test_resnet18_has_kuangliu_s_parameter_count():
    specs = _case_specs("resnet18")
    stem = 3 * 3 * 3 * 64 + 2 * 64
    widths = (64, 128, 256, 512)
    blocks = 0
    w_in = 64
    for w in widths:
        first = 3 * 3 * w_in * w + 2 * w + 3 * 3 * w * w + 2 * w          # conv-BN-conv-BN
        projection = (1 * 1 * w_in * w + 2 * w) if w != w_in else 0           # 1x1 conv + BN
        second = 2 * (3 * 3 * w * w + 2 * w)
        blocks += first + projection + second
        w_in = w
    head = 512 * 10 + 10
    expected = stem + blocks + head
    assert expected == 11_173_962
    assert _count(specs) == expected
    assert specs["4.shortcut.0.kernel"] == (1, 1, 64, 128)
    assert specs["4.shortcut.1.gamma"] == (128,)


def test_vit_tiny_parameter_count():
    specs = _case_specs("vit-tiny")
    d, mlp, tokens, depth = 192, 768, (32 // 4) ** 2, 12
    patch = 4 * 4 * 3 * d + d
    cls, pos = d, (tokens + 1) * d
    block = (2 * d                       # LN
             + 3 * (d * d + d)           # q, k, v: [D, H, dk] kernels, [H, dk] biases
             + (d * d + d)               # o: [H, dv, D] kernel, [D] bias
             + 2 * d                     # LN
             + (d * mlp + mlp) + (mlp * d + d))
    head = 2 * d + d * 10 + 10           # final LN, dense
    expected = patch + cls + pos + depth * block + head
    assert expected == 5_362_762
    assert _count(specs) == expected
    assert specs["4.11.0.body.1.q.kernel"] == (192, 3, 64)
    assert specs["4.11.0.body.1.o.kernel"] == (3, 64, 192)
    assert specs["2.token"] == (1, 192) and specs["3.embeddings"] == (65, 192)


def _gpt_count(vocab: int, context: int, d: int, depth: int) -> int:
    block = 2 * d + 4 * (d * d + d) + 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return vocab * d + context * d + depth * block + 2 * d  # tied logits: no output matrix


def test_gpt_29m_parameter_count():
    specs = _model_specs("gpt-29m")
    expected = _gpt_count(8192, 256, 512, 8)
    assert expected == 29_545_472
    assert _count(specs) == expected
    assert specs["0.embeddings"] == (8192, 512) and specs["1.embeddings"] == (256, 512)
    assert specs["2.7.0.body.1.k.kernel"] == (512, 8, 64)
    assert specs["2.7.1.body.1.kernel"] == (512, 2048)
    assert not [k for k in specs if k.startswith("4.")]  # tied_logits has no parameters of its own


def test_gpt2_small_parameter_count():
    specs = _model_specs("gpt2-small")
    expected = _gpt_count(50257, 1024, 768, 12)
    assert expected == 124_439_808
    assert _count(specs) == expected


@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_case_file_is_its_builders_output(name):
    """Each file is what ``examples/architectures/write_cases.py`` writes (edit the builder, not the file)."""
    assert json.loads((EXAMPLES / name / "case.json").read_text()) == FULL_SIZE[name]
    assert f"`{name}/case.json`" in (EXAMPLES / "README.md").read_text()
