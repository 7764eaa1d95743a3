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
