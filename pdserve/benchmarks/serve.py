"""`pdserve bench serve` (being written)."""

from __future__ import annotations

import argparse


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True)


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError
