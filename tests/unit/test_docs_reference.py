"""The docs as a reference that cannot drift: every `REIN_*` setting and every `rein` flag is
documented, and every `REIN_*` variable and command flag the docs name exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

import rein.core.settings as settings_module
from rein.cli.main import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md", REPO / "deploy" / "k8s" / "README.md"]
VARIABLE = re.compile(r"REIN_[A-Z0-9_]*[A-Z0-9]")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# Where a variable that is no setting may be read: the scripts, tests and benchmarks around rein.
READERS = ["tests", "bench", "examples", ".ci", "Makefile", "Dockerfile", "compose.yaml", "compose.gpu.yaml",
           "deploy"]


def _settings_variables() -> set[str]:
    """REIN_<FIELD> of every field of the settings classes read from the environment."""
    names = set()
    for value in vars(settings_module).values():
        if isinstance(value, type) and issubclass(value, settings_module.BaseSettings):
            for name, field in value.model_fields.items():
                if field.validation_alias is None:   # an alias names its own variable (PROMETHEUS_...)
                    names.add(f"{value.model_config.get('env_prefix', '')}{name}".upper())
    return {name for name in names if name.startswith("REIN_")}


def _documented(pattern: re.Pattern[str], paths: list[Path]) -> set[str]:
    return {match for path in paths for match in pattern.findall(path.read_text())}


def _repo_text(names: list[str]) -> str:
    text = []
    for name in names:
        path = REPO / name
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and p.suffix not in
                                               (".md", ".json", ".png", ".so", ".pyc")]
        text += [file.read_text(errors="replace") for file in files]
    return "\n".join(text)


def _cli_flags() -> dict[str, set[str]]:
    """Each long option of a `rein` subcommand (or of its own subcommands: `rein batch submit`),
    with the subcommands that take it."""
    flags: dict[str, set[str]] = {}

    def collect(command: str, parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    collect(command, sub)
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    flags.setdefault(option, set()).add(command)

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, parser in action.choices.items():
                collect(command, parser)
    return flags


def test_every_setting_is_in_the_configuration_reference():
    missing = _settings_variables() - _documented(VARIABLE, [REPO / "docs" / "configuration.md"])
    assert not missing, f"settings with no row in docs/configuration.md: {sorted(missing)}"


def test_every_variable_the_docs_name_exists():
    unknown = _documented(VARIABLE, DOCS) - _settings_variables()
    readers = _repo_text(READERS)
    unread = sorted(name for name in unknown if name not in readers)
    assert not unread, f"the docs name variables nothing reads: {unread}"


def test_every_flag_is_documented():
    missing = {flag: sorted(commands) for flag, commands in _cli_flags().items()
               if flag not in _documented(FLAG, DOCS)}
    assert not missing, f"flags the docs never name: {missing}"


@pytest.mark.parametrize("doc", ["api.md", "configuration.md"])
def test_every_flag_of_a_command_synopsis_exists(doc):
    """The flags in the synopses of `rein ...` commands (table rows and shell lines) are flags of
    that command."""
    flags = _cli_flags()
    wrong = []
    for line in (REPO / "docs" / doc).read_text().splitlines():
        for synopsis in re.findall(r"`(?:\.venv/bin/)?rein ([a-z-]+)([^`]*)`", line):
            command, rest = synopsis
            for flag in FLAG.findall(rest):
                if command not in flags.get(flag, set()):
                    wrong.append(f"rein {command} {flag}")
    assert not wrong, f"synopses naming flags their command does not take: {wrong}"
