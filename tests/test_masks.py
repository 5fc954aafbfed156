"""The in-graph mask builder agrees with the mask definitions of SEEDS.md, row by row."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.mask_kinds import MaskKind, allowed_keys
from model.masks import build_allowed

KINDS = list(MaskKind)


def _build(rows, length):
    """rows: list of (kind, window, step, causal, pad_len, custom) -> torch (B, T, T) and numpy reference."""
    batch = len(rows)
    attention = torch.zeros(batch, length, dtype=torch.int64)
    custom = torch.ones(batch, length, length, dtype=torch.bool)
    expected = []
    for b, (kind, window, step, causal, n, matrix) in enumerate(rows):
        attention[b, :n] = 1
        if matrix is not None:
            custom[b] = torch.from_numpy(matrix)
        expected.append(allowed_keys(kind, length, window=window, step=step, causal=causal,
                                     pad=attention[b].numpy(), custom=matrix))
    got = build_allowed(
        attention,
        torch.tensor([int(r[0]) for r in rows]),
        torch.tensor([r[3] for r in rows]),
        torch.tensor([r[1] for r in rows]),
        torch.tensor([r[2] for r in rows]),
        custom,
    )
    return got.numpy(), np.stack(expected)


def test_causal_allows_only_keys_at_or_before_the_query():
    got, _ = _build([(MaskKind.CAUSAL, 0, 1, False, 4, None)], 4)
    np.testing.assert_array_equal(got[0], np.tril(np.ones((4, 4), bool)))


def test_sliding_window_allows_keys_within_w_on_each_side():
    got, _ = _build([(MaskKind.SLIDING_WINDOW, 1, 1, False, 5, None)], 5)
    expected = np.array([[abs(i - j) <= 1 for j in range(5)] for i in range(5)])
    np.testing.assert_array_equal(got[0], expected)


def test_dilated_allows_multiples_of_the_step_in_both_directions():
    got, _ = _build([(MaskKind.DILATED, 0, 2, False, 5, None)], 5)
    assert got[0, 4].tolist() == [True, False, True, False, True]
    assert got[0, 1].tolist() == [False, True, False, True, False]


def test_local_strided_is_the_union_of_window_and_step():
    got, _ = _build([(MaskKind.LOCAL_STRIDED, 1, 4, False, 9, None)], 9)
    assert np.flatnonzero(got[0, 8]).tolist() == [0, 4, 7, 8]


def test_causal_flag_combines_with_windowed_kinds():
    got, _ = _build([(MaskKind.LOCAL_STRIDED, 1, 3, True, 7, None)], 7)
    assert np.flatnonzero(got[0, 6]).tolist() == [0, 3, 5, 6]
    assert not np.triu(got[0], 1).any()


def test_padding_removes_keys_for_every_kind():
    rows = [(k, 2, 2, False, 3, np.ones((6, 6), bool) if k == MaskKind.CUSTOM else None) for k in KINDS]
    got, _ = _build(rows, 6)
    assert not got[:, :, 3:].any()


@settings(max_examples=60, deadline=None)
@given(
    length=st.integers(1, 24),
    rows=st.lists(
        st.tuples(st.sampled_from(KINDS), st.integers(0, 30), st.integers(1, 30), st.booleans(),
                  st.integers(0, 24), st.integers(0, 2**16)),
        min_size=1, max_size=6,
    ),
)
def test_graph_mask_equals_the_reference_definition_for_any_rows(length, rows):
    built = []
    for kind, window, step, causal, n, seed in rows:
        matrix = np.random.default_rng(seed).random((length, length)) < 0.5 if kind == MaskKind.CUSTOM else None
        built.append((kind, window, step, causal, min(n, length), matrix))
    got, expected = _build(built, length)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("text,kind", [("causal", MaskKind.CAUSAL), ("sliding-window", MaskKind.SLIDING_WINDOW),
                                       ("LOCAL_STRIDED", MaskKind.LOCAL_STRIDED)])
def test_mask_kind_parses_its_label(text, kind):
    assert MaskKind.parse(text) is kind


def test_unknown_mask_kind_lists_the_known_ones():
    with pytest.raises(ValueError, match="expected one of bidirectional, causal"):
        MaskKind.parse("diagonal")
