"""`python -m serve`: parse flags/environment into a ServerConfig and serve."""

import os
import sys

from serve.config import load_config
from serve.protocols.proto_stamp import GeneratedCodeError


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ValueError as error:
        print(f"python -m serve: {error}", file=sys.stderr)
        return 2
    if config.prepare_only:  # the cache-warming job: needs neither gRPC nor the generated code (the export image)
        from serve.assembly.model_ids import prepare_only

        return prepare_only(config)
    try:
        from serve.assembly.app import serve  # loads the generated protobuf code, which must be current
    except GeneratedCodeError as error:
        print(f"python -m serve: {error}", file=sys.stderr)
        return 2
    return serve(config)


# glibc's malloc asks for transparent huge pages on its mmapped chunks (the long-input graphs' tensors of
# 100s of MiB): on 4 KiB pages a 32k-token window run took 2x as long once shorter runs had come before
# it (time(32k)/time(4k) 17.8 -> 7.8; docs/long-inputs.md). GLIBC_TUNABLES is read at process start.
HUGE_PAGES = "glibc.malloc.hugetlb=1"


def with_huge_pages() -> None:
    """Re-exec `python -m serve` once with HUGE_PAGES added to GLIBC_TUNABLES (same pid, argv and
    environment otherwise); not where the caller set glibc.malloc.hugetlb itself, nor off Linux."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables or not sys.platform.startswith("linux"):
        return
    env = {**os.environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, HUGE_PAGES]))}
    os.execve(sys.executable, [sys.executable, "-m", "serve", *sys.argv[1:]], env)


if __name__ == "__main__":
    with_huge_pages()
    raise SystemExit(main())
