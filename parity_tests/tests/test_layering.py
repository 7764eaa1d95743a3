"""The architecture's rules (docs/architecture.md): tfpar never imports torch, torchref never imports
TensorFlow, and the CLI's top level imports neither (spawned workers re-import the parent's main module);
no import goes up a layer or closes a circle; the engines import of ``parity_tests`` ``protocol`` alone."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from parity_tests.tests.processes import HANG_DEADLINE

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(("package", "forbidden"), [("tfpar", {"torch", "torchref"}), ("torchref", {"tensorflow", "keras", "tfpar"})])
def test_no_source_file_imports_the_other_framework(package, forbidden):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    bad = {str(f.relative_to(ROOT)): sorted(_imports(f) & forbidden) for f in files if _imports(f) & forbidden}
    assert not bad, bad


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [("tfpar", ["torch"]), ("torchref.run", ["tensorflow", "keras"]), ("parity_tests.cli", ["tensorflow", "torch"]),
     ("parity_tests.contract.case", ["tensorflow", "torch"])],
)
def test_importing_does_not_load_the_other_framework(module, forbidden):
    code = f"import sys, {module}; print(','.join(m for m in {forbidden!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_DEADLINE, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"importing {module} loaded {out.stdout.strip()}"


TORCH_FROM_THE_POOL = """
import sys
from parity_tests.contract.case import case_from_dict
from parity_tests.running.harness import run_impl
from parity_tests.tests.helpers import MLP

if __name__ == "__main__":
    case = case_from_dict(dict(MLP, steps=1, parallel=dict(MLP["parallel"], devices=2)))
    for impl in ("torch.ddp", "torch.single"):
        assert len(run_impl(case, impl)["loss"]) == 1
    print("torch" in sys.modules)
