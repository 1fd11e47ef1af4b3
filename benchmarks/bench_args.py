"""Argument types shared by the benchmark scripts: a bad value is argparse's one-line usage
error (exit 2), never a traceback from deep inside a measurement."""
from __future__ import annotations

import argparse


def _int_at_least(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "an integer >= 1")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def budget_list(text: str) -> list[int]:
    """`16,64,256`: budgets, each an integer >= 0."""
    return [_int_at_least(part, 0, "comma-separated budgets, integers >= 0") for part in text.split(",")]
