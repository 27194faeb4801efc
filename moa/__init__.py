"""moa: Mixture-of-Attention-heads models for fairseq.

Use it as a fairseq plugin: ``fairseq-train --user-dir moa --arch moa_base ...``.
Importing the package registers the ``moa_transformer`` model and its archs,
the ``moa_label_smoothed_cross_entropy`` criterion, and the allow-list that
torch's safe checkpoint loader needs for fairseq checkpoints.
"""

from moa.checkpoint_safety import allow_fairseq_checkpoint_globals

allow_fairseq_checkpoint_globals()

from moa import criterions  # noqa: E402,F401
from moa.models import moa_roberta, moa_transformer  # noqa: E402,F401
