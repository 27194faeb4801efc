"""Masked-LM cross-entropy plus MoA's auxiliary losses (same scaling rule as for translation)."""

from dataclasses import dataclass

from fairseq.criterions import register_criterion
from fairseq.criterions.masked_lm import MaskedLmConfig, MaskedLmLoss

from moa.criterions.aux_loss import MoAAuxLossConfig, moa_aux_loss, pop_routings, reduce_moa_metrics


@dataclass
class MoAMaskedLmConfig(MaskedLmConfig, MoAAuxLossConfig):
    pass


@register_criterion("moa_masked_lm", dataclass=MoAMaskedLmConfig)
class MoAMaskedLmLoss(MaskedLmLoss):
    """Optimises masked-token CE + sum over modules of (alpha L_a + beta L_z), per masked token.

    The logged ``loss`` (base 2) and ``ppl`` stay fairseq's pure masked-token figures;
    ``moa_aux`` (base 2) is the auxiliary part that training adds, and ``moa_la``,
    ``moa_lz``, ``moa_load_cv`` the routing figures.
    """

    def __init__(self, cfg: MoAMaskedLmConfig, task):
        super().__init__(cfg, task)
        self.moa_alpha = cfg.moa_alpha
        self.moa_beta = cfg.moa_beta

    def forward(self, model, sample, reduce=True):
        pop_routings(model)
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        aux = moa_aux_loss(pop_routings(model), sample_size, self.moa_alpha, self.moa_beta, logging_output)
        return loss + aux, sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        reduce_moa_metrics(logging_outputs)
