"""The routers' auxiliary losses inside a fairseq criterion, for MoA and MoH modules alike.

Total loss per token: ``L_task + sum over MoA modules of (alpha L_a + beta L_z)`` (MoA, Sec. 3.3)
``+ moh_beta * mean over MoH modules of L_b`` (MoH, Sec. 3.3, averaged over layers as the authors'
code does). Each routing decision says what it adds (:meth:`~moa.routing.Routing.aux_loss`) and how
the modules of its kind combine (``aux_reduction``), so nothing here depends on the kind of module.
fairseq sums the task loss over the batch and divides the gradient by ``sample_size``, so the
auxiliary part is added as ``sample_size * (...)``: after the division its weights on the per-token
loss are exactly alpha, beta and moh_beta. The authors' MoA code adds its part unscaled, weakening it
by the batch's token count; ``--moa-aux-loss-scale per-batch`` gives that.

Logged beside fairseq's figures: ``aux_loss`` (what the routers' terms add, base 2 like ``loss``) and,
as means over the modules of each kind, ``moa_la`` (1.0 = balanced), ``moa_lz``, ``moa_load_cv``,
``moh_lb``, ``moh_active``, ``moh_alpha1`` and ``moh_load_cv`` (0 = balanced).

The model hands its routing decisions over explicitly: ``model.pop_named_routings()``
(:class:`~moa.models.routed_transformer.RoutedModel`). With ``--log-routing-by-module`` the
criterion also logs each module's figures as ``routing/TYPE.LAYER/FIGURE`` (``load_cv``, ``la``,
``lz`` for MoA; ``load_cv``, ``lb``, ``active``, ``alpha1`` for MoH), which fairseq's
``--tensorboard-logdir`` writes as TensorBoard scalars, grouped under ``routing/``.
"""

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from fairseq import metrics
from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from moa.models.routed_transformer import attention_site, pop_named_routings

AUX_LOSS_SCALES = ("per-token", "per-batch")
AUX_LOSS = "aux_loss"


@dataclass
class RoutingLossConfig(FairseqDataclass):
    """The routing flags every criterion of the plugin adds to its base config."""

    moa_alpha: float = field(default=0.01, metadata={"help": "weight alpha of the load-balancing loss L_a per MoA module"})
    moa_beta: float = field(default=0.001, metadata={"help": "weight beta of the router z-loss L_z per MoA module"})
    moa_aux_loss_scale: Optional[ChoiceEnum(AUX_LOSS_SCALES)] = field(default=None, metadata={
        "help": "per-token (the paper's objective): --moa-alpha/--moa-beta weigh L_a/L_z against the per-token "
                "task loss; per-batch (the authors' released code): alpha L_a + beta L_z is added once to the "
                "batch's summed loss. Default: per-batch with the model flag --moa-released-code, else per-token"})
    moh_beta: float = field(default=0.01, metadata={"help": "weight of the MoH load-balance loss L_b, averaged over "
                                                            "MoH modules"})
    log_routing_by_module: bool = field(default=False, metadata={
        "help": "also log every routed module's load CV and auxiliary losses (routing/TYPE.LAYER/...), "
                "e.g. for --tensorboard-logdir"})


def routing_terms(model, sample_size, cfg: RoutingLossConfig, logging_output: dict):
    """What a criterion adds after its task loss: :func:`routing_aux_loss` of the routings ``model``
    recorded in this forward, logging their figures, and per module with ``cfg.log_routing_by_module``."""
    named = pop_named_routings(model)
    if cfg.log_routing_by_module:
        log_module_figures(named, sample_size, logging_output)
    return routing_aux_loss([routing for _, routing in named], sample_size, cfg, logging_output)


def log_module_figures(named, sample_size, logging_output: dict) -> None:
    """``routing/TYPE.LAYER/FIGURE`` for each (module name, routing), times ``sample_size``."""
    for name, routing in named:
        kind, layer = attention_site(name)
        for figure, value in routing.figures().items():
            logging_output[f"routing/{kind}.{layer}/{figure}"] = value.detach().float() * sample_size


def routing_aux_loss(routings: List, sample_size, cfg: RoutingLossConfig, logging_output: dict):
    """``sample_size * (the routings' auxiliary terms)`` for the routings of one forward, each kind
    combined by its ``aux_reduction``; logs ``AUX_LOSS`` and each kind's figures, averaged over its
    modules (multiplied by ``sample_size``, as fairseq's reduction divides by it), into ``logging_output``."""
    if not routings:
        return 0.0
    by_family = defaultdict(list)
    for routing in routings:
        by_family[routing.family].append(routing)
    weighted = []
    for family, group in by_family.items():
        term = sum(routing.aux_loss(cfg, sample_size) for routing in group)
        weighted.append(term / len(group) if group[0].aux_reduction == "mean" else term)
        figures = defaultdict(list)
        for routing in group:
            for name, value in routing.figures().items():
                figures[name].append(value.detach().float())
        for name, values in figures.items():
            logging_output[f"{family.lower()}_{name}"] = torch.stack(values).mean() * sample_size
    aux = sample_size * sum(weighted)
    if torch.is_grad_enabled() and any(r.trains_router(cfg) for r in routings) and not aux.requires_grad:
        raise RuntimeError(
            "the routers' auxiliary losses carry no gradient: the routed layers ran without autograd "
            "(fairseq's own checkpoint_wrapper runs them under no_grad first; the plugin's layers "
            "checkpoint with moa.activation_checkpointing, which keeps it). Build the layers through the "
            "plugin's archs, or set --moa-alpha 0 --moa-beta 0 --moh-beta 0."
        )
    logging_output[AUX_LOSS] = aux.detach()
    return aux


def reduce_routing_metrics(logging_outputs) -> None:
    """Log the sample-size-weighted means of the routing figures that were logged (``AUX_LOSS`` in
    base 2, like fairseq's ``loss``). They stay tensors, as fairseq's own figures do: read on the host
    only when fairseq's meters are printed."""
    sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
    if not torch.is_tensor(sample_size) and not sample_size:
        return
    logged = sorted({key for log in logging_outputs for key in log if key.startswith(("moa_", "moh_", "switchhead_", "routing/"))})
    for key in [AUX_LOSS, *logged]:
        if not any(key in log for log in logging_outputs):
            continue
        total = sum(log.get(key, 0) for log in logging_outputs) / sample_size
        if key == AUX_LOSS:
            total /= math.log(2)
        metrics.log_scalar(key, total, sample_size, round=4)


class RoutingLosses:
    """Mixed in before a fairseq criterion: its loss plus the routers' auxiliary terms of the forward
    it ran (:func:`routing_terms`, configured by ``self.routing_cfg``), and their figures reduced
    beside fairseq's."""

    routing_cfg: RoutingLossConfig

    def forward(self, model, sample, reduce=True):
        pop_named_routings(model)  # drop anything recorded outside this criterion
        loss, sample_size, logging_output = super().forward(model, sample, reduce=reduce)
        aux = routing_terms(model, sample_size, self.routing_cfg, logging_output)
        return (loss + aux if reduce else loss), sample_size, logging_output

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        super().reduce_metrics(logging_outputs)
        reduce_routing_metrics(logging_outputs)
