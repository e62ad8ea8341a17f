"""The `kvrelay` command. The service subcommands arrive with the services issue."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrelay")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="run the full local stack (not built yet)")
    args = parser.parse_args(argv)
    if args.command == "up":
        print("kvrelay: the gRPC services are not built yet; use the offline API "
              "(from services.engine import LLM) for now.", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
