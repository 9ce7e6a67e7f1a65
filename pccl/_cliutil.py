"""Shared pieces of the command-line tools (``pccl``, ``pccl-master``, ``pccl run``): one-line errors."""

from __future__ import annotations

import argparse
import math
from typing import NoReturn


class CliError(Exception):
    """A mistake on the command line: one line for the user, then exit ``code``."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class Parser(argparse.ArgumentParser):
    """argparse that reports a mistake as one line (with a pointer to --help), not usage + error."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see {self.prog} --help)")


def port_number(text: str) -> int:
    """argparse type: a TCP port 0-65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)") from None
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0-65535)")
    return port


def seconds(text: str) -> float:
    """argparse type: a non-negative number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value:g} must not be negative")
    return value


__all__ = ["CliError", "Parser", "port_number", "seconds"]
