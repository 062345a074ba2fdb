"""argparse types shared by the `tessel` commands: counts and durations, refused with one line that says why."""
from __future__ import annotations

import argparse


def count_from(minimum: int):
    """An argparse type: an integer >= `minimum`."""
    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}; give {minimum} or more")
        return value

    return count


def positive_seconds(text: str) -> float:
    """An argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} seconds: give a finite time above 0")
    return value
