"""The bring-your-own-code examples of ``examples/byo/``: each pair at parity on 1, 2, 4 and 8 devices.

Every example is a user's own TensorFlow tower program (and, for two of them,
the user's own torch DDP port) run as plugins; float64 cases, so the 1e-10
float64 bound decides. The commands in ``examples/byo/README.md`` are the ones
run here; one of them through ``tfpar``'s ``main``, as typed.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from parity_tests.contract.case import load_case
from parity_tests.session.comparison import compare_case

ROOT = Path(__file__).resolve().parents[2]
BYO = ROOT / "examples" / "byo"
DEVICES = (1, 2, 4, 8)

# example folder -> the implementations compared (the first is the reference), as in the README
EXAMPLES = {
    "poly-adam": [f"{BYO / 'poly-adam' / 'tf_graph.py'}:make_parallel",
                  f"{BYO / 'poly-adam' / 'torch_ddp.py'}:ddp", "torch.ddp"],
    "mlp": [f"{BYO / 'mlp' / 'tf_towers.py'}:towers", f"{BYO / 'mlp' / 'torch_ddp.py'}:ddp", "torch.ddp"],
    "keras-mirrored": [f"{BYO / 'keras-mirrored' / 'tf_mirrored.py'}:mirrored", "torch.ddp"],
}


def _verdicts(result) -> dict[str, str]:
    return {p.impl: p.verdict.status for p in result.pairs}


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_example_pair_is_at_parity(example, devices):
    case = load_case(BYO / example / "case.json")
    assert case.spec["dtype"] == "float64", "the examples are float64 so that the tight float64 bound decides"
    result = compare_case(case.replace(**{"parallel.devices": devices}), EXAMPLES[example])
    assert _verdicts(result) == {impl: "parity" for impl in EXAMPLES[example][1:]}, result.summary()
    assert result.parity, result.summary()
    for pair in result.pairs:
        assert pair.verdict.rule.startswith("float64"), pair.verdict.rule
        assert pair.verdict.gap <= 1e-12, result.summary()  # measured: 0 to 2e-15; the bound is 1e-10


@pytest.mark.usefixtures("pool")
def test_poly_adam_port_matches_one_global_mean_on_uneven_shards():
    """60 rows on 8 devices (8 or 7 each): the port's N/B-scaled sums still give the one global mean."""
    case = load_case(BYO / "poly-adam" / "case.json").replace(**{"parallel.devices": 8, "data.global_batch": 60})
    result = compare_case(case, EXAMPLES["poly-adam"])
    assert result.parity, result.summary()


@pytest.mark.usefixtures("pool")
def test_poly_adam_under_torch_semantics_maps_epsilon_the_other_way():
    """The same two plugins follow torch's Adam rule when the case asks for it (the TF side moves eps)."""
    case = load_case(BYO / "poly-adam" / "case.json").replace(**{"optimizer.semantics": "torch"})
    result = compare_case(case, EXAMPLES["poly-adam"])
    assert result.parity, result.summary()


@pytest.mark.usefixtures("pool")
def test_poly_adam_native_is_the_predicted_epsilon_difference():
    """Each framework's own Adam class: the tool predicts the epsilon placement, and finds it."""
    result = compare_case(load_case(BYO / "poly-adam" / "case-native.json"), EXAMPLES["poly-adam"])
    assert _verdicts(result) == {impl: "expected_difference" for impl in EXAMPLES["poly-adam"][1:]}, result.summary()
    for pair in result.pairs:
        assert any("epsilon placement" in e for e in pair.prediction.expected), pair.prediction
        assert 1e-10 < pair.verdict.gap < 1e-6, result.summary()  # measured: 4.6e-9


@pytest.mark.usefixtures("pool")
def test_poly_adam_as_written_diverges_through_float32_hyperparameters():
    """``AdamOptimizer(0.1)`` with Python floats: float32 betas, epsilon and beta^t in a float64 run."""
    case = load_case(BYO / "poly-adam" / "case.json").replace(**{"parallel.devices": 2})
    result = compare_case(case, ["torch.ddp", f"{BYO / 'poly-adam' / 'tf_graph.py'}:make_parallel_as_written"])
    (pair,) = result.pairs
    assert pair.verdict.status == "divergence", result.summary()
    assert pair.verdict.first_step == 1 and pair.verdict.key == "param/1.kernel", result.summary()
    assert 1e-8 < pair.verdict.gap < 1e-4, result.summary()  # measured: 2.4e-6 (4 devices)


def _readme_commands() -> dict[str, list[str]]:
    """The ``tfpar compare`` lines of ``examples/byo/README.md``, by the example folder they name."""
    text = (BYO / "README.md").read_text()
    found: dict[str, list[str]] = {}
    for line in re.findall(r"^tfpar compare .*$", text, flags=re.M):
        argv = shlex.split(line)
        found.setdefault(Path(argv[2]).parent.name + "/" + Path(argv[2]).name, argv)
    return found


def test_readme_commands_name_existing_cases_and_plugins():
    commands = _readme_commands()
    for example in EXAMPLES:
        assert f"{example}/case.json" in commands, f"examples/byo/README.md has no tfpar compare line for {example}"
    for key, argv in commands.items():
        assert (ROOT / argv[2]).is_file(), argv
        for impl in argv[argv.index("--impls") + 1].split(","):
            if ":" in impl:
                path, fn = impl.rsplit(":", 1)
                source = (ROOT / path).read_text()
                assert f"def {fn}(" in source, impl
                if key.endswith("/case.json"):  # each plugin file opens with the command that checks it
                    assert source.startswith(f'"""{shlex.join(argv)}\n'), path


def test_mlp_readme_command_exits_0(monkeypatch, capsys):
    """The README's command for the MLP example, as typed, from the repository root: its arguments
    through ``tfpar``'s ``main`` (the console script exits with what ``main`` returns, which
    ``test_cli.py`` checks through a real subprocess)."""
    from parity_tests.cli import main

    argv = _readme_commands()["mlp/case.json"]
    assert argv[0] == "tfpar"
    monkeypatch.chdir(ROOT)  # the README's paths are relative to the repository root
    capsys.readouterr()
    code = main(argv[1:])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "verdict: PARITY" in out.out
