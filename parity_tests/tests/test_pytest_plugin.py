"""The pytest plugin (entry point ``pytest11``) and ``assert_parity``, as a user's test suite sees them.

The user's files run in a fresh pytest process (pytester), where nothing of
this repository's ``conftest.py`` is loaded: the fixture and the hypothesis
profiles come from the installed plugin alone.
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

from parity_tests.tests.processes import HANG_DEADLINE

pytest_plugins = ["pytester"]

# a torch DDP port of any dense case the strategies draw with these restrictions (mse, sgd, torch semantics)
USER_DDP = '''
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torchref

ACTIVATIONS = {"none": lambda h: h, "relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}
LR_FACTOR = 1.0


class Dense(torch.nn.Module):
    def __init__(self, run):
        super().__init__()
        self.layers = run.spec["model"]["layers"]
        self.p = torch.nn.ParameterDict(
            {k.replace(".", "_"): torch.nn.Parameter(torch.as_tensor(run.to_torch(v))) for k, v in run.initial.items()})

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = x @ self.p[f"{i}_kernel"].T
            if f"{i}_bias" in self.p:
                x = x + self.p[f"{i}_bias"]
            x = ACTIVATIONS[layer.get("activation", "none")](x)
        return x


@torchref.plugin.distributed(dtypes=("float32", "float64"))
def ddp(run):
    net = Dense(run).to(run.torch_dtype)
    model = DDP(net, process_group=run.group)
    opt = torch.optim.SGD(model.parameters(), lr=LR_FACTOR * run.spec["optimizer"]["lr"])
    params = lambda: {k: run.to_tf(net.p[k.replace(".", "_")]) for k in run.initial}
    run.begin(params())
    for x, y in run.batches():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(torch.as_tensor(x)), torch.as_tensor(y))
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, group=run.group)
        run.record(logged / run.world_size, params())
'''

USER_TESTS = '''
from hypothesis import given, settings

from parity_tests import assert_parity
from parity_tests.contract.case import case_from_dict
from parity_tests.strategies import dense_cases, device_counts

CASES = dense_cases(devices=device_counts(2, 3), dtypes=["float64"], losses=["mse"], combines=["grad_mean"],
                    shards=["contiguous"], weightings=["equal"], optimizer_names=["sgd"], semantics=["torch"],
                    even_shards=True, max_batch=12, max_steps=2)

MLP = {
    "schema": "parity-case/1", "name": "user-mlp", "dtype": "float64",
    "model": {"input_shape": [3], "layers": [{"type": "dense", "units": 4, "activation": "tanh"},
                                            {"type": "dense", "units": 1}], "loss": "mse"},
    "init": {"seed": 1, "kind": "normal", "stddev": 0.5},
    "data": {"generator": "gaussian", "seed": 2, "global_batch": 8},
    "optimizer": {"name": "sgd", "lr": 0.1, "semantics": "torch"},
    "parallel": {"devices": 2},
    "steps": 2,
}


def test_the_plugin_registered_the_profiles():
    assert settings.get_profile("tfpar-ci").max_examples == 12
    assert settings.get_profile("tfpar-thorough").max_examples == 200


@settings(max_examples=2, deadline=None, database=None)
@given(CASES)
def test_my_ddp_matches_the_towers(tfpar_pool, case):
    result = assert_parity(case, ["tf.towers", "user_ddp.py:ddp"])
    assert result.parity and tfpar_pool.size == 8


def test_my_buggy_ddp_is_caught(tfpar_pool):
    assert_parity(case_from_dict(MLP), ["tf.towers", "buggy_ddp.py:ddp"])
'''


def test_the_plugin_is_an_installed_entry_point_and_imports_no_framework():
    found = [ep.value for ep in metadata.entry_points(group="pytest11") if ep.name == "tfpar"]
    assert found == ["parity_tests.testing.pytest_plugin"], "reinstall: pip install -e . (pyproject's pytest11 entry point)"
    code = ("import sys, parity_tests.testing.pytest_plugin as p, parity_tests.testing.assertions; "
            "assert hasattr(p, 'tfpar_pool'); "
            "print(sorted(m for m in ('tensorflow', 'torch', 'keras') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_DEADLINE, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_users_suite_with_the_plugin(pytester, monkeypatch):
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    pytester.makepyfile(user_ddp=USER_DDP, buggy_ddp=USER_DDP.replace("LR_FACTOR = 1.0", "LR_FACTOR = 2.0"),
                        test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "test_user.py", timeout=600)
    out = result.stdout.str()
    result.assert_outcomes(passed=2, failed=1)
    assert "FAILED test_user.py::test_my_buggy_ddp_is_caught" in out
    # the assert_close-style summary: the pair, the verdict, the step and the parameter, the differences, the bound
    assert "tf.towers vs buggy_ddp.py:ddp" in out and "divergence" in out
    assert "step 1, param 1.bias: Mismatched elements" in out
    assert "Greatest absolute difference" in out and "allowed" in out
    assert "def assert_parity" not in out  # its own frame is hidden from the traceback
    assert "verdict: DIVERGENCE" in out


# A user's own suite, unrelated to tfpar: Hypothesis' defaults must hold with the plugin installed
# (100 examples, a 200 ms deadline, every health check), whatever HYPOTHESIS_PROFILE says, since it
# is the user's variable, read only by their own conftest if they have one.
FOREIGN_TESTS = '''
from datetime import timedelta

from hypothesis import given, settings, strategies as st

CALLS = []


def test_the_plugin_is_loaded(request):
    assert request.config.pluginmanager.get_plugin("tfpar") is not None


@given(st.integers())
def test_a_property(x):
    CALLS.append(x)


def test_their_settings_are_their_own():
    s = settings()
    print(f"SEEN examples={len(CALLS)} max_examples={s.max_examples} deadline={s.deadline}"
          f" suppressed={list(s.suppress_health_check)}")
'''

# Hypothesis' documented pattern: a conftest registers profiles and loads the one HYPOTHESIS_PROFILE names
NIGHTLY_CONFTEST = '''
import os

from hypothesis import settings

settings.register_profile("nightly", max_examples=7)
settings.load_profile(os.getenv("HYPOTHESIS_PROFILE", "default"))
'''


def _seen(result) -> str:
    found = [ln[ln.index("SEEN "):] for ln in result.stdout.lines if "SEEN " in ln]  # after -q's dots
    assert len(found) == 1, result.stdout.str()[-3000:]
    return found[0]


def _without_the_plugin(pytester) -> str:
    """What the same user suite sees with the plugin disabled (``-p no:tfpar``): Hypothesis' own choice.

    Hypothesis' defaults are not one fixed set: where a ``CI`` variable is set it loads its
    built-in ``ci`` profile (no deadline, ``too_slow`` suppressed), as on the project's CI. The
    plugin must change nothing, so the expected line is the one this run prints, in the same
    environment; the plugin's own presence test fails there, which shows it really was off."""
    result = pytester.runpytest_subprocess("-q", "-s", "-p", "no:cacheprovider", "-p", "no:tfpar", "test_foreign.py",
                                           timeout=HANG_DEADLINE)
    result.assert_outcomes(passed=2, failed=1)
    assert "FAILED test_foreign.py::test_the_plugin_is_loaded" in result.stdout.str()
    return _seen(result)


