"""The last batch fairseq drops for not being a multiple of --required-batch-size-multiple: kept for an evaluated
split, fairseq's rule for training batches and under MOA_EVALUATION_BATCHES=fairseq (the CLIs:
tests/test_every_sentence.py)."""

import numpy as np
import pytest
from fairseq.data import FairseqDataset

from moa.fairseq_fixes import every_sentence


class Lengths(FairseqDataset):
    """A split of sentences of the given lengths, nothing else."""

    def __init__(self, sizes):
        self.sizes = np.asarray(sizes, dtype=np.int64)

    def __len__(self):
        return len(self.sizes)

    def num_tokens(self, index):
        return int(self.sizes[index])

    def num_tokens_vec(self, indices):
        return self.sizes[indices]

    def size(self, index):
        return int(self.sizes[index])


def _batches(dataset, **kwargs):
    order = np.argsort(dataset.sizes, kind="stable")
    return order, dataset.batch_by_size(order, max_tokens=200, required_batch_size_multiple=8, **kwargs)


def test_an_evaluated_split_keeps_its_last_batch_in_length_order():
    dataset = Lengths(np.random.RandomState(0).randint(3, 40, size=37))
    order, batches = _batches(dataset)
    assert np.array_equal(np.concatenate(batches), order)  # every sentence, in fairseq's order
    # fairseq's rule for every batch but the kept one: under 8 sentences or a multiple of 8
    assert all(len(b) % 8 == 0 or len(b) < 8 for b in batches[:-1]) and len(batches[-1]) % 8
    assert dataset.sizes[batches[-1]].min() >= dataset.sizes[np.concatenate(batches[:-1])].max()  # the longest


def test_training_batches_and_the_fairseq_rule_drop_it_as_fairseq_does(monkeypatch):
    dataset = Lengths(np.random.RandomState(0).randint(3, 40, size=37))
    order, kept = _batches(dataset)
    token = every_sentence._BUILDING_TRAINING_BATCHES.set(True)
    try:
        _, training = _batches(dataset)
    finally:
        every_sentence._BUILDING_TRAINING_BATCHES.reset(token)
    assert [list(b) for b in training] == [list(b) for b in kept[:-1]]
    assert every_sentence.evaluation_rule() == every_sentence.EVERY_SENTENCE
    with every_sentence.fairseq_evaluation_batches():
        assert every_sentence.evaluation_rule() == every_sentence.FAIRSEQ_RULE
        _, fairseq_rule = _batches(dataset)
    assert [list(b) for b in fairseq_rule] == [list(b) for b in kept[:-1]]
    assert every_sentence.evaluation_rule() == every_sentence.EVERY_SENTENCE
