"""The documentation agrees with the code: the parameter reference is what the nodes declare,
and every relative link of the README and docs/ points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REGENERATE = "python -m vla_accel_ros.ros.param_reference --write (from the repository root)"


def test_the_parameter_reference_is_generated_from_the_configs():
    pytest.importorskip("rclpy")
    from vla_accel_ros.ros.param_reference import markdown

    page = (REPO / "docs" / "parameters.md").read_text()
    assert page == markdown(), f"docs/parameters.md differs from the config dataclasses: {REGENERATE}"


def test_the_method_pages_knob_tables_are_generated_from_the_configs():
    pytest.importorskip("rclpy")
    from vla_accel_ros.ros.param_reference import refresh

    pages = sorted((REPO / "docs").rglob("*.md"))
    blocks = sum(p.read_text().count("<!-- knobs ") for p in pages)
    assert blocks >= 5  # the method pages carry their knobs
    stale = [str(p.relative_to(REPO)) for p in pages if refresh(p.read_text()) != p.read_text()]
    assert not stale, f"{stale}: knob tables differ from the config dataclasses: {REGENERATE}"


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _without_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links or headings


def _anchors(page: Path) -> set[str]:
    """The heading anchors GitHub makes: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.*)$", _without_code(page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_files_that_exist(page: Path):
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(page.read_text())):
        path, _, anchor = target.partition("#")
        if re.match(r"[a-z]+:", path):  # a URL
            continue
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            missing.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            missing.append(target)
    assert not missing, f"{page.relative_to(REPO)} links to {missing}"


def test_the_readme_stays_a_front_door():
    assert len((REPO / "README.md").read_text().splitlines()) <= 260
