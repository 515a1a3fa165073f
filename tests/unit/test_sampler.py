"""ResumableDistributedSampler: coverage, determinism, equal shards, O(1) resume."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from trainer.data import ResumableDistributedSampler


def shards(n: int, ranks: int, seed: int = 0, epoch: int = 0, shuffle: bool = True) -> list[list[int]]:
    out = []
    for rank in range(ranks):
        sampler = ResumableDistributedSampler(n, ranks, rank, seed=seed, shuffle=shuffle)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_sample_once_per_epoch_when_divisible(ranks):
    n = 12
    parts = shards(n, ranks, seed=7)
    assert all(len(p) == n // ranks for p in parts)
    seen = [i for p in parts for i in p]
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize(("n", "ranks"), [(11, 2), (10, 3), (11, 3), (2, 3), (1, 3)])
def test_remainder_wraps_to_start_of_permutation(n, ranks):
    sampler = ResumableDistributedSampler(n, ranks, 0, seed=3)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()
    parts = shards(n, ranks, seed=3)
    per_rank = -(-n // ranks)
    pad = per_rank * ranks - n
    assert all(len(p) == per_rank == len(sampler) for p in parts)
    counts = Counter(i for p in parts for i in p)
    assert set(counts) == set(range(n))  # nothing dropped
    # Exactly the first `pad` indices of the epoch's permutation are seen one extra time.
    wrapped = [perm[i % n] for i in range(pad)]
    expected = Counter(range(n))
    expected.update(wrapped)
    assert counts == expected
    assert sum(counts.values()) - n == pad <= ranks - 1


def test_duplicates_land_on_the_last_step_of_the_higher_ranks():
    # n=10, 3 ranks: padded to 12; positions 10 and 11 (ranks 1 and 2, last step) repeat perm[0:2].
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0)).tolist()
    parts = shards(10, 3, seed=0)
    assert parts[0] == perm[0:10:3]
    assert parts[1] == [*perm[1:10:3], perm[0]]
    assert parts[2] == [*perm[2:10:3], perm[1]]


def test_same_seed_same_order_different_epoch_or_seed_different_order():
    assert shards(50, 2, seed=1, epoch=0) == shards(50, 2, seed=1, epoch=0)
    assert shards(50, 2, seed=1, epoch=0) != shards(50, 2, seed=1, epoch=1)
    assert shards(50, 2, seed=1, epoch=0) != shards(50, 2, seed=2, epoch=0)


def test_no_shuffle_is_strided_identity():
    assert shards(7, 2, shuffle=False) == [[0, 2, 4, 6], [1, 3, 5, 0]]


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_resume_mid_epoch_continues_with_exactly_the_next_samples(ranks):
    n, epoch, start = 23, 4, 5
    for rank in range(ranks):
        full = ResumableDistributedSampler(n, ranks, rank, seed=11)
        full.set_epoch(epoch)
        uninterrupted = list(full)
        resumed = ResumableDistributedSampler(n, ranks, rank, seed=11)
        resumed.set_epoch(epoch, start)
        assert list(resumed) == uninterrupted[start:]
        assert len(resumed) == len(uninterrupted) - start


def test_state_dict_round_trip_resumes_in_a_new_sampler():
    a = ResumableDistributedSampler(40, 2, 1, seed=5)
    a.set_epoch(3, 7)
    state = a.state_dict()
    assert state == {"epoch": 3, "start": 7, "seed": 5, "num_replicas": 2}
    b = ResumableDistributedSampler(40, 2, 1, seed=0)
    b.load_state_dict(state)
    assert list(b) == list(a)
    assert (b.epoch, b.start, b.seed) == (3, 7, 5)


def test_resume_on_a_different_world_size_skips_nothing():
    n, epoch = 30, 2
    # 2 ranks consumed 4 samples each: the first 8 positions of the epoch's permutation.
    old = ResumableDistributedSampler(n, 2, 0, seed=9)
    old.set_epoch(epoch, 4)
    consumed_positions = 8
    perm = old.permutation(epoch).tolist()
    rest = []
    for rank in range(3):
        new = ResumableDistributedSampler(n, 3, rank, seed=0)
        new.load_state_dict(old.state_dict())
        assert new.start == consumed_positions // 3
        rest.extend(new)
    replayed = perm[(consumed_positions // 3) * 3 : consumed_positions]
    assert sorted(rest) == sorted(replayed + perm[consumed_positions:])


def test_resume_through_a_dataloader_gives_the_remaining_batches():
    n, batch = 20, 3
    full = ResumableDistributedSampler(n, 2, 0, seed=1)
    batches = [b.tolist() for b in DataLoader(range(n), batch_size=batch, sampler=full)]
    # Two batches consumed -> the trainer records start = 6 samples for this rank.
    resumed = ResumableDistributedSampler(n, 2, 0, seed=1)
    resumed.set_epoch(0, 2 * batch)
    rest = [b.tolist() for b in DataLoader(range(n), batch_size=batch, sampler=resumed)]
    assert rest == batches[2:]


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="rank must be in \\[0, 1\\], got 2"):
        ResumableDistributedSampler(10, 2, 2)
    with pytest.raises(ValueError, match="dataset_len must be at least 1, got 0"):
        ResumableDistributedSampler(0, 2, 0)
    s = ResumableDistributedSampler(10, 2, 0)
    with pytest.raises(ValueError, match="start must be in \\[0, 5\\] \\(samples per rank\\), got 6"):
        s.set_epoch(0, 6)
    s.set_epoch(0, 5)
    assert len(s) == 0 and list(s) == []


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 200),
    ranks=st.integers(1, 8),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 50),
    start_frac=st.floats(0, 1),
)
def test_property_shards_cover_permutation_and_resume_is_a_suffix(n, ranks, seed, epoch, start_frac):
    parts = shards(n, ranks, seed=seed, epoch=epoch)
    per_rank = -(-n // ranks)
    assert all(len(p) == per_rank for p in parts)
    assert set(i for p in parts for i in p) == set(range(n))
    assert sum(map(len, parts)) - n < ranks
    start = int(start_frac * per_rank)
    for rank in range(ranks):
        s = ResumableDistributedSampler(n, ranks, rank, seed=seed)
        s.set_epoch(epoch, start)
        assert list(s) == parts[rank][start:]


# ---- train_sampling_strategy="group_by_length" ---------------------------------------------------


def grouped(
    n: int, ranks: int, rank: int, lengths: list[int], group: int, seed: int = 0
) -> ResumableDistributedSampler:
    return ResumableDistributedSampler(n, ranks, rank, seed=seed, lengths=lengths, group_size=group)


@pytest.mark.parametrize(("n", "group"), [(1000, 4), (37, 4), (10, 8), (3, 2)])
def test_length_grouped_order_is_hfs_length_grouped_sampler_on_one_rank(n, group):
    """HF's LengthGroupedSampler over the same permutation: megabatches of min(n // 4g, 50) groups
    (at least one), each sorted longest first, the longest sample of all in front."""
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = torch.randint(1, 40, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for epoch in (0, 1):
        sampler = grouped(n, 1, 0, lengths, group, seed=5)
        sampler.set_epoch(epoch)
        hf = get_length_grouped_indices(lengths, group, generator=torch.Generator().manual_seed(5 + epoch))
        assert list(sampler) == hf
        assert lengths[hf[0]] == max(lengths)
    if n == 1000:  # megabatches of 50 groups, sorted longest first (but for the one swapped to the front)
        order = list(grouped(n, 1, 0, lengths, group))
        for start in range(0, n, 200):
            megabatch = [lengths[i] for i in order[start + 1 : start + 200]]
            assert megabatch == sorted(megabatch, reverse=True)


@pytest.mark.parametrize("ranks", [2, 3])
def test_length_grouped_order_is_sharded_like_the_random_one(ranks):
    """Ranks take interleaved positions of the one grouped order (so a step's samples have similar
    lengths on every rank), padded to equal shards."""
    n, lengths = 50, [i % 17 + 1 for i in range(50)]
    whole = grouped(n, 1, 0, lengths, 6).permutation().tolist()
    parts = [list(grouped(n, ranks, r, lengths, 6)) for r in range(ranks)]
    padded = [*whole, *whole][: -(-n // ranks) * ranks]
    assert [i for step in zip(*parts, strict=True) for i in step] == padded


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(2, 2), (2, 3), (3, 1)])
def test_length_grouped_order_resumes_mid_epoch_on_any_world_size(saved_on, resumed_on):
    """A resume slices the same order: nothing consumed is skipped, the rest follows in order (on
    another world size, at most ranks - 1 consumed samples are seen again, as with the random order)."""
    n, lengths, start = 40, [(7 * i) % 23 + 1 for i in range(40)], 5
    order = grouped(n, 1, 0, lengths, 8).permutation().tolist()
    before = grouped(n, saved_on, 0, lengths, 8)
    before.set_epoch(0, start)
    after = [grouped(n, resumed_on, r, lengths, 8) for r in range(resumed_on)]
    for sampler in after:
        sampler.load_state_dict(before.state_dict())
    rest = [i for step in zip(*map(list, after), strict=True) for i in step]
    consumed = after[0].start * resumed_on
    assert consumed <= start * saved_on < consumed + resumed_on
    assert rest == [*order, *order][consumed : -(-n // resumed_on) * resumed_on]
