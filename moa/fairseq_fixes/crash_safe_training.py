"""Training that survives being killed at any moment: exact resumes, complete checkpoint files, and a
finished run that stays finished. What :mod:`moa.fairseq_fixes.patches` installs into fairseq:

* **The same batches after a resume.** fairseq-fixed builds the training batches with numpy seeded by
  ``seed + epoch`` of the epoch in which the batch iterator is created, and a run reuses that iterator
  for every later epoch. A straight run creates it in epoch 1; a run resumed in epoch e > 1 created it
  in epoch e, so it grouped the sentences into other batches and the first update after the resume
  differed (for fairseq's own ``transformer`` too). :func:`batches_as_from_the_first_epoch` builds a
  reusable iterator as epoch 1 does and then moves it to epoch e. (Iterators that are rebuilt every
  epoch, as for sharded data, are left as fairseq makes them.)
* **Complete files only.** fairseq writes the first file of a save through a temporary name but then
  copies it to ``checkpoint_last.pt``, ``checkpoint_best.pt`` and the interval names with a plain copy,
  so a kill during a copy left a truncated ``checkpoint_last.pt``. :class:`AtomicPathManager` copies
  to a temporary name, flushes it to disk and renames it into place, and flushes every renamed file.
* **Resuming past a damaged file.** A truncated or corrupt ``checkpoint_last.pt`` (left by an older
  version, a full disk, a failing device) makes training continue from the newest complete checkpoint
  of the same run beside it (never another shard's), saying so on stderr, instead of stopping
  (:func:`resuming_past_damage`). The damage is found where fairseq reads the file, after fairseq's own
  checks of its flags (the checksums are verified on the bytes then loaded: the file is read once), so a
  fine-tuning run (``--finetune-from-model``) resumes as a plain one does.
* **Patience survives a resume.** fairseq counts the validations without improvement for ``--patience``
  in attributes of ``fairseq_cli.train.should_stop_early``, which no checkpoint kept: a resumed run
  counted from zero and trained up to ``--patience`` epochs longer than the run it continued.
  :func:`saving_patience` writes the count and its best loss into every checkpoint's extra state and
  :func:`restoring_patience` sets them again when a run resumes (as fairseq restores its best loss).
* **A finished run stays finished.** fairseq checks ``--max-update``, ``--stop-time-hours`` and
  ``--patience`` only after an update or a validation, so rerunning a finished command trained more and
  overwrote its checkpoints; now its epoch loop stops before the first update, saying the training is
  complete: nothing is trained or written, and ``fairseq_cli.train.main`` returns as a completed run's
  does (:func:`stopping_finished_runs`).
"""

import logging
import os
import sys

from moa.fairseq_fixes.atomic_files import atomic_copy, fsync_file

logger = logging.getLogger(__name__)


def batches_as_from_the_first_epoch(get_batch_iterator):
    """fairseq's ``FairseqTask.get_batch_iterator``, building a reusable iterator for a later epoch
    (a resume) with the batches a run from the first epoch builds."""

    def wrapper(self, dataset, *args, epoch=1, disable_iterator_cache=False, update_epoch_batch_itr=False,
                **kwargs):
        reusable = (not disable_iterator_cache and not update_epoch_batch_itr and self.can_reuse_epoch_itr(dataset)
                    and not getattr(self.cfg, "rebuild_batches", False))
        if not reusable or epoch <= 1 or dataset in self.dataset_to_epoch_iter:
            return get_batch_iterator(self, dataset, *args, epoch=epoch, disable_iterator_cache=disable_iterator_cache,
                                      update_epoch_batch_itr=update_epoch_batch_itr, **kwargs)
        iterator = get_batch_iterator(self, dataset, *args, epoch=1, disable_iterator_cache=disable_iterator_cache,
                                      update_epoch_batch_itr=update_epoch_batch_itr, **kwargs)
        iterator.epoch = epoch
        dataset.set_epoch(epoch)
        return iterator

    return wrapper


