"""Every change the plugin makes to fairseq (and to torch's loader and Python's excepthook), in one place.

fairseq 0.12 has no hooks for what follows, so the plugin replaces twenty of its attributes, and Python's
``sys.excepthook``, when it is imported, each by a function or class that wraps the original:

========================================================  ==========================================
replaced                                                  why
========================================================  ==========================================
``fairseq.checkpoint_utils.load_checkpoint_to_cpu``       check the file's CRC-32s on the bytes then
                                                          loaded (one read), so a truncated or corrupt
                                                          checkpoint is refused by name with the fix
                                                          (train, generate, validate, interactive)
``fairseq.distributed.utils.infer_init_method``           data parallelism on CPU ranks under
                                                          torchrun; an error instead of training
                                                          nothing without it
``fairseq.distributed.utils.broadcast_object``            the other ranks of a resumed data-parallel
                                                          run may unpickle the training state
``fairseq.models.distributed_fairseq_model``              torch's DDP refuses the CUDA device ids
``.DistributedDataParallel``                              fairseq passes for a CPU module
``fairseq.tasks.fairseq_task.FairseqTask``                a run resumed in a later epoch gets the
``.get_batch_iterator``                                   batches of the run it continues
``fairseq.data.data_utils.load_indexed_dataset``          a damaged data-bin is named with the fix: a
                                                          truncated, extended, swapped or missing .idx
                                                          or .bin, an empty split, token ids beyond
                                                          the dictionary
``fairseq.data.indexed_dataset.dataset_exists``           a split with its .idx or .bin alone missing
                                                          names the missing file
``fairseq.data.dictionary.Dictionary.add_from_file``      a missing, empty, non-UTF-8 or malformed
                                                          dictionary file is named
``fairseq.data.language_pair_dataset``                    a language pair's two sides of different
``.LanguagePairDataset.__init__``                         lengths are named (fairseq asserts)
``sys.excepthook``                                        those errors and a damaged checkpoint end the
                                                          program as one line, not a traceback
``fairseq.data.fairseq_dataset.FairseqDataset``           every sentence of an evaluated split: the
``.batch_by_size``                                        last batch, which fairseq drops when its size
                                                          is no multiple of
                                                          ``--required-batch-size-multiple``, is kept
                                                          (validation, generate, validate, eval-lm)
``fairseq.trainer.Trainer.get_train_iterator``            ... except for training batches, so that
                                                          recorded runs train on the same batches
``fairseq.checkpoint_utils.PathManager``                  checkpoint copies are atomic and flushed,
                                                          so a kill never leaves half a file
``fairseq.trainer.Trainer.load_checkpoint``               a damaged checkpoint_last.pt resumes from
                                                          the newest complete one of its run
``fairseq.trainer.Trainer.save_checkpoint``,              ``--patience`` counts on after a resume:
``fairseq.checkpoint_utils.load_checkpoint``              checkpoints keep its count, a resume
                                                          sets it again
``fairseq_cli.train.train``                               a finished run stays finished: no update,
                                                          nothing written, ``main`` returns
``fairseq.distributed.utils.call_main``                   ``--bf16`` trains on the GPU or CPU without
                                                          torch_xla (fairseq takes it to mean a TPU)
``fairseq.models.fairseq_model.BaseFairseqModel``         ``--bf16`` inference (generate, interactive,
``.prepare_for_inference_``                               eval-lm) runs in bfloat16, as ``--fp16``
                                                          runs in float16
``fairseq.data.token_block_dataset.np``,                  numpy 2 has no ``np.compat.long``, which
``fairseq.data.language_pair_dataset.np``                 these two modules name (fairseq-interactive
                                                          on a language model failed): their numpy
                                                          gains it, numpy itself is left alone
========================================================  ==========================================

:mod:`moa.fairseq_fixes.crash_safe_training` explains the checkpoint and batch patches, :mod:`moa.fairseq_fixes.precision` the
bfloat16 ones.

It also registers with torch's weights-only unpickler exactly the classes fairseq checkpoints hold
(:func:`~moa.fairseq_fixes.checkpoint_safety.fairseq_checkpoint_globals`), and undoes a side effect of importing
fairseq: its ``wav2vec2_classification`` and text-to-speech modules call ``logging.basicConfig(level=
DEBUG)`` when imported, which turns on debug logging in any program that imports fairseq before
configuring logging itself (fairseq's own CLIs configure it first, so nothing changes there).
:func:`apply` does all of it, once (importing the plugin twice changes nothing), and logs each
replacement at debug level.
"""

import importlib
import logging
import sys
import types
from typing import Callable, NamedTuple

logger = logging.getLogger(__name__)


class Patch(NamedTuple):
    module: str
    attribute: str
    replacement: Callable  # fairseq's original -> what replaces it
    why: str


