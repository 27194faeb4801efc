"""Every sentence of an evaluated split, whatever ``--required-batch-size-multiple`` says.

fairseq's ``data_utils.batch_by_size`` drops the last batch of a split when its size is not a multiple of
``--required-batch-size-multiple`` (default 8; fairseq issue #5036). Batches are built in length order, so
what goes is that last batch, the longest sentences, silently: fairseq-generate translates fewer sentences than
the split holds, and the validation loss that fairseq-train prints, picks ``checkpoint_best.pt`` with and
counts ``--patience`` on, and fairseq-validate's leave them out (a split that fits in one batch loses every
sentence unless it holds a multiple of 8). (fairseq-eval-lm batches with a multiple of 1 whatever the flag
says.)

With the plugin loaded, :func:`keeping_the_last_batch` keeps that batch for every split but the one
``fairseq-train`` trains on (the batches :func:`marking_training_batches` builds). Training keeps
fairseq's rule, so that recorded runs train on the same batches: at the default multiple of 8 an epoch
leaves out the last batch of the length order (the longest sentences) when its size is no multiple of
8; ``--required-batch-size-multiple 1`` trains on every sentence (and makes batches of any size).

``MOA_EVALUATION_BATCHES=fairseq`` in the environment (:func:`fairseq_evaluation_batches`) evaluates by
fairseq's rule again: for figures recorded before the plugin kept the last batch, which a study compares
with (:func:`evaluation_rule` names the rule in force).
"""

import contextlib
import contextvars
import logging
import os
import weakref

import numpy as np

logger = logging.getLogger(__name__)

EVALUATION_BATCHES = "MOA_EVALUATION_BATCHES"  # "fairseq": evaluate by fairseq's rule
EVERY_SENTENCE = "every sentence"
FAIRSEQ_RULE = "fairseq's: a last batch of no multiple of --required-batch-size-multiple dropped"
_BUILDING_TRAINING_BATCHES = contextvars.ContextVar("moa_building_training_batches", default=False)
_TRAINING_DATASETS: "weakref.WeakSet" = weakref.WeakSet()  # datasets a trainer iterates (lazily rebuilt batches)


def marking_training_batches(get_train_iterator):
    """fairseq's ``Trainer.get_train_iterator``, its batches marked as training batches (fairseq's rule)."""

    def wrapper(self, *args, **kwargs):
        token = _BUILDING_TRAINING_BATCHES.set(True)
        try:
            iterator = get_train_iterator(self, *args, **kwargs)
        finally:
            _BUILDING_TRAINING_BATCHES.reset(token)
        dataset = iterator.dataset
        while dataset is not None:  # a wrapper and the datasets it wraps, whose batch_by_size it calls
            _TRAINING_DATASETS.add(dataset)
            dataset = getattr(dataset, "dataset", None)
        return iterator

    return wrapper


def keeping_the_last_batch(batch_by_size):
    """fairseq's ``FairseqDataset.batch_by_size``, with the last batch that it drops for not being a multiple
    of ``required_batch_size_multiple`` kept, except for training batches."""

    def wrapper(self, indices, max_tokens=None, max_sentences=None, required_batch_size_multiple=1):
        batches = batch_by_size(self, indices, max_tokens=max_tokens, max_sentences=max_sentences,
                                required_batch_size_multiple=required_batch_size_multiple)
        if (required_batch_size_multiple <= 1 or _BUILDING_TRAINING_BATCHES.get() or self in _TRAINING_DATASETS
                or self.get_batch_shapes() is not None  # fixed shapes: fairseq's own rule, no tail to keep
                or evaluation_rule() == FAIRSEQ_RULE):
            return batches
        batched = sum(len(batch) for batch in batches)
        if batched == len(indices):
            return batches
        tail = np.asarray(indices[batched:], dtype=np.int64)
        logger.info(f"kept the last batch of {len(tail)} sentences, which fairseq drops for not being a multiple of "
                    f"--required-batch-size-multiple {required_batch_size_multiple}: every sentence is evaluated")
        return list(batches) + [tail]

    return wrapper


def evaluation_rule() -> str:
    """The rule evaluated splits are batched by in this process and the processes it starts."""
    return FAIRSEQ_RULE if os.environ.get(EVALUATION_BATCHES) == "fairseq" else EVERY_SENTENCE


@contextlib.contextmanager
def fairseq_evaluation_batches():
    """Within the block, this process and the fairseq processes it starts evaluate by fairseq's rule."""
    before = os.environ.get(EVALUATION_BATCHES)
    os.environ[EVALUATION_BATCHES] = "fairseq"
    try:
        yield
    finally:
        if before is None:
            del os.environ[EVALUATION_BATCHES]
        else:
            os.environ[EVALUATION_BATCHES] = before
