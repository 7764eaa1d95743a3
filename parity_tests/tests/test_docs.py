"""The reference pages cannot drift: their measured tables are regenerated from the tests' own tables.

``docs/optimizers.md`` is checked whole in ``test_optimizers.py``; here, every
line that ``python -m parity_tests.tests.test_layers``, ``... test_layers_vocabulary``, ``... test_layers_attention`` and
``python -m parity_tests.tests.test_losses`` print must stand verbatim in
``docs/layers.md`` (the runs are deterministic, so the printed gaps are too).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "layers.md"
# A gap at rounding level (the float64 bound is 1e-10; these agree to ~1e-15) depends on the
# CPU's vector width and summation order, not on the code: its digits and the array that
# happened to hold the largest one are compared as "rounding level". Anything larger is a
# measured difference and must stand verbatim.
_ROUNDING = re.compile(r"\| ([0-9.]+e-1[3-9]|0) \([^)]*\) \|")


def _normalise(line: str) -> str:
    return _ROUNDING.sub("| rounding level |", line)


@pytest.mark.usefixtures("pool")
@pytest.mark.parametrize("module", ["parity_tests.tests.test_layers", "parity_tests.tests.test_losses",
                                    "parity_tests.tests.test_layers_vocabulary", "parity_tests.tests.test_layers_attention",
                                    "parity_tests.tests.test_layers_tokens"])
def test_layers_page_tables_are_up_to_date(module, capsys):
    importlib.import_module(module).main()
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert len(printed) > 4
    doc = {_normalise(line) for line in DOC.read_text().splitlines()}
    stale = [line for line in printed if _normalise(line) not in doc]
    assert not stale, f"docs/layers.md is out of date; regenerate with python -m {module}:\n" + "\n".join(stale)


def test_the_implementations_table_is_the_engines_declarations():
    """docs/implementations.md's engines table is generated from tfpar.engines and torchref.engines."""
    from parity_tests.protocol.engine import table
    from parity_tests.running.builtins import SPECS

    text = (DOC.parent / "implementations.md").read_text()
    start = text.index("<!-- engines table:")
    start = text.index("\n", start) + 1
    end = text.index("<!-- end of engines table -->")
    assert text[start:end] == table(SPECS), "regenerate the table: parity_tests.protocol.engine.table(SPECS)"


# ---------------------------------------------------------------- references to documents

ROOT = Path(__file__).resolve().parents[2]
#: documents outside the repository (the project's own planning notes) that product code and docs
#: must not cite: what they say that a reader needs belongs in docs/
_OUTSIDE = re.compile(
    r"\bCONTRACT\b|\b[Cc]ontract,?\s+(?:section|§)\s*\d|\bDESIGN\.md\b|\bSTYLE\.md\b|\b[Tt]he\s+seeds\b|\bshared/(?:CONTRACT|DESIGN|STYLE)|\.\./shared/"
)
_DOC_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]+?\.md\b")
_MD_LINK = re.compile(r"\]\(([^)\s#]+\.md)(?:#[^)]*)?\)")
_CODE_PATH = re.compile(r"(?<![\w/.-])((?:tfpar|torchref|parity_tests|benchmarks)/[\w/-]+\.py)\b")
_TEST_PATH = re.compile(r"(?<![\w/.-])tests/(test_\w+\.py)\b")
#: a module named from inside its package (``judging/rules.py``): it must exist in one of the three packages
_PKG_PATH = re.compile(
    r"(?<![\w/.-])((?:contract|protocol|running|judging|session|reporting|testing|launch)/[\w/-]+\.py)\b"
)


def _cited_files() -> list[Path]:
    """Product code (tests excluded), benchmarks, docs, README and the examples' pages."""
    code = [p for pkg in ("tfpar", "torchref", "parity_tests", "benchmarks") for p in (ROOT / pkg).rglob("*.py")
            if "tests" not in p.relative_to(ROOT).parts]
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").rglob("*.md")]
    return sorted(code + pages)


