"""Masked-LM cross-entropy plus the routers' auxiliary losses (same scaling rule as for translation)."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.masked_lm import MaskedLmConfig, MaskedLmLoss

from moa.criterions.aux_loss import RoutingLossConfig, RoutingLosses


@dataclass
class MoAMaskedLmConfig(MaskedLmConfig, RoutingLossConfig):
    pass


@register_criterion("moa_masked_lm", dataclass=MoAMaskedLmConfig)
class MoAMaskedLmLoss(RoutingLosses, MaskedLmLoss):
    """Optimises masked-token CE + the routers' auxiliary losses (:mod:`moa.criterions.aux_loss`), per masked token.

    The logged ``loss`` (base 2) and ``ppl`` stay fairseq's pure masked-token figures;
    ``aux_loss`` (base 2) is the auxiliary part that training adds, and ``moa_la``,
    ``moa_lz``, ``moa_load_cv`` the routing figures.
    """

    def __init__(self, cfg: MoAMaskedLmConfig, task):
        super().__init__(cfg, task)
        self.routing_cfg = cfg
