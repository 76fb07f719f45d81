"""Every public ``vla-accel`` command's ``--help`` says what it does in one line and shows an
example that names the command itself."""

from __future__ import annotations

import argparse

import pytest

from vla_accel_ros.cli import build_parser


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of every leaf command."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, child in subs[0].choices.items():
        yield from _commands(child, (*path, name))


COMMANDS = list(_commands(build_parser()))


def test_the_command_list_is_complete():
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"replay", "eval", "train", "bringup", "bundle import", "bench scheduler", "sim record"} <= names
    assert len(names) >= 19


@pytest.mark.parametrize("path,parser", COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_help_has_a_one_line_summary_and_an_example(path, parser, capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*path, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    usage, _, rest = text.partition("\n\n")
    summary = rest.splitlines()[0]
    assert summary == parser.description.splitlines()[0] and 20 <= len(summary) <= 120, summary
    example = text.split("example:\n", 1)[1].splitlines()[0].strip()
    assert example.startswith("vla-accel " + " ".join(path) + " ") or example == "vla-accel " + " ".join(path), example
