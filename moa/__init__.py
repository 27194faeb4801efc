"""moa: Mixture-of-Attention-heads models for fairseq (``fairseq-train --user-dir moa``).

Importing the package registers the ``moa_transformer``, ``moa_roberta``, ``moh_transformer`` and
``moh_roberta`` models and their archs, the ``moa_label_smoothed_cross_entropy`` and ``moa_masked_lm`` criterions, and the
allow-list that torch's safe checkpoint loader needs for fairseq checkpoints (and a clear error for a
damaged one), and makes fairseq's data-parallel training run on CPU processes under torchrun
(:mod:`moa.distributed`). The data preparation and scoring tools are the separate ``moa_tools`` package.
"""

from moa.checkpoint_safety import allow_fairseq_checkpoint_globals, fail_clearly_on_damaged_checkpoints
from moa.distributed import enable_cpu_data_parallel

allow_fairseq_checkpoint_globals()
fail_clearly_on_damaged_checkpoints()
enable_cpu_data_parallel()

from moa import criterions  # noqa: E402,F401
from moa.models import moa_roberta, moa_transformer, moh_roberta, moh_transformer  # noqa: E402,F401
