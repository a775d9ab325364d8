"""Reading what an experiments/ script wrote in its --quick mode (tests/test_experiments_bench.py and
tests/test_experiments_study.py): markdown tables back into rows, numbers with units, the figure beside
them, and the run itself (a fresh process from the repository root, as `make bench` runs it)."""
from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# ---- reading what a script wrote -----------------------------------------------------------------

def tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table in `text`, as rows of {header: cell}."""
    found, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        if block:
            header, sep, *rows = block
            assert all(set(c) <= set("-:") for c in sep), f"not a table separator: {sep}"
            assert all(len(r) == len(header) for r in rows), f"ragged table under {header}"
            found.append([dict(zip(header, r)) for r in rows])
            block = []
    return found


def table(text: str, *columns: str) -> list[dict[str, str]]:
    """The one table whose headers start with `columns`; it must have at least one row."""
    matches = [t for t in tables(text) if t and tuple(t[0])[:len(columns)] == columns]
    assert len(matches) == 1, f"{len(matches)} tables with rows headed {columns} in:\n{text}"
    return matches[0]


def number(cell: str) -> float:
    """A table cell as a float: '1,234' -> 1234.0, '42.9%' -> 0.429, '1.24 MiB' -> 1.24."""
    m = re.fullmatch(r"([-+]?[\d,]*\.?\d+(?:e[-+]?\d+)?)\s*(%|[KMGT]?i?B)?", cell.strip())
    assert m, f"not a number: {cell!r}"
    value = float(m.group(1).replace(",", ""))
    return value / 100 if m.group(2) == "%" else value


def read_results(out: pathlib.Path, stem: str, figure: bool = True) -> str:
    md = out / f"{stem}.md"
    assert md.is_file(), f"{md} not written; {out} holds {sorted(p.name for p in out.iterdir())}"
    if figure and HAVE_MATPLOTLIB:
        png = out / f"{stem}.png"
        assert png.is_file(), f"{png} not written"
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, f"{png} is not a PNG with a picture in it"
    return md.read_text()


# ---- per-script checks ---------------------------------------------------------------------------


def rows_by(rows: list[dict[str, str]], *keys: str) -> dict[tuple, dict[str, str]]:
    return {tuple(r[k] for k in keys): r for r in rows}



def run_quick(name: str, tmp_path: pathlib.Path, check) -> None:
    """Runs experiments/`name`.py --quick into tmp_path/results and hands what it wrote to `check`."""
    out = tmp_path / "results"
    run = subprocess.run([sys.executable, str(EXPERIMENTS / f"{name}.py"), "--quick", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"exit {run.returncode}\nstdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-5000:]}"
    assert f"written to {out}" in run.stdout, run.stdout[-3000:]
    check(out, run.stdout)


def scripts() -> list[str]:
    """Every script under experiments/ (those starting with _ are shared code)."""
    return sorted(p.stem for p in EXPERIMENTS.glob("*.py") if not p.name.startswith("_"))
