"""The engine options as command-line flags: each command's argparse group, the engine
built from parsed flags, and `CLIError`, the one-line user error every command reports.

The options themselves (names, help, choices, which command takes which, and the layering
flag > REIN_* variable > default) are rein.engine.options', shared with `rein.LLM`'s
keywords; argparse defaults here are None ("not given") so that layering decides.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from rein.core.settings import EngineSettings
from rein.engine.options import options_by_name, options_for, resolve_engine_values

if TYPE_CHECKING:
    from rein.engine.config import EngineConfig


def add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="MODEL",
                        help="a Hugging Face model directory, a GGUF file (needs rein[gguf]) or a hub id")


def add_engine_options(parser: argparse.ArgumentParser, command: str) -> None:
    """The engine options `command` takes, as flags whose argparse default is None (not given)."""
    group = parser.add_argument_group("engine", "flag > REIN_* variable > default")
    for option in options_for(command):
        default = option.default
        shown = option.shown_default or (str(default).lower() if isinstance(default, bool) else default)
        help_text = f"{option.help} (default: {shown}; {option.variable})".replace("%", "%%")
        if option.boolean:
            group.add_argument(option.flag, dest=option.name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        else:
            group.add_argument(option.flag, dest=option.name, type=option.type, choices=option.choices,
                               metavar=option.metavar, default=None, help=help_text)
    if command in options_by_name("enable_prefix_caching").commands:
        # The spelling rein had before vLLM's; hidden.
        group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                           default=None, help=argparse.SUPPRESS)


def add_served_model_name_option(parser: argparse.ArgumentParser) -> None:
    """`rein run-batch` only: the worker's model name is its REIN_MODELS key, `generate` prints text alone."""
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="`model` in responses when a line gives none (default: the model directory name)")


def add_lora_modules_option(parser: argparse.ArgumentParser) -> None:
    """vLLM's --lora-modules (`rein api`, `rein run-batch`): adapters requests name as their model."""
    parser.add_argument("--lora-modules", default=None, metavar="NAME=PATH",
                        help="LoRA adapters served over the model, requests naming one as their model: "
                             "name=path entries, comma separated, or JSON [{\"name\", \"path\", "
                             "\"base_model_name\"}] (default: REIN_LORA_MODULES); turns --enable-lora on")


def engine_config_from_args(args: argparse.Namespace, command: str,
                            variables: EngineSettings | None = None) -> EngineConfig:
    """Raises ValueError (with the engine's message) for an invalid combination or variable."""
    from rein.engine.config import EngineConfig

    names = tuple(option.name for option in options_for(command))
    return EngineConfig(model=args.model, **resolve_engine_values(vars(args), variables, names))


def build_engine(args: argparse.Namespace, command: str):
    """The engine for these args; configuration and model errors become `CLIError`."""
    from rein.engine.engine import LLMEngine
    from rein.openai.reasoning import check_parser_names

    try:
        config = engine_config_from_args(args, command)
        check_parser_names(config.reasoning_parser)   # before the model loads: a typo costs no wait
        return LLMEngine(config)
    except (ValueError, FileNotFoundError) as exc:  # bad sizes, missing model, capacity errors, SettingsError
        raise CLIError(str(exc)) from exc


def generation_defaults_of(engine: Any):
    """The sampling defaults of the engine's model under its `generation_config`, logged once
    (CLIError for an unreadable generation_config.json)."""
    import logging

    from rein.engine.generation_defaults import GenerationConfigError, load_generation_defaults

    try:
        defaults = load_generation_defaults(engine.model_dir, engine.config.generation_config)
    except GenerationConfigError as exc:
        raise CLIError(str(exc)) from exc
    logging.getLogger("rein.engine.generation_defaults").info(
        "generation defaults for model %s: %s", engine.config.model, defaults.describe())
    return defaults


class CLIError(Exception):
    """A user error the command reports on one line (exit status 2)."""
