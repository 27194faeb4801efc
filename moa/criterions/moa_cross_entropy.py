"""Cross-entropy plus the routers' auxiliary losses (MoA and MoH), for language modelling."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig

from moa.criterions.aux_loss import RoutingLosses, RoutingLossConfig


@dataclass
class MoACrossEntropyCriterionConfig(CrossEntropyCriterionConfig, RoutingLossConfig):
    pass


@register_criterion("moa_cross_entropy", dataclass=MoACrossEntropyCriterionConfig)
class MoACrossEntropyCriterion(RoutingLosses, CrossEntropyCriterion):
    """Optimises fairseq's cross-entropy + the routers' auxiliary losses (:mod:`moa.criterions.aux_loss`),
    per target token. The logged ``loss`` and ``ppl`` stay fairseq's pure language-model figures."""

    def __init__(self, task, sentence_avg, moa_alpha=0.01, moa_beta=0.001, moa_aux_loss_scale=None, moh_beta=0.01,
                 log_routing_by_module=False):
        super().__init__(task, sentence_avg)
        self.routing_cfg = RoutingLossConfig(moa_alpha=moa_alpha, moa_beta=moa_beta,
                                             moa_aux_loss_scale=moa_aux_loss_scale, moh_beta=moh_beta,
                                             log_routing_by_module=log_routing_by_module)
