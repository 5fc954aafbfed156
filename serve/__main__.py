"""`python -m serve`: parse flags/environment into a ServerConfig and serve."""

import sys

from serve.config import load_config
from serve.protocols.proto_stamp import GeneratedCodeError


def main(argv: list[str] | None = None) -> int:
    try:
        from serve.assembly.app import serve  # loads the generated protobuf code, which must be current
    except GeneratedCodeError as error:
        print(f"python -m serve: {error}", file=sys.stderr)
        return 2
    try:
        config = load_config(argv)
    except ValueError as error:
        print(f"python -m serve: {error}", file=sys.stderr)
        return 2
    return serve(config)


if __name__ == "__main__":
    raise SystemExit(main())