def atomic_path_manager(path_manager):
    """fairseq's ``PathManager`` (as ``checkpoint_utils`` sees it) with atomic, flushed copies and
    renames of local files."""

    class AtomicPathManager(path_manager):
        @staticmethod
        def copy(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
            if "://" in src_path or "://" in dst_path:
                return path_manager.copy(src_path, dst_path, overwrite)
            if os.path.exists(dst_path) and not overwrite:
                return False
            atomic_copy(src_path, dst_path)
            return True

        @staticmethod
        def rename(src: str, dst: str) -> None:
            if "://" not in src:
                fsync_file(src)
            return path_manager.rename(src, dst)

    return AtomicPathManager


def resuming_past_damage(load_checkpoint):
    """fairseq's ``Trainer.load_checkpoint``: when the run's own ``checkpoint_last`` (the default
    ``--restore-file``) turns out damaged as it is read, the newest complete checkpoint of the same run
    (its ``--checkpoint-suffix`` and shard) is loaded instead. Rank 0 reads and the other ranks receive
    what it loaded, as fairseq broadcasts it."""
    from moa.fairseq_fixes.checkpoint_safety import DamagedCheckpointError, run_checkpoints

    def wrapper(self, filename, *args, **kwargs):
        try:
            return load_checkpoint(self, filename, *args, **kwargs)
        except DamagedCheckpointError as error:
            checkpoint = self.cfg.checkpoint
            last = os.path.join(checkpoint.save_dir, f"checkpoint_last{self.checkpoint_suffix}.pt")
            if checkpoint.restore_file != "checkpoint_last.pt" or os.path.abspath(filename) != os.path.abspath(last):
                raise
            for candidate in run_checkpoints(checkpoint.save_dir, self.checkpoint_suffix):
                if os.path.abspath(candidate) == os.path.abspath(last):
                    continue
                print(f"fairseq-train: {error.path} is truncated or corrupt ({error.reason}); continuing from "
                      f"{candidate}, the newest checkpoint of this run beside it", file=sys.stderr, flush=True)
                try:
                    return load_checkpoint(self, candidate, *args, **kwargs)
                except DamagedCheckpointError as other:
                    error = other  # damaged too: the next older one
            raise RuntimeError(f"{last} is truncated or corrupt, and {checkpoint.save_dir} holds no other complete "
                               "checkpoint of this run: restore the file from a copy, or train again.") from error

    return wrapper


PATIENCE_STATE = "should_stop_early"  # the key of the patience count in a checkpoint's extra state


def patience_counter():
    """``fairseq_cli.train.should_stop_early``, whose attributes ``best`` and ``num_runs`` are fairseq's
    patience count; None where fairseq-train's module is not loaded (generate, a library caller)."""
    return getattr(sys.modules.get("fairseq_cli.train"), "should_stop_early", None)


def saving_patience(save_checkpoint):
    """fairseq's ``Trainer.save_checkpoint``, adding the patience count (``best``, ``num_runs``) of
    ``fairseq_cli.train.should_stop_early`` to the extra state when a validation has set it."""

    def wrapper(self, filename, extra_state, *args, **kwargs):
        counter = patience_counter()
        if getattr(counter, "best", None) is not None:
            extra_state = {**extra_state, PATIENCE_STATE: {"best": counter.best,
                                                           "num_runs": getattr(counter, "num_runs", 0)}}
        return save_checkpoint(self, filename, extra_state, *args, **kwargs)

    return wrapper


def restoring_patience(load_checkpoint):
    """fairseq's ``checkpoint_utils.load_checkpoint``, setting the saved patience count again on
    ``fairseq_cli.train.should_stop_early`` (unless the meters or the optimizer are reset, when fairseq
    forgets its best loss too)."""

    def wrapper(cfg, trainer, *args, **kwargs):
        extra_state, epoch_itr = load_checkpoint(cfg, trainer, *args, **kwargs)
        saved, counter = (extra_state or {}).get(PATIENCE_STATE), patience_counter()
        if saved and counter is not None and not cfg.reset_meters and not cfg.reset_optimizer:
            counter.best, counter.num_runs = saved["best"], saved["num_runs"]
        return extra_state, epoch_itr

    return wrapper


def stopping_finished_runs(train):
    """fairseq_cli.train's ``train`` (one epoch), which first stops a run whose stopping flags its
    checkpoint already meets: no update, no validation, no save, and ``main`` returns."""

    def wrapper(cfg, trainer, task, epoch_itr):
        finished = training_finished(trainer, epoch_itr)
        if finished:
            logger.info(f"training is complete: {finished}; nothing to train (change the stopping flags to "
                        "train further)")
            return [None], True
        return train(cfg, trainer, task, epoch_itr)

    return wrapper


def training_finished(trainer, epoch_itr):
    """Why a resumed run has nothing left to train (its stopping flags are met), or None."""
    optimization = trainer.cfg.optimization
    updates = trainer.get_num_updates()
    if optimization.max_update > 0 and updates >= optimization.max_update:
        return f"the checkpoint has {updates} updates, --max-update is {optimization.max_update}"
    max_epoch = optimization.max_epoch or float("inf")
    if epoch_itr.next_epoch_idx > max_epoch:
        return f"the checkpoint ends epoch {epoch_itr.next_epoch_idx - 1}, --max-epoch is {max_epoch}"
    patience = trainer.cfg.checkpoint.patience
    counter = patience_counter()
    if patience > 0 and getattr(counter, "num_runs", 0) >= patience:
        return (f"the validation loss has not improved for the checkpoint's last {counter.num_runs} validations, "
                f"--patience is {patience}")
    hours, trained = optimization.stop_time_hours, trainer.cumulative_training_time()
    if hours > 0 and trained >= hours * 3600:
        return f"the checkpoint has trained {trained / 3600:.2f} hours, --stop-time-hours is {hours}"
    return None
