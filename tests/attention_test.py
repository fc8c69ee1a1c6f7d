"""The one mask rule against a NumPy reference that follows docs/method.md §4 literally."""
import numpy as np
import pytest

from stabledrl_jax.models import attention


def reference_staircase(n: int, block: int) -> np.ndarray:
  """[2n, 2n] mask for [x_t ; x_0], written from the four cases of docs/method.md §4, one pair at a time."""
  mask = np.zeros((2 * n, 2 * n), bool)
  for q in range(2 * n):
    for k in range(2 * n):
      q_noisy, k_noisy = q < n, k < n
      bq, bk = (q % n) // block, (k % n) // block
      if q_noisy and k_noisy:
        mask[q, k] = bq == bk
      elif q_noisy and not k_noisy:
        mask[q, k] = bk < bq
      elif not q_noisy and not k_noisy:
        mask[q, k] = bk <= bq
      else:
        mask[q, k] = False
  return mask


def test_block_causal_with_block_one_is_causal():
  mask = np.asarray(attention.block_causal_mask(np.arange(7), 1))
  assert mask.shape == (1, 1, 7, 7)
  np.testing.assert_array_equal(mask[0, 0], np.tril(np.ones((7, 7), bool)))


@pytest.mark.parametrize("block", [2, 3, 4])
def test_block_causal_matches_reference(block):
  positions = np.arange(10)
  expected = (positions[None, :] // block) <= (positions[:, None] // block)
  np.testing.assert_array_equal(np.asarray(attention.block_causal_mask(positions, block))[0, 0],
                                expected)


def test_full_mask_drops_padding_keys_per_row():
  valid = np.array([[True, True, True, False], [False, True, True, True]])
  mask = np.asarray(attention.full_mask(4, valid))
  assert mask.shape == (2, 1, 4, 4)
  for b in range(2):
    np.testing.assert_array_equal(mask[b, 0], np.broadcast_to(valid[b], (4, 4)))


@pytest.mark.parametrize("n,block", [(8, 2), (12, 4), (6, 1), (6, 6)])
def test_staircase_matches_reference(n, block):
  mask = np.asarray(attention.staircase_mask(np.arange(n), block))
  np.testing.assert_array_equal(mask[0, 0], reference_staircase(n, block))


def test_staircase_padding_and_batched_positions():
  positions = np.array([[0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 2, 3]])  # second row left-padded
  valid = np.array([[True] * 6, [False, False, True, True, True, True]])
  mask = np.asarray(attention.staircase_mask(positions, 2, valid))
  for b in range(2):
    n = 6
    for q in range(2 * n):
      for k in range(2 * n):
        q_noisy, k_noisy = q < n, k < n
        bq, bk = positions[b, q % n] // 2, positions[b, k % n] // 2
        rule = {(True, True): bq == bk, (True, False): bk < bq,
                (False, False): bk <= bq, (False, True): False}[(q_noisy, k_noisy)]
        assert mask[b, 0, q, k] == (rule and valid[b, k % n]), (b, q, k)


def test_block_ids_none_is_one_block():
  np.testing.assert_array_equal(np.asarray(attention.block_ids(np.arange(5), None)), np.zeros(5))
  np.testing.assert_array_equal(np.asarray(attention.block_ids(np.arange(5), 2)), [0, 0, 1, 1, 2])
