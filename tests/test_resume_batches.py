"""A run resumed in a later epoch trains on the batches of the run it continues.

fairseq-fixed groups the training sentences into batches with numpy seeded by ``seed + epoch`` of the
epoch in which the batch iterator is created, and reuses that iterator for every later epoch. A
straight run creates it in epoch 1; a resumed run used to create it in the epoch it resumed in, and
so trained on other batches (the first update after an end-of-epoch checkpoint already differed).
The plugin builds a resumed iterator as epoch 1 does (:mod:`moa.fairseq_fixes.crash_safe_training`).
"""

import numpy as np
import torch
from fairseq.data import Dictionary, LanguagePairDataset
from fairseq.tasks.fairseq_task import FairseqTask
from fairseq.tasks.translation import TranslationConfig, TranslationTask

import moa  # noqa: F401  (installs the plugin's patches)


def _task_and_dataset():
    dictionary = Dictionary()
    for i in range(20):
        dictionary.add_symbol(f"w{i}")
    rng = np.random.RandomState(0)
    lengths = rng.randint(3, 8, size=200)  # many sentences of each length: the grouping depends on the seed
    sentences = [torch.tensor(rng.randint(4, 24, size=n).tolist() + [dictionary.eos()]) for n in lengths]
    sizes = np.array([len(s) for s in sentences])
    dataset = LanguagePairDataset(sentences, sizes, dictionary, sentences, sizes, dictionary, shuffle=True)
    return TranslationTask(TranslationConfig(), dictionary, dictionary), dataset


def _batches(get_batch_iterator, epoch):
    task, dataset = _task_and_dataset()
    iterator = get_batch_iterator(task, dataset, max_tokens=64, seed=3, epoch=epoch)
    return [tuple(batch) for batch in iterator.frozen_batches], iterator


def test_an_iterator_made_for_a_later_epoch_has_the_first_epochs_batches_and_its_epoch():
    first, straight = _batches(FairseqTask.get_batch_iterator, epoch=1)
    resumed, iterator = _batches(FairseqTask.get_batch_iterator, epoch=3)
    assert resumed == first
    assert iterator.epoch == 3 and iterator.next_epoch_idx == 3
    # epoch 3 visits those batches in the order the straight run's epoch 3 does
    assert [tuple(b) for b in iterator.ordered_batches(3, False, True)] == \
        [tuple(b) for b in straight.ordered_batches(3, False, True)]


def test_plain_fairseq_groups_a_resumed_run_into_other_batches():
    first, _ = _batches(FairseqTask.get_batch_iterator.__wrapped__, epoch=1)
    resumed, _ = _batches(FairseqTask.get_batch_iterator.__wrapped__, epoch=3)
    assert sorted(map(sorted, resumed)) != sorted(map(sorted, first))
