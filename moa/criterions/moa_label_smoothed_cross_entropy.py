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
    """``loss`` = label-smoothed CE + sum over modules of (alpha L_a + beta L_z), per token.

    Logs ``moa_aux`` (the auxiliary part of ``loss``), ``moa_la``, ``moa_lz`` and
    ``moa_load_cv``; ``nll_loss`` and ``ppl`` stay the pure translation figures.
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
        if reduce:
            loss = loss + aux
            logging_output["loss"] = loss.data
        return loss, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        reduce_moa_metrics(logging_outputs)
