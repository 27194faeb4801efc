"""moa: Mixture-of-Attention-heads models for fairseq (``fairseq-train --user-dir moa``).

Importing the package registers the ``moa_transformer``, ``moa_roberta``, ``moa_lm``,
``moh_transformer``, ``moh_roberta``, ``moh_lm``, ``switchhead_transformer`` and ``switchhead_lm`` models
and their archs (and the Transformer twin
``transformer_lm_small``) and the ``moa_label_smoothed_cross_entropy``, ``moa_masked_lm`` and
``moa_cross_entropy`` criterions, and applies the plugin's changes to fairseq (:mod:`moa.fairseq_fixes.patches`:
the safe loader's allow-list, damaged-checkpoint errors, data parallelism on CPU ranks), and gives torch's
FLOP counter the formulas it lacks for the ops moa runs (:mod:`moa.flops`). The data
preparation and scoring tools are the separate ``moa_tools`` package.

The attention layers import torch alone: :mod:`moa.moa_attention`, :mod:`moa.moh_attention` and
:mod:`moa.switchhead_attention` with what they are built of (:mod:`moa.routing`, :mod:`moa.dispatch`,
:mod:`moa.experts`, :mod:`moa.routed_attention`, :mod:`moa.incremental_state`) serve any torch program; where
fairseq is not installed, importing ``moa`` registers nothing with it.
"""

from moa import flops

flops.register()

try:
    import fairseq
except ImportError:  # the layers alone (see above)
    fairseq = None

if fairseq is not None:
    from moa.fairseq_fixes import patches

    patches.apply()

    from moa import criterions  # noqa: F401
    from moa.models import (moa_lm, moa_roberta, moa_transformer, moh_lm, moh_roberta,  # noqa: F401
                            moh_transformer, switchhead_lm, switchhead_transformer)
