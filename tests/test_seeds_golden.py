"""The worked examples of SEEDS.md reproduce to 1e-4 (golden values from the source documents)."""

import numpy as np
import torch

from model.attention import masked_softmax, scaled_dot_product

ATOL = 1e-4
X = torch.tensor([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]], dtype=torch.float32)
W_K = torch.tensor([[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]], dtype=torch.float32)
W_Q = torch.tensor([[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]], dtype=torch.float32)
W_V = torch.tensor([[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]], dtype=torch.float32)


def test_example_one_projections_match_the_article():
    np.testing.assert_array_equal((X @ W_K).numpy(), [[0, 1, 1], [4, 4, 0], [2, 3, 1]])
    np.testing.assert_array_equal((X @ W_Q).numpy(), [[1, 0, 2], [2, 2, 2], [2, 1, 3]])
    np.testing.assert_array_equal((X @ W_V).numpy(), [[1, 2, 3], [2, 8, 0], [2, 6, 3]])


def test_example_one_softmax_weights_without_scaling():
    scores = (X @ W_Q) @ (X @ W_K).T
    np.testing.assert_array_equal(scores.numpy(), [[2, 4, 4], [4, 16, 12], [4, 12, 10]])
    weights = masked_softmax(scores, torch.ones(3, 3, dtype=torch.bool))
    expected = [[0.063379, 0.46831, 0.46831], [6.0337e-06, 0.98201, 0.017986], [2.9539e-04, 0.88054, 0.11917]]
    np.testing.assert_allclose(weights.numpy(), expected, atol=ATOL)


def test_example_one_output_without_scaling():
    out = scaled_dot_product(X @ W_Q, X @ W_K, X @ W_V, torch.ones(3, 3, dtype=torch.bool), 1.0)
    expected = [[1.9366, 6.6831, 1.5951], [2.0000, 7.9640, 0.0540], [1.9997, 7.7599, 0.3584]]
    assert out.shape == (3, 3) and out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), expected, atol=ATOL)


def test_example_two_follows_the_formula_not_the_article_arithmetic():
    qkv = torch.tensor([[2, 2], [1, 3], [2, 2], [0, 4]], dtype=torch.float32)
    scores = qkv @ qkv.T
    np.testing.assert_array_equal(scores.numpy(), [[8, 8, 8, 8], [8, 10, 8, 12], [8, 8, 8, 8], [8, 12, 8, 16]])
    out = scaled_dot_product(qkv, qkv, qkv, torch.ones(4, 4, dtype=torch.bool), 1 / np.sqrt(4))
    expected = [[1.25, 2.75], [0.5549, 3.4451], [1.25, 2.75], [0.1780, 3.8220]]
    np.testing.assert_allclose(out.numpy(), expected, atol=ATOL)
