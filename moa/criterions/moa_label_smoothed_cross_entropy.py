"""Label-smoothed cross-entropy plus the routers' auxiliary losses (MoA and MoH), for translation."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from moa.criterions.aux_loss import RoutingLossConfig, RoutingLosses


@dataclass
class MoALabelSmoothedCrossEntropyCriterionConfig(LabelSmoothedCrossEntropyCriterionConfig, RoutingLossConfig):
    pass


@register_criterion("moa_label_smoothed_cross_entropy", dataclass=MoALabelSmoothedCrossEntropyCriterionConfig)
class MoALabelSmoothedCrossEntropyCriterion(RoutingLosses, LabelSmoothedCrossEntropyCriterion):
    """Optimises label-smoothed CE + the routers' auxiliary losses (:mod:`moa.criterions.aux_loss`), per target token.

    The logged ``loss`` and ``nll_loss`` (base 2) and ``ppl`` stay fairseq's pure translation
    figures, so validation loss and ``checkpoint_best`` compare with a Transformer's; ``aux_loss``
    (base 2) is the auxiliary part that training adds, and ``moa_la``, ``moa_lz``, ``moa_load_cv``,
    ``moh_lb``, ``moh_active``, ``moh_alpha1``, ``moh_load_cv`` the routing figures.
    """

    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0, report_accuracy=False,
                 moa_alpha=0.01, moa_beta=0.001, moa_aux_loss_scale=None, moh_beta=0.01, log_routing_by_module=False):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.routing_cfg = RoutingLossConfig(moa_alpha=moa_alpha, moa_beta=moa_beta,
                                             moa_aux_loss_scale=moa_aux_loss_scale, moh_beta=moh_beta,
                                             log_routing_by_module=log_routing_by_module)
