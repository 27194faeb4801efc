"""Label-smoothed cross-entropy plus MoA's auxiliary losses, for translation."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from moa.criterions.aux_loss import MoAAuxLossConfig, moa_aux_loss, pop_routings, reduce_moa_metrics


@dataclass
class MoALabelSmoothedCrossEntropyCriterionConfig(LabelSmoothedCrossEntropyCriterionConfig, MoAAuxLossConfig):
    pass


@register_criterion("moa_label_smoothed_cross_entropy", dataclass=MoALabelSmoothedCrossEntropyCriterionConfig)
class MoALabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    """Optimises label-smoothed CE + sum over modules of (alpha L_a + beta L_z), per target token.

    The logged ``loss`` and ``nll_loss`` (base 2) and ``ppl`` stay fairseq's pure translation
    figures, so validation loss and ``checkpoint_best`` compare with a Transformer's; ``moa_aux``
    (base 2) is the auxiliary part that training adds, and ``moa_la``, ``moa_lz``, ``moa_load_cv``
    the routing figures.
    """

    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0, report_accuracy=False,
                 moa_alpha=0.01, moa_beta=0.001):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        self.moa_alpha = moa_alpha
        self.moa_beta = moa_beta

    def forward(self, model, sample, reduce=True):
        pop_routings(model)  # drop anything recorded outside this criterion
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        aux = moa_aux_loss(pop_routings(model), sample_size, self.moa_alpha, self.moa_beta, logging_output)
        return (loss + aux if reduce else loss), sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        reduce_moa_metrics(logging_outputs)
