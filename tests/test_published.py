"""The published runs live in the repository (jaxpar/cost/published.py): every study and test reads them there,
a clone with no ../shared beside it runs them, and scripts/import_published.py brings a file of ../shared/reference
in as it arrived."""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from jaxpar.cost import published

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "reference"
IMPORTER = ROOT / "scripts" / "import_published.py"


def test_every_collection_loads_with_its_rows():
    """The four files that arrived, by their row counts: Narayanan 2021 (10 rows) and Korthikanti 2022 (4),
    Megatron-Core's H100 table (4), the stacks' 64 rows, and the 75 DGX-B200 / DGX-H100 rows of NeMo and
    Megatron-Bridge 25.02 to 26.06 that the Blackwell issue names."""
    rows = {name: sum(len(s["rows"]) for s in published.load(name)["source"]) for name in published.collections()}
    assert rows == {"published_runs": 14, "published_runs_h100": 4, "published_runs_stacks": 64,
                    "published_runs_blackwell": 75}
    for name in published.collections():
        for src in published.load(name)["source"]:
            assert src["id"] and (src.get("url") or src.get("title")) and src["columns"], src["id"]   # cited
            assert all(len(r) == len(src["columns"]) for r in src["rows"]), src["id"]


def test_nothing_reads_the_shared_folder_but_the_importer():
    """../shared/reference is where new rows arrive; no module, study or test reads it (a clone elsewhere has none)."""
    pattern = re.compile(r"/\s*\"shared|\"\.\./shared")   # a path built to it: ROOT.parent / "shared" ...
    allowed = {IMPORTER, ROOT / "jaxpar/cost/published.py", pathlib.Path(__file__).resolve()}
    readers = [p for folder in ("jaxpar", "experiments", "tests", "models", "scripts") for p in (ROOT / folder).rglob("*.py")
               if p not in allowed and pattern.search(p.read_text())]
    assert not readers, readers


@pytest.mark.skipif(not SHARED.exists(), reason="no ../shared/reference beside the repository")
def test_the_importer_writes_what_the_repository_holds(tmp_path):
    """Importing the shared files again into a fresh folder gives the repository's files byte for byte, and each
    collection reads as its file read (the Blackwell sources with the ids given on import)."""
    files = [SHARED / f"{name}.toml" for name in published.collections()]
    run = subprocess.run([sys.executable, str(IMPORTER), *map(str, files), "--into", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    for path in sorted(published.DIR.glob("*.toml")):
        assert (tmp_path / path.name).read_text() == path.read_text(), path.name
    for path in files:
        arrived = tomllib.loads(path.read_text())["source"]
        held = [{k: v for k, v in s.items() if k in a} for s, a in zip(published.load(path.stem)["source"], arrived)]
        assert held == arrived, path.name


def test_the_importer_refuses_a_model_that_differs(tmp_path):
    """A model table that differs from the one held is one line, and nothing is written."""
    into = tmp_path / "published"
    shutil.copytree(published.DIR, into)
    before = {p.name: p.read_text() for p in into.iterdir()}
    new = tmp_path / "new_runs.toml"
    new.write_text('[models.llama3_1_8b]\nlayers = 33\n\n[[source]]\nid = "x"\nurl = "u"\ncolumns = ["a"]\nrows = [[1]]\n')
    run = subprocess.run([sys.executable, str(IMPORTER), str(new), "--into", str(into)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 1
    assert run.stderr.strip() == "import_published: model llama3_1_8b differs from the one in models.toml: nothing written"
    assert {p.name: p.read_text() for p in into.iterdir()} == before


@pytest.mark.slow
def test_a_clone_without_shared_runs_the_studies_and_tests_that_read_published_runs(tmp_path):
    """The tracked tree copied where no ../shared exists: the stacks study predicts its rows and writes the same
    bands, and the published-run tests pass there."""
    tree = tmp_path / "clone" / "jaxpar-repo"
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in listed:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    assert not (tree.parent.parent / "shared").exists()
    study = subprocess.run([sys.executable, "experiments/study_stacks.py", "--out", str(tmp_path / "s.md")], cwd=tree,
                           capture_output=True, text=True, timeout=600)
    assert study.returncode == 0, study.stderr
    assert (tmp_path / "s.md").read_text() == (ROOT / "experiments/results/study_stacks.md").read_text()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cost_published.py",
                            "tests/test_published.py", "-k", "not clone"], cwd=tree, capture_output=True, text=True,
                           timeout=600)
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert " passed" in tests.stdout and "skipped" in tests.stdout   # the importer's check skips there
