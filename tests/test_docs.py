"""The documentation a reader follows: every docs/ page reachable from the README, every relative link
and anchor resolving, and the layout trees naming folders and modules that exist."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "experiments" / "README.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
TREE_ENTRY = re.compile(r"^(?P<indent>[│ ]*)(?:[├└]── )(?P<name>\S+)")


def prose(text: str) -> str:
    """The text outside fenced code blocks (a link inside ``` is an example, not a link)."""
    return "".join(part for i, part in enumerate(re.split(r"^```.*$", text, flags=re.M)) if i % 2 == 0)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", prose(page.read_text()), flags=re.M)}


def links(page: pathlib.Path) -> list[str]:
    return LINK.findall(prose(page.read_text()))


def layout_tree(page: pathlib.Path) -> list[str]:
    """The paths the first code block under `## Layout` names, as a tree: a name at column 0 is a
    top-level entry; `├── name` / `└── name` is a child, one level per 4 columns of indent; other lines
    continue the previous entry's description."""
    block = page.read_text().split("## Layout", 1)[1].split("```", 2)[1]
    paths, stack = [], []
    for line in block.splitlines()[1:]:
        if line and not line[0].isspace() and line[0] not in "│├└":
            depth, name = 0, line.split()[0]
        elif m := TREE_ENTRY.match(line):
            depth, name = len(m.group("indent")) // 4 + 1, m.group("name")
        else:
            continue
        stack[depth:] = [name.rstrip("/")]
        paths.append("/".join(stack))
    return paths


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading #{anchor})")
    assert broken == [], f"{page.relative_to(ROOT)}: {broken}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert unlinked == [], f"docs pages the README does not link: {unlinked}"


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 160


def package_folders() -> set[str]:
    return {str(p.parent.relative_to(ROOT)) for p in (ROOT / "jaxpar").rglob("*.py") if "__pycache__" not in p.parts}


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "docs" / "design.md"], ids=["README", "design"])
def test_layout_tree_names_every_folder_and_nothing_missing(page):
    named = layout_tree(page)
    missing = [p for p in named if not (ROOT / p).exists()]
    assert missing == [], f"{page.name}'s layout names what does not exist: {missing}"
    unnamed = sorted(package_folders() - set(named))
    assert unnamed == [], f"{page.name}'s layout does not name {unnamed}"
    for folder in ("models", "mesh_configs", "experiments", "docs", "tests"):
        assert folder in named, f"{page.name}'s layout does not name {folder}/"


def test_design_layout_names_every_module():
    named = set(layout_tree(ROOT / "docs" / "design.md"))
    modules = {str(p.relative_to(ROOT)) for folder in ("jaxpar", "models") for p in (ROOT / folder).rglob("*.py")
               if p.name != "__init__.py" and "__pycache__" not in p.parts}
    assert sorted(modules - named) == [], "docs/design.md's layout does not name these modules"


def test_readme_layout_names_every_top_level_module():
    named = set(layout_tree(ROOT / "README.md"))
    loose = {f"jaxpar/{p.name}" for p in (ROOT / "jaxpar").glob("*.py") if p.name != "__init__.py"}
    assert sorted(loose - named) == [], "the README's layout does not name these modules"
