"""kernels.top_k: the same values and ids as jax.lax.top_k, by sorts instead of XLA's TopK kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kernels.top_k import BLOCK, top_k, top_k_ranked, top_k_sorted


@pytest.mark.parametrize("shape,k", [((3, 4, 32000), 10),  # a tree level: blocked path
                                     ((2, 49152), 2),  # a policy's top-2 over the target vocab
                                     ((2, 1000), 5), ((1, 129 * 25 + 7), 10),  # padded last block
                                     ((4, 300), 3), ((2, 510), 59),  # sorted whole (few blocks; k > half)
                                     ((2, 5000), BLOCK + 1)])  # k above the block width
def test_equals_lax_top_k(shape, k):
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    want, got = jax.lax.top_k(x, k), top_k(x, k)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_ties_prefer_the_lower_id_like_lax_top_k():
    x = jnp.asarray([[1.0, 3.0, 3.0, -jnp.inf, 3.0, 0.0]])
    np.testing.assert_array_equal(np.asarray(top_k_sorted(x, 4)[1]), [[1, 2, 4, 0]])
    ties = jnp.round(jax.random.normal(jax.random.PRNGKey(1), (8, 32000)) * 4).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(top_k(ties, 10)[0]), np.asarray(jax.lax.top_k(ties, 10)[0]))


def test_k_out_of_range_is_one_line():
    with pytest.raises(ValueError, match=r"k=7 must be in \[1, 6\]"):
        top_k(jnp.zeros((2, 6)), 7)


@pytest.mark.parametrize("select", [top_k_ranked, top_k_sorted])
def test_whole_row_paths_equal_lax_top_k_with_ties_and_infs(select):
    x = jnp.round(jax.random.normal(jax.random.PRNGKey(2), (3, 5, 300)) * 3)
    x = x.at[:, :, ::7].set(-jnp.inf)
    for k in (1, 10, 59):
        want, got = jax.lax.top_k(x, k), select(x, k)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
