"""Benchmarks that run a baseline in the same run and report ratios (`moepec bench`)."""


def at_least_one(text: str) -> int:
    """argparse type of a count that must be 1 or more (``--repeats``)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value
