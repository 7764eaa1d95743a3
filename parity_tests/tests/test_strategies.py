"""The public strategies: arguments checked up front, generated cases as promised."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis.errors import InvalidArgument

from parity_tests.testing import strategies as S

BAD = [
    ("device_counts min 0", lambda: S.device_counts(0, 4)),
    ("device_counts min > max", lambda: S.device_counts(5, 4)),
    ("device_counts max 65", lambda: S.device_counts(1, 65)),
    ("widths max 0", lambda: S.widths(1, 0)),
    ("activations unknown", lambda: S.activations(["gelu"])),
    ("optimizers unknown name", lambda: S.optimizers(names=["lion"])),
    ("optimizers empty semantics", lambda: S.optimizers(semantics=[])),
    ("global_batches non-divisible at N=1", lambda: S.global_batches(1, divisible=False)),
    ("global_batches max below devices", lambda: S.global_batches(8, max_value=4)),
    ("dense_cases dtype", lambda: S.dense_cases(dtypes=["float16"])),
    ("dense_cases devices not a strategy", lambda: S.dense_cases(devices=4)),
    ("parallel_settings combine", lambda: S.parallel_settings(2, combines=["median"])),
]


@pytest.mark.parametrize("build", [b for _, b in BAD], ids=[i for i, _ in BAD])
def test_bad_arguments_raise_invalid_argument(build):
    with pytest.raises(InvalidArgument):
        build()


@given(S.dense_cases(devices=S.device_counts(2, 8), even_shards=False))
def test_uneven_cases_are_uneven(case):
    assert case.spec["data"]["global_batch"] % case.devices != 0


@given(S.dense_cases(even_shards=True, dtypes=["float32"]))
def test_even_cases_are_even_and_valid(case):
    assert case.spec["data"]["global_batch"] % case.devices == 0
    assert case.spec["dtype"] == "float32"
    assert case.x.shape[0] == case.spec["steps"] * case.spec["data"]["global_batch"]


@pytest.mark.parametrize("kind", list(S.NESTED_VOCABULARY))
def test_every_nested_vocabulary_entry_is_drawn_into_a_valid_case(kind):
    """Each entry of the vocabulary is reachable and gives cases the contract accepts (nested_cases validates
    every case it returns), ending in its dense head. (Found without shrinking: the search is what is tested.)"""
    from hypothesis import HealthCheck, Phase, find, settings
    from hypothesis import strategies as st

    from parity_tests.contract.model import LAYER_TYPES
    from parity_tests.contract.paths import layer_paths

    assert kind in LAYER_TYPES

    def types(case):
        return {layer["type"] for _, layer in layer_paths(case.spec["model"]["layers"])}

    found = find(S.nested_cases(devices=st.just(1), vocabulary=[kind]), lambda case: kind in types(case),
                 settings=settings(max_examples=500, database=None, phases=[Phase.generate],
                                   suppress_health_check=list(HealthCheck)))
    assert kind in types(found) and found.spec["model"]["layers"][-1]["type"] == "dense"


def test_nested_arguments_are_checked():
    with pytest.raises(InvalidArgument, match="vocabulary"):
        S.nested_layer_lists([4], vocabulary=["dense", "attention_v9"])
    with pytest.raises(InvalidArgument, match="max_layers"):
        S.nested_layer_lists([4], max_layers=0)
    with pytest.raises(InvalidArgument, match="devices"):
        S.nested_cases(devices=3)
    with pytest.raises(InvalidArgument, match="shapes"):
        S.nested_cases(shapes=[4])
    with pytest.raises(InvalidArgument, match="vocabulary"):
        S.nested_token_cases(vocabulary=["embedding_v2"])