"""


def test_running_torch_implementations_does_not_import_torch_in_the_parent():
    """The ranks import the job (torchref.jobs.JobRef) where the forkserver imported torch: a cold
    ``tfpar compare`` does not pay torch's import (~2.4 s) in the process that imports TensorFlow."""
    out = subprocess.run([sys.executable, "-c", TORCH_FROM_THE_POOL], capture_output=True, text=True, timeout=HANG_DEADLINE,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False"


# ---------------------------------------------------------------- the layers (docs/architecture.md)

#: bottom to top; a module may import its own layer's modules and any layer below, never one above
LAYERS: tuple[tuple[str, ...], ...] = (
    ("parity_tests.protocol",),
    ("parity_tests.contract",),
    ("tfpar", "torchref", "parity_tests.judging"),
    ("parity_tests.running",),
    ("parity_tests.session",),
    ("parity_tests.reporting", "parity_tests.testing", "parity_tests.launch"),
    ("parity_tests.cli", "parity_tests", "tfpar.__main__"),  # python -m tfpar is the command line
)
#: packages of one layer that must not import each other (the engines are independent of each other
#: and of the judge: only protocol data crosses)
APART = {"tfpar": {"torchref", "parity_tests.judging"}, "torchref": {"tfpar", "parity_tests.judging"},
         "parity_tests.judging": {"tfpar", "torchref"}}
#: the engines see of ``parity_tests`` its boundary alone: ``protocol`` (``tfpar.__main__``, the command line,
#: is placed in the top layer and exempt)
ENGINES = ("tfpar", "torchref")
ENGINES_SEE = "parity_tests.protocol"


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in ("tfpar", "torchref", "parity_tests"):
        for f in (ROOT / pkg).rglob("*.py"):
            if "tests" in f.relative_to(ROOT).parts:
                continue
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = f
    return mods


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Every import of one of our modules by another, at the top or inside a function (lazy) alike."""
    def resolve(dotted: str) -> str | None:
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in mods:
                return ".".join(parts[:i])
        return None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                candidates = [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            out |= {m for m in map(resolve, candidates) if m and m != name}
        graph[name] = out
    return graph


def _layer(module: str) -> tuple[int, str]:
    """(layer index, the package that places it) of a module: the longest matching prefix."""
    best = (-1, "")
    for i, packages in enumerate(LAYERS):
        for p in packages:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best[1]):
                best = (i, p)
    assert best[0] >= 0, f"{module} is in no layer of docs/architecture.md"
    return best


def test_no_import_goes_up_a_layer_or_across_apart_packages():
    mods = _modules()
    bad = []
    for a, targets in _edges(mods).items():
        la, pa = _layer(a)
        for b in targets:
            lb, pb = _layer(b)
            if lb > la or pb in APART.get(pa, ()):
                bad.append(f"{a} -> {b}")
    assert not bad, "imports against the layering (docs/architecture.md):\n" + "\n".join(sorted(bad))


def test_engines_import_of_parity_tests_protocol_alone():
    """``tfpar`` and ``torchref`` import nothing of ``parity_tests`` but ``parity_tests.protocol`` (lazy imports
    included): what they share with the judge crosses there, so the judge's modules can change freely."""
    bad = []
    for a, targets in _edges(_modules()).items():
        if _layer(a)[1] not in ENGINES:
            continue  # tfpar.__main__ is placed with parity_tests.cli
        bad += [f"{a} -> {b}" for b in targets
                if b.split(".")[0] == "parity_tests" and not (b == ENGINES_SEE or b.startswith(ENGINES_SEE + "."))]
    assert not bad, "engines import parity_tests beyond protocol (docs/architecture.md):\n" + "\n".join(sorted(bad))


def test_no_module_import_circle():
    """No circle among modules (lazy imports included): Tarjan's strongly connected components."""
    graph = _edges(_modules())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_checks_see_a_planted_upward_import_and_circle(tmp_path, monkeypatch):
    """The two checks above can fail: a protocol module importing the session, and two modules
    importing each other, are both found."""
    mods = _modules()
    planted = dict(mods)
    up = tmp_path / "up.py"
    up.write_text("from parity_tests.session import comparison\n")
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import parity_tests.running.zz_b\n")
    b.write_text("def f():\n    from parity_tests.running import zz_a\n")
    planted.update({"parity_tests.protocol.zz_up": up, "parity_tests.running.zz_a": a, "parity_tests.running.zz_b": b})
    monkeypatch.setattr(sys.modules[__name__], "_modules", lambda: planted)
    with pytest.raises(AssertionError, match="parity_tests.protocol.zz_up -> parity_tests.session.comparison"):
        test_no_import_goes_up_a_layer_or_across_apart_packages()
    with pytest.raises(AssertionError, match="zz_a"):
        test_no_module_import_circle()


def test_the_engine_check_sees_a_planted_import_of_the_contract(tmp_path, monkeypatch):
    """An engine module importing ``parity_tests.contract`` (a layer below it, so the layer check passes it),
    at the top or inside a function, is found; one importing ``parity_tests.protocol`` is not."""
    planted = dict(_modules())
    top, lazy, fine = tmp_path / "top.py", tmp_path / "lazy.py", tmp_path / "fine.py"
    top.write_text("from parity_tests.contract.model import validate_model\n")
    lazy.write_text("def f():\n    from parity_tests.contract import specs\n")
    fine.write_text("from parity_tests.protocol.specs import nested_inputs\n")
    planted.update({"tfpar.zz_top": top, "torchref.zz_lazy": lazy, "tfpar.zz_fine": fine})
    monkeypatch.setattr(sys.modules[__name__], "_modules", lambda: planted)
    with pytest.raises(AssertionError) as e:
        test_engines_import_of_parity_tests_protocol_alone()
    assert "tfpar.zz_top -> parity_tests.contract.model" in str(e.value)
    assert "torchref.zz_lazy -> parity_tests.contract" in str(e.value)
    assert "zz_fine" not in str(e.value)


# ---------------------------------------------------------------- docs/architecture.md says what LAYERS says

ARCHITECTURE = ROOT / "docs" / "architecture.md"
_NUMBERS = {"five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}


def _drawn_layers(text: str) -> list[set[str]]:
    """The drawing's layers, top to bottom: the packages named on each band's first line (``cli.py``,
    ``reporting/`` ... ``protocol/``), without their ``/`` or ``.py``."""
    drawing = text.split("```\n", 2)[1]
    bands = [b for b in drawing.split("\n ─") if b.strip()]
    names = []
    for band in bands:
        first = next(line for line in band.splitlines() if line.strip() and not line.lstrip().startswith("─"))
        names.append({w.removesuffix("/").removesuffix(".py") for w in first.split() if w.endswith(("/", ".py"))})
    return names


def test_the_architecture_page_draws_and_counts_the_layers_of_LAYERS():
    """docs/architecture.md's drawing has one band per entry of :data:`LAYERS` (top to bottom), each band naming
    packages of that entry only, and its prose counts them in words ("Seven layers")."""
    text = ARCHITECTURE.read_text()
    drawn = _drawn_layers(text)
    assert len(drawn) == len(LAYERS), f"the drawing has {len(drawn)} layers, test_layering.LAYERS {len(LAYERS)}"
    for band, packages in zip(drawn, reversed(LAYERS), strict=True):
        short = {p.rpartition(".")[2] for p in packages}
        assert band and band <= short, f"drawn {sorted(band)} in the layer of {packages}"
    counted = [n for word, n in _NUMBERS.items() if f"{word} layers" in text.lower()]
    assert counted == [len(LAYERS)], f"the page counts {counted} layers, LAYERS holds {len(LAYERS)}"


def test_the_architecture_page_lists_running_bottom_up():
    """The sentence "Inside `running`, from the bottom: ..." names every module of ``parity_tests.running``,
    each after every module of ``running`` it imports (lazy imports included)."""
    text = " ".join(ARCHITECTURE.read_text().split())
    sentence = text.split("Inside `running`, from the bottom:", 1)[1].split("(", 1)[0]
    listed = [w.strip("`,. ") for w in sentence.split() if w.startswith("`")]
    mods = _modules()
    running = sorted(m.rpartition(".")[2] for m in mods if m.startswith("parity_tests.running."))
    assert sorted(listed) == running, f"listed {listed}, the modules of running are {running}"
    edges = _edges(mods)
    late = [f"{m} imports {t.rpartition('.')[2]}, listed after it" for i, m in enumerate(listed)
            for t in edges[f"parity_tests.running.{m}"]
            if t.startswith("parity_tests.running.") and t.rpartition(".")[2] in listed[i:]]
    assert not late, "\n".join(late)
