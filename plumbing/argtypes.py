"""argparse `type=` converters shared by the commands: a bad value becomes argparse's one-line
error (exit 2), never a traceback."""

from __future__ import annotations

import argparse
import math


def _number(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{raw} is not a finite number")
    return value


def positive_float(raw: str) -> float:
    value = _number(raw)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{raw} must be more than 0")
    return value


def non_negative_float(raw: str) -> float:
    value = _number(raw)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{raw} must be 0 or more")
    return value


def positive_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{raw} must be at least 1")
    return value


def port(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port {raw!r} is not a number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is not in 0-65535")
    return value
