"""`python -m serve`: parse flags/environment into a ServerConfig and serve."""

import sys

from serve.app import serve
from serve.config import load_config


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ValueError as error:
        print(f"python -m serve: {error}", file=sys.stderr)
        return 2
    return serve(config)


if __name__ == "__main__":
    raise SystemExit(main())
