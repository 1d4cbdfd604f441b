"""The README's knob table is the one generated from argrpc/_config.py: every knob is
documented, with its default, in one place."""
from pathlib import Path

from argrpc import _config

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_knob_table_matches_config() -> None:
    text = README.read_text()
    table = _config.knob_table_markdown().strip()
    assert table in text, "README knob table is stale: regenerate it from knob_table_markdown()"


def test_readme_limits_table_matches_config() -> None:
    table = _config.limits_table_markdown().strip()
    assert table in README.read_text(), "README limits table is stale: regenerate it"


def test_readme_opens_with_the_two_commands() -> None:
    head = README.read_text().split("\n## ", 1)[0]
    assert "bash scripts/bench.sh" in head and "bash scripts/test.sh" in head
