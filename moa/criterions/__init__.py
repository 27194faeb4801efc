"""Criterions; fairseq does not import a user dir's criterions by itself."""

from moa.criterions import moa_label_smoothed_cross_entropy  # noqa: F401
from moa.criterions import moa_masked_lm  # noqa: F401,E402
from moa.criterions import moa_cross_entropy  # noqa: F401,E402
