"""Every `jaxpar ...` command in README.md and docs/*.md runs as a reader would run it: in a fresh process,
from a fresh directory per page holding the files the page's commands read (FILES), the page's commands
in order, each exiting 0. The analytic ones (estimate, plan) run as written in `make test`; the compiling
ones under -m slow, at the smaller sizes declared here (SMALLER: each replacement must apply, so the table
cannot outlive its command). docs/running.md's quoted run is compared with what the command prints, its
timings aside. A command is a line of a ```bash block, or one after `$ ` in any block."""
import os
import pathlib
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import FAST_COMPILE

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ANALYTIC = ("estimate", "plan")

# (page, a piece of the command) -> replacements (old, new) that keep a compiling command small here
SMALLER = {
    ("README.md", "train --model llama-tiny"): [("--steps 50", "--steps 3")],
    ("README.md", "generate"): [("--max-new-tokens 16", "--max-new-tokens 2")],
    ("multi-host.md", "-- train"): [("--steps 20", "--steps 2")],
    ("serving.md", "--prompt 4,5"): [("--max-new-tokens 16", "--max-new-tokens 2")],
    ("strategies.md", "compare"): [("--run-steps 5", "--run-steps 1")],
    ("training.md", "--steps 50"): [("--steps 50", "--steps 3")],
    ("training.md", "d_model=128"): [("--dtype bfloat16", "--dtype bfloat16 --steps 2")],
    ("training.md", "tokens.u16.bin"): [("--data tokens.u16.bin", "--data tokens.u16.bin --steps 2")],
    ("training.md", "--eval-every 20"): [("--eval-every 20", "--eval-every 2 --steps 2")],
    ("training.md", "--prompt-text"): [("--tokenizer data/", "--tokenizer data/ --max-new-tokens 2")],
    ("training.md", "eval --ckpt-dir"): [("--eval-batches 4", "--eval-batches 1")],
    ("training.md", "--ckpt-every 10"): [("--steps 100", "--steps 4"), ("--ckpt-every 10", "--ckpt-every 2")],
    ("training.md", "--resume"): [("--steps 100", "--steps 6")],
}
# what a page's commands need that the page does not make itself
BEFORE = {"serving.md": ["jaxpar train --model llama-tiny --mesh tp8 --devices 8 --steps 2 --ckpt-dir ck"]}


def commands(page: pathlib.Path) -> list[tuple[int, str]]:
    """(line, command text) of every jaxpar command on `page`: continuation lines joined, `$ ` dropped."""
    found, lang, lines, i = [], None, page.read_text().splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if fence:
            lang = None if lang is not None else fence.group(1)
        elif lang is not None:
            text, start = lines[i].strip(), i + 1
            while text.endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text[:-1].rstrip() + " " + lines[i].strip()
            prompted = text.startswith("$ ")
            text = text.removeprefix("$ ")
            if text.startswith("jaxpar ") and (lang in ("bash", "sh") or prompted):
                found.append((start, text))
        i += 1
    return found


def smaller(page: str, text: str) -> str:
    for (where, piece), changes in SMALLER.items():
        if where == page and piece in text:
            for old, new in changes:
                assert old in text, f"{page}: SMALLER's {old!r} is no longer in {text!r}"
                text = text.replace(old, new)
    return text


def make_files(cwd: pathlib.Path) -> None:
    """What the pages' commands read: prompts, raw token ids, a small corpus of text and JSON lines."""
    (cwd / "prompts.txt").write_text("1,2,3\n4,5,6\n")
    np.random.default_rng(0).integers(0, 256, 200_000).astype(np.uint16).tofile(cwd / "tokens.u16.bin")
    (cwd / "corpus").mkdir()
    words = "def return class import for while if else print value total count index result".split()
    rng = np.random.default_rng(1)
    for k in range(120):
        (cwd / "corpus" / f"{k:03d}.txt").write_text(" ".join(rng.choice(words, 300)) + "\n")
    (cwd / "more.jsonl").write_text("".join('{"text": "%s"}\n' % " ".join(rng.choice(words, 300)) for _ in range(40)))


def run(argv: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"XLA_FLAGS": FAST_COMPILE}
    return subprocess.run([sys.executable, "-m", "jaxpar.cli.main", *argv[1:]], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


def page_commands(analytic: bool) -> list:
    return [pytest.param(page, line, text, id=f"{page.name}:{line}") for page in PAGES
            for line, text in commands(page) if (shlex.split(text)[1] in ANALYTIC) == analytic]


@pytest.mark.parametrize("page, line, text", page_commands(analytic=True))
def test_an_analytic_docs_command_runs(page, line, text, tmp_path):
    out = run(shlex.split(text, comments=True), tmp_path)
    assert out.returncode == 0, f"{page.name}:{line}: {text}\n{out.stderr[-2000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if any(shlex.split(t)[1] not in ANALYTIC for _, t in commands(p))],
                         ids=lambda p: p.name)
def test_a_pages_compiling_commands_run_in_order(page, tmp_path):
    make_files(tmp_path)
    for text in BEFORE.get(page.name, []):
        assert run(shlex.split(text), tmp_path).returncode == 0, text
    for line, text in commands(page):
        argv = shlex.split(smaller(page.name, text), comments=True)
        if argv[1] in ANALYTIC:
            continue
        out = run(argv, tmp_path)
        assert out.returncode == 0, f"{page.name}:{line}: {' '.join(argv)}\n{out.stderr[-3000:]}"
        if page.name == "running.md":
            assert untimed(quoted_output(page, line)) == untimed(out.stdout), out.stdout


def quoted_output(page: pathlib.Path, line: int) -> str:
    """The lines after the command at `line` up to the block's end: its output as the page quotes it."""
    lines = page.read_text().splitlines()[line:]
    while lines and lines[0].startswith(" "):  # the command's continuation lines
        lines = lines[1:]
    return "\n".join(lines[:next(i for i, text in enumerate(lines) if text.startswith("```"))])


def untimed(text: str) -> list[str]:
    """The lines with every timing and rate taken out (they are the machine's, not the run's)."""
    timing = r"\d[\d,.]* ?(?:ms/step|ms|s|tokens/s)\b|eta \S+|\(\d[\d,.]* tokens/s\)"
    return [re.sub(r"\s+", " ", re.sub(timing, "T", t)).strip() for t in text.strip().splitlines()]
