"""The front page and the docs stay usable: the README is short, every relative link in it and
in docs/ reaches a file (and a heading, where it names one), every page is in the index, and CI
runs the README's own install and test commands."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    lines = page.read_text().splitlines()
    return {_anchor(line.lstrip("#")) for line in lines if line.startswith("#")}


def test_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines"
    headings = {line.lstrip("# ").split(":")[0] for line in lines if line.startswith("## ")}
    assert {"Install and run", "Commands", "Algorithms", "Results", "Limitations"} <= headings
    assert "docs/index.md" in "\n".join(lines)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_reach_their_target(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        missing_heading = anchor and file.suffix == ".md" and anchor not in _anchors(file)
        if not file.exists() or missing_heading:
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


def test_every_doc_page_is_in_the_index():
    index = (REPO / "docs" / "index.md").read_text()
    missing = [p.name for p in PAGES[1:] if p.name != "index.md" and f"]({p.name}" not in index]
    assert not missing, f"docs/index.md does not link {missing}"


def _readme_commands() -> list[str]:
    """The README's first two bash blocks: install + run, install + test."""
    return re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)[:2]


def test_ci_runs_the_readme_test_command():
    """.ci/run installs as the README's test command does and runs its pytest command."""
    run_cmd, test_cmd = (c.strip() for c in _readme_commands())
    assert run_cmd.endswith("&& python -m rlhf")
    ci = (REPO / ".ci" / "run").read_text()
    for part in test_cmd.split(" && ")[2:]:  # after creating and activating the venv
        assert part.replace("pip install", "pip install -q") in ci or part in ci, part
    install = run_cmd.split(" && ")[:-1]
    assert install[:3] == test_cmd.split(" && ")[:3]  # same venv, same torch


def test_no_page_names_a_former_flat_ppo_key():
    """PPO's keys moved into sections (issue 49): a page names them where they are now (a line
    that names a former one on purpose says "former")."""
    from rlhf.config import RENAMED_KEYS

    # a former key that is now a section of that name (ppo.ema) is the section there
    old = [k for k, new in RENAMED_KEYS.items() if k.startswith("ppo.") and new != f"{k}.enabled"]
    names = "|".join(map(re.escape, old))
    pattern = re.compile(rf"(?<![\w.])({names})(?!\w)")
    found = [
        f"{page.name}:{number}: {match[0]}"
        for page in PAGES
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if "former" not in line
        for match in pattern.finditer(line)
    ]
    assert not found, found
