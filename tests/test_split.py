"""The phase split and the train/eval carve-out: disjoint, covering, deterministic, proportional."""

import numpy as np
import pytest

from rlhf.data.split import phase_indices, train_eval_indices


def _phases(num_rows, weights, seed=1234):
    return [phase_indices(num_rows, weights, p, seed) for p in range(len(weights))]


@pytest.mark.parametrize("num_rows", [0, 1, 2, 3, 7, 10, 101, 1000])
@pytest.mark.parametrize("weights", [[2, 4, 4], [1, 1, 1], [0, 1, 0], [3, 0, 7]])
def test_phases_partition_the_rows(num_rows, weights):
    phases = _phases(num_rows, weights)
    joined = np.concatenate(phases)
    assert len(joined) == num_rows  # disjoint: no index twice ...
    assert sorted(joined.tolist()) == list(range(num_rows))  # ... and covering
    for idx in phases:
        assert idx.dtype == np.int64
        assert np.all(np.diff(idx) > 0)  # ascending


def test_phase_sizes_follow_cumulative_rounding():
    # boundaries round(n * cumsum(w) / sum(w)): 1000 * [0.2, 0.6, 1.0] -> 200, 600, 1000
    assert [len(p) for p in _phases(1000, [2, 4, 4])] == [200, 400, 400]
    # 7 rows: round(1.4) = 1, round(4.2) = 4 -> sizes 1, 3, 3 (never more than half a row off)
    assert [len(p) for p in _phases(7, [2, 4, 4])] == [1, 3, 3]
    sizes = [len(p) for p in _phases(12345, [1, 2, 3])]
    for size, share in zip(sizes, [1 / 6, 2 / 6, 3 / 6], strict=True):
        assert abs(size - 12345 * share) <= 1


def test_zero_weight_gives_an_empty_phase():
    phases = _phases(50, [0, 1, 1])
    assert len(phases[0]) == 0
    assert len(phases[1]) + len(phases[2]) == 50
    assert len(_phases(50, [0, 0, 5])[2]) == 50


@pytest.mark.parametrize("num_rows", [0, 1, 2])
def test_tiny_datasets(num_rows):
    phases = _phases(num_rows, [2, 4, 4])
    assert sum(len(p) for p in phases) == num_rows
    # 1 row: boundaries round(0.2)=0, round(0.6)=1 -> the reward phase holds it
    if num_rows == 1:
        assert [len(p) for p in phases] == [0, 1, 0]


def test_deterministic_and_seeded():
    a = phase_indices(500, [2, 4, 4], 1, seed=7)
    np.testing.assert_array_equal(a, phase_indices(500, [2, 4, 4], 1, seed=7))
    assert not np.array_equal(a, phase_indices(500, [2, 4, 4], 1, seed=8))


def test_depends_only_on_its_arguments():
    expected = phase_indices(300, [2, 4, 4], 2, seed=3)
    np.random.seed(0)  # the global RNG and earlier calls must not matter
    np.random.rand(10)
    phase_indices(999, [1, 1, 1], 0, seed=5)
    np.testing.assert_array_equal(phase_indices(300, (2.0, 4.0, 4.0), 2, seed=3), expected)
    # scaling the weights does not change the split
    np.testing.assert_array_equal(phase_indices(300, [1, 2, 2], 2, seed=3), expected)


def test_same_permutation_as_deepspeed_chat():
    # DeepSpeed-Chat's get_shuffle_idx: RandomState(seed).shuffle(arange(size, dtype=uint32))
    shuffle_idx = np.arange(100, dtype=np.uint32)
    np.random.RandomState(1234).shuffle(shuffle_idx)
    # with all the weight on one phase, that phase is the whole permutation, sorted
    np.testing.assert_array_equal(phase_indices(100, [0, 1, 0], 1, 1234), np.arange(100))
    # the first chunk (2/10 of 100 rows) is the first 20 shuffled indices
    np.testing.assert_array_equal(phase_indices(100, [2, 4, 4], 0, 1234), np.sort(shuffle_idx[:20]))


@pytest.mark.parametrize(
    ("num_rows", "weights", "phase"),
    [
        (-1, [2, 4, 4], 0),
        (10, [2, 4, 4], 3),
        (10, [2, 4, 4], -1),
        (10, [0, 0, 0], 0),
        (10, [1, -1, 1], 0),
    ],
)
def test_phase_indices_rejects_bad_arguments(num_rows, weights, phase):
    with pytest.raises(ValueError):
        phase_indices(num_rows, weights, phase, 0)


@pytest.mark.parametrize("num_rows", [0, 1, 2, 3, 9, 10, 11, 1000])
@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.5, 0.99])
def test_train_eval_partition(num_rows, fraction):
    train, eval_ = train_eval_indices(num_rows, fraction, seed=1234)
    assert sorted([*train.tolist(), *eval_.tolist()]) == list(range(num_rows))
    assert not set(train.tolist()) & set(eval_.tolist())
    assert np.all(np.diff(train) > 0) and np.all(np.diff(eval_) > 0)
    if num_rows >= 2:
        assert 1 <= len(eval_) <= num_rows - 1
    else:
        assert len(eval_) == 0 and len(train) == num_rows


def test_train_eval_sizes_and_determinism():
    train, eval_ = train_eval_indices(1000, 0.1, seed=5)
    assert (len(train), len(eval_)) == (900, 100)
    again = train_eval_indices(1000, 0.1, seed=5)
    np.testing.assert_array_equal(eval_, again[1])
    assert not np.array_equal(eval_, train_eval_indices(1000, 0.1, seed=6)[1])
    # like DeepSpeed-Chat's "9,1" train_eval split: eval is the last chunk of the permutation
    perm = np.random.RandomState(5).permutation(1000)
    np.testing.assert_array_equal(eval_, np.sort(perm[900:]))


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_train_eval_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match="eval_fraction"):
        train_eval_indices(10, fraction, 0)
