"""Masked-LM cross-entropy plus the routers' auxiliary losses (same scaling rule as for translation)."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.masked_lm import MaskedLmConfig, MaskedLmLoss

from moa.criterions.aux_loss import RoutingLossConfig, reduce_routing_metrics, routing_terms
from moa.models.routed_transformer import pop_named_routings


@dataclass
class MoAMaskedLmConfig(MaskedLmConfig, RoutingLossConfig):
    pass


@register_criterion("moa_masked_lm", dataclass=MoAMaskedLmConfig)
class MoAMaskedLmLoss(MaskedLmLoss):
    """Optimises masked-token CE + the routers' auxiliary losses (:mod:`moa.criterions.aux_loss`), per masked token.

    The logged ``loss`` (base 2) and ``ppl`` stay fairseq's pure masked-token figures;
    ``aux_loss`` (base 2) is the auxiliary part that training adds, and ``moa_la``,
    ``moa_lz``, ``moa_load_cv`` the routing figures.
    """

    def __init__(self, cfg: MoAMaskedLmConfig, task):
        super().__init__(cfg, task)
        self.routing_cfg = cfg

    def forward(self, model, sample, reduce=True):
        pop_named_routings(model)  # drop anything recorded outside this criterion
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        aux = routing_terms(model, sample_size, self.routing_cfg, logging_output)
        return loss + aux, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        reduce_routing_metrics(logging_outputs)
