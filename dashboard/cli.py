"""`ddtop`: the live dashboard of a run (not built yet: see the README)."""

from __future__ import annotations

import argparse
import sys

from ddtop.daemon.config import EXIT_USAGE, OneLineParser


def build_parser() -> argparse.ArgumentParser:
    return OneLineParser(
        prog="ddtop",
        description="Live terminal dashboard for ddtrain runs. Not available in this version: "
        "follow a run with `ddtrain start --foreground`, whose output shows progress and "
        "each epoch's global metrics.",
    )


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)
    print("ddtop: the live dashboard is not available in this version; "
          "`ddtrain start --foreground` prints a run's progress", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
