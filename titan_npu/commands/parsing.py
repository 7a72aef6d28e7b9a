"""A command's options parsed and then held to the table of every knob (config/options.py) before any work."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from titan_npu.config.options import COMMAND_OPTIONS
from titan_npu.errors import ConfigError


class CommandParser(argparse.ArgumentParser):
    """argparse whose refusals (an unknown choice, a value of the wrong type, a missing option) are one line, as
    every other refusal is: a ConfigError that the dispatcher prints and turns into exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        if message.endswith("expected one argument"):
            # argparse takes a value such as -5GB for an option name and reports the value as missing.
            option = message.removeprefix("argument ").split(":")[0].split("/")[0]
            message += f" (if its value starts with '-', write {option}=VALUE)"
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")



def parse(command: str, parser: argparse.ArgumentParser, argv: Sequence[str], known: bool = False
          ) -> tuple[argparse.Namespace, list[str]]:
    """(options, the tokens left for the config loader: --section.key value ...; [] unless `known`), every option
    checked against its row: a ConfigError names the option, the value and what it accepts."""
    if known:
        args, rest = parser.parse_known_args(list(argv))
    else:
        args, rest = parser.parse_args(list(argv)), []
    check_options(command, parser, args)
    return args, rest


def option_name(action: argparse.Action) -> str:
    """The name an option has in the table: its first flag, or a positional's dest."""
    return action.option_strings[0] if action.option_strings else action.dest


def check_options(command: str, parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """ConfigError for the first option whose value its row refuses."""
    rows = COMMAND_OPTIONS[command]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = option_name(action)
        value = getattr(args, action.dest)
        for item in value if isinstance(value, list) else [value]:
            rows[name].check(name, item)
