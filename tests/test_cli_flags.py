"""Every command line of ours takes a flag only by its whole name: argparse's prefix matching would read
`python -m serve --model-repo X` as `--model-repository X` and `python -m export --from X` as `--from-pretrained X`,
silently (issue 41)."""

from __future__ import annotations

import pytest


def _serve(argv):
    from serve.config import build_parser

    return build_parser().parse_args(argv)


def _export(argv):
    from export.cli import build_parser

    return build_parser().parse_args(argv)


def _client(argv):
    from client import main

    return main(argv)


@pytest.mark.parametrize("parse, prefix, rest", [
    (_serve, "--model-repo", []),  # of --model-repository
    (_export, "--from", []),  # of --from-pretrained
    (_client, "--targ", ["health"]),  # of --target, before the command
], ids=["serve", "export", "client"])
def test_a_prefix_of_a_flag_is_refused_not_taken_for_it(parse, prefix, rest, capsys):
    with pytest.raises(SystemExit) as refused:
        parse([f"{prefix}=somewhere", *rest])
    assert refused.value.code == 2
    assert f"unrecognized arguments: {prefix}=somewhere" in capsys.readouterr().err