@pytest.mark.parametrize("ci", ["", "true"], ids=["outside-ci", "in-ci"])
def test_a_foreign_given_test_keeps_hypothesis_defaults(pytester, monkeypatch, ci):
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("CI", raising=False)
    if ci:  # Hypothesis then loads its own built-in "ci" profile, with or without the plugin
        monkeypatch.setenv("CI", ci)
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "ci")  # loaded tfpar's 12-example profile when the plugin did
    pytester.makepyfile(test_foreign=FOREIGN_TESTS)
    result = pytester.runpytest_subprocess("-q", "-s", "-p", "no:cacheprovider", "test_foreign.py",
                                           timeout=HANG_DEADLINE)
    result.assert_outcomes(passed=3)
    seen = _seen(result)
    assert seen == _without_the_plugin(pytester)
    # and what that is, by Hypothesis' documentation (its settings docstring, "Built-in profiles")
    assert seen == ("SEEN examples=100 max_examples=100 deadline=None suppressed=[HealthCheck.too_slow]" if ci else
                    "SEEN examples=100 max_examples=100 deadline=0:00:00.200000 suppressed=[]")


def test_the_tfpar_profiles_are_chosen_with_hypothesis_own_option(pytester, monkeypatch):
    # the other direction: asked for, a tfpar profile does apply (12 examples, no deadline)
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    pytester.makepyfile(test_foreign=FOREIGN_TESTS)
    result = pytester.runpytest_subprocess("-q", "-s", "-p", "no:cacheprovider", "--hypothesis-profile",
                                           "tfpar-ci", "test_foreign.py", timeout=HANG_DEADLINE)
    result.assert_outcomes(passed=3)
    assert _seen(result).startswith("SEEN examples=12 max_examples=12 deadline=None suppressed=[")


def test_a_users_nightly_profile_is_their_own(pytester, monkeypatch):
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "nightly")  # "Profile 'nightly' is not registered" when the plugin loaded it
    pytester.makeconftest(NIGHTLY_CONFTEST)
    pytester.makepyfile(test_foreign=FOREIGN_TESTS)
    result = pytester.runpytest_subprocess("-q", "-s", "-p", "no:cacheprovider", "test_foreign.py",
                                           timeout=HANG_DEADLINE)
    result.assert_outcomes(passed=3)
    seen = _seen(result)
    assert seen.startswith("SEEN examples=7 max_examples=7 ")  # their profile, whatever else the environment sets
    assert seen == _without_the_plugin(pytester)


def test_the_plugin_is_loaded_beside_this_repos_conftest(request, pool, tfpar_pool):
    plugin = request.config.pluginmanager.get_plugin("tfpar")
    assert plugin is not None and plugin.__name__ == "parity_tests.testing.pytest_plugin"
    # the plugin's fixture and this repo's side by side, both the process-wide pool of torchref.pool.get_pool
    assert type(tfpar_pool) is type(pool) and tfpar_pool.size == pool.size == 8