def dangling_references(path: Path, text: str) -> list[str]:
    """Every place in ``text`` (the file ``path``) that cites a document the repository does not hold."""
    rel = path.relative_to(ROOT)
    # over the whole text: a phrase may break across lines ("the\n  seeds'")
    out = [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r} (not in this repository)"
           for m in _OUTSIDE.finditer(text)]
    for n, line in enumerate(text.splitlines(), 1):
        where = f"{rel}:{n}"
        out += [f"{where}: {m.group(0)} does not exist" for m in _DOC_PATH.finditer(line)
                if not (ROOT / m.group(0)).is_file()]
        out += [f"{where}: {m.group(1)} does not exist" for m in _CODE_PATH.finditer(line)
                if not (ROOT / m.group(1)).is_file()]
        out += [f"{where}: {m.group(1)} does not exist" for m in _PKG_PATH.finditer(line)
                if not any((ROOT / pkg / m.group(1)).is_file() for pkg in ("parity_tests", "tfpar", "torchref"))]
        out += [f"{where}: tests/{m.group(1)} does not exist" for m in _TEST_PATH.finditer(line)
                if not (ROOT / "parity_tests" / "tests" / m.group(1)).is_file()]
        if path.suffix == ".md":
            out += [f"{where}: link {m.group(1)} does not exist" for m in _MD_LINK.finditer(line)
                    if "://" not in m.group(1) and not (path.parent / m.group(1)).resolve().is_file()]
    return out


def test_product_code_and_docs_cite_only_documents_the_repository_holds() -> None:
    files = _cited_files()
    assert len(files) > 100 and ROOT / "docs" / "tolerance.md" in files  # the scan sees the tree
    found = [d for p in files for d in dangling_references(p, p.read_text(encoding="utf-8"))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("text", "what"),
    [
        pytest.param("statuses (CONTRACT section 8)", "CONTRACT", id="contract"),
        pytest.param("see CONTRACT.md", "CONTRACT", id="contract-md"),
        pytest.param("(see the contract, section 2)", "contract, section 2", id="contract-lowercase"),
        pytest.param("measured in DESIGN.md", "DESIGN.md", id="design"),
        pytest.param("as the seeds do", "the seeds", id="seeds"),
        pytest.param("as the\n  seeds' tf.split", "'the\\n  seeds'", id="seeds-across-lines"),
        pytest.param("read ../shared/STYLE.md", "STYLE.md", id="shared"),
        pytest.param("derived in docs/no-such-page.md", "docs/no-such-page.md does not exist", id="doc-path"),
        pytest.param("see [the page](no-such-page.md)", "link no-such-page.md does not exist", id="md-link"),
        pytest.param("the rules (parity_tests/judging/tolerance.py)", "tolerance.py does not exist", id="code-path"),
        pytest.param("(``tests/test_tolerance.py`` shows it)", "test_tolerance.py does not exist", id="test-path"),
        pytest.param("a rule: `judging/tolerance.py`", "judging/tolerance.py does not exist", id="package-path"),
    ],
)
def test_a_dangling_reference_is_found(text: str, what: str) -> None:
    page = ROOT / "docs" / "tolerance.md"
    found = dangling_references(page, text)
    assert any(what in d for d in found), found
    assert not dangling_references(page, "see docs/tolerance.md, [plugins](plugins.md), tfpar/towers.py, "
                                         "tests/test_rules.py and /shared/cases/case.json on a cluster")


def test_the_docs_index_lists_every_page() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    listed = set(_MD_LINK.findall(index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md"}
    assert pages - listed == set(), f"docs/README.md does not list {sorted(pages - listed)}"
    assert {name for name in listed if "/" not in name} <= pages  # and lists no page that is not there


@pytest.mark.slow
def test_the_readme_quickstart_runs(tmp_path) -> None:
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text()
    block = text.split("## Quickstart in Python", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "quickstart.py").write_text(block)
    out = subprocess.run([sys.executable, str(tmp_path / "quickstart.py")], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tf.towers vs torch.ddp" in out.stdout and "verdict: PARITY" in out.stdout, out.stdout
