"""moa: Mixture-of-Attention-heads models for fairseq (``fairseq-train --user-dir moa``).

Importing the package registers the ``moa_transformer``, ``moa_roberta``, ``moh_transformer`` and
``moh_roberta`` models and their archs and the ``moa_label_smoothed_cross_entropy`` and
``moa_masked_lm`` criterions, and applies the plugin's changes to fairseq (:mod:`moa.fairseq_patches`:
the safe loader's allow-list, damaged-checkpoint errors, data parallelism on CPU ranks). The data
preparation and scoring tools are the separate ``moa_tools`` package.
"""

from moa import fairseq_patches

fairseq_patches.apply()

from moa import criterions  # noqa: E402,F401
from moa.models import moa_roberta, moa_transformer, moh_roberta, moh_transformer  # noqa: E402,F401