def _patches():
    from moa.fairseq_fixes import (checkpoint_safety, crash_safe_training, damaged_data, distributed, every_sentence,
                                   named_errors, precision)

    return [
        Patch("fairseq.checkpoint_utils", "load_checkpoint_to_cpu", checkpoint_safety.checked_checkpoint_loader,
              "a damaged checkpoint is refused by name, with the fix"),
        Patch("fairseq.distributed.utils", "infer_init_method", distributed.torchrun_aware_init_method,
              "data-parallel training on CPU ranks under torchrun"),
        Patch("fairseq.distributed.utils", "broadcast_object", distributed.broadcast_with_state_globals,
              "resumed data-parallel ranks may unpickle the broadcast training state"),
        Patch("fairseq.models.distributed_fairseq_model", "DistributedDataParallel",
              lambda fairseq_ddp: distributed.CPUAwareDistributedDataParallel,
              "torch's DDP without CUDA device ids for a CPU module"),
        Patch("fairseq.tasks.fairseq_task", "FairseqTask.get_batch_iterator",
              crash_safe_training.batches_as_from_the_first_epoch,
              "a run resumed in a later epoch gets the batches of the run it continues"),
        Patch("fairseq.data.data_utils", "load_indexed_dataset", damaged_data.checked_loading,
              "a truncated, swapped or missing .idx/.bin, an empty split or a foreign dictionary is named"),
        Patch("fairseq.data.indexed_dataset", "dataset_exists", damaged_data.checked_split_exists,
              "a split with one of its .idx/.bin missing names the missing file"),
        Patch("fairseq.data.dictionary", "Dictionary.add_from_file", damaged_data.checked_dictionary_file,
              "a missing, empty, non-UTF-8 or malformed dictionary file is named"),
        Patch("fairseq.data.language_pair_dataset", "LanguagePairDataset.__init__",
              damaged_data.checked_language_pair, "a language pair's sides of different lengths are named"),
        Patch("sys", "excepthook", named_errors.printing_named_errors,
              "a damaged checkpoint or data-bin ends the program as one line, not a traceback"),
        Patch("fairseq.data.fairseq_dataset", "FairseqDataset.batch_by_size", every_sentence.keeping_the_last_batch,
              "every sentence of an evaluated split: the last batch fairseq drops is kept"),
        Patch("fairseq.trainer", "Trainer.get_train_iterator", every_sentence.marking_training_batches,
              "training batches keep fairseq's rule, so that recorded runs train on the same batches"),
        Patch("fairseq.checkpoint_utils", "PathManager", crash_safe_training.atomic_path_manager,
              "checkpoint copies are atomic and flushed"),
        Patch("fairseq.trainer", "Trainer.load_checkpoint", crash_safe_training.resuming_past_damage,
              "a damaged checkpoint_last.pt resumes from the newest complete one of its run"),
        Patch("fairseq.trainer", "Trainer.save_checkpoint", crash_safe_training.saving_patience,
              "checkpoints keep --patience's count of validations without improvement"),
        Patch("fairseq.checkpoint_utils", "load_checkpoint", crash_safe_training.restoring_patience,
              "a resumed run goes on counting --patience where it stopped"),
        Patch("fairseq_cli.train", "train", crash_safe_training.stopping_finished_runs,
              "a finished run stays finished: no update, nothing written"),
        Patch("fairseq.distributed.utils", "call_main", precision.call_main_without_xla,
              "--bf16 trains on the GPU or CPU without torch_xla (fairseq takes it to mean a TPU)"),
        Patch("fairseq.models.fairseq_model", "BaseFairseqModel.prepare_for_inference_",
              precision.prepare_for_inference_in_bf16, "--bf16 inference runs in bfloat16"),
        Patch("fairseq.data.token_block_dataset", "np", numpy_with_compat_long,
              "numpy 2 dropped np.compat.long, which fairseq-interactive's language-model path names"),
        Patch("fairseq.data.language_pair_dataset", "np", numpy_with_compat_long,
              "numpy 2 dropped np.compat.long, which this module names"),
    ]


class _NumpyWithCompatLong(types.ModuleType):
    """numpy as a fairseq module sees it: every attribute numpy's, plus ``compat.long`` (int64)."""

    def __init__(self, numpy):
        super().__init__(numpy.__name__)
        self._numpy = numpy
        self.compat = types.SimpleNamespace(long=numpy.int64)

    def __getattr__(self, name):
        return getattr(self._numpy, name)


def numpy_with_compat_long(numpy):
    """numpy itself where it still has ``np.compat`` (numpy 1), else :class:`_NumpyWithCompatLong`."""
    if hasattr(numpy, "compat") or isinstance(numpy, _NumpyWithCompatLong):
        return numpy
    return _NumpyWithCompatLong(numpy)


def apply() -> None:
    """Install every patch of :func:`_patches` that is not installed yet, and the checkpoint allow-list."""
    from moa.fairseq_fixes.checkpoint_safety import allow_fairseq_checkpoint_globals

    _import_keeping_logging("fairseq")
    allow_fairseq_checkpoint_globals()
    for patch in _patches():
        *owners, name = patch.attribute.split(".")
        owner = _import_keeping_logging(patch.module)
        for part in owners:  # a class's attribute: Class.method
            owner = getattr(owner, part)
        original = getattr(owner, name)
        if getattr(original, "__moa_patch__", False):
            continue
        replacement = patch.replacement(original)
        replacement.__moa_patch__ = True
        replacement.__wrapped__ = original
        setattr(owner, name, replacement)
        logger.debug("moa replaces %s.%s: %s", patch.module, patch.attribute, patch.why)


def _import_keeping_logging(module: str):
    """Import ``module``; if it (or fairseq with it) is imported for the first time, leave the root
    logger as it was before: two fairseq modules call ``logging.basicConfig(level=DEBUG)`` when imported,
    and ``fairseq_cli.train`` configures logging too."""
    if module in sys.modules:
        return sys.modules[module]
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    imported = importlib.import_module(module)
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(level)
    return imported
