"""Activation checkpointing that keeps the routers' auxiliary losses differentiable.

fairseq's ``checkpoint_wrapper`` (``--checkpoint-activations``) runs a layer's first forward under
``torch.no_grad()`` and rebuilds the graph in the backward pass. The layer's output survives that,
but the routing decisions MoA and MoH modules hand to the criterion beside it (``L_a``, ``L_z``,
``L_b``) are computed in the no-grad forward, so their gradient is lost.

:func:`checkpoint_routed_layer` uses torch's non-reentrant checkpoint instead: the first forward
records the autograd graph as usual but keeps none of the tensors it saves for the backward (the
layer's inputs excepted); they are recomputed, with the same RNG state, when the backward needs
them. Every tensor of the first forward, the routings included, so has its ``grad_fn``, and the
gradients equal those of the unwrapped layer. The recomputation runs the layer's forward a second
time, with the query padding the decoder had set on its cross-attention modules for the first one;
its routings are not recorded again (``RoutedAttention.record_routing``), so the criterion never
sees a stale one. ``offload_to_cpu`` (``--offload-activations``) keeps the saved layer
inputs in (pinned) CPU memory, as fairseq's wrapper does; on a CPU-only machine it changes nothing.
"""

import contextlib
import functools

import torch
from torch.utils.checkpoint import checkpoint

from moa.routed_attention import RoutedAttention


def checkpoint_routed_layer(layer: torch.nn.Module, offload_to_cpu: bool = False) -> torch.nn.Module:
    """Make ``layer.forward`` checkpointed (in training with autograd on); returns ``layer``.

    Marked like fairseq's wrapper (``precheckpoint_forward``), so fairseq's ``unwrap_checkpoint``
    undoes it.
    """
    if hasattr(layer, "precheckpoint_forward"):
        raise ValueError(f"{type(layer).__name__} is checkpointed already")
    layer.precheckpoint_forward = layer.forward
    layer.forward = functools.partial(_checkpointed_forward, layer, offload_to_cpu)
    return layer


def _checkpointed_forward(layer, offload_to_cpu, *args, **kwargs):
    forward = layer.precheckpoint_forward
    if not (layer.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    routed = [m for m in layer.modules() if isinstance(m, RoutedAttention)]
    query_padding = [m.query_padding_mask for m in routed]  # set by the decoder around its layers
    calls = []

    def run(*run_args, **run_kwargs):
        calls.append(None)
        if len(calls) == 1:
            return forward(*run_args, **run_kwargs)
        with _replaying(routed, query_padding):  # the backward's recomputation
            return forward(*run_args, **run_kwargs)

    saving = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if offload_to_cpu
              else contextlib.nullcontext())
    with saving:
        return checkpoint(run, *args, use_reentrant=False, **kwargs)


@contextlib.contextmanager
def _replaying(modules, query_padding):
    """The routed modules as in the first forward (same query padding), not recording routings."""
    for module, mask in zip(modules, query_padding):
        module.record_routing, module.query_padding_mask = False, mask
    try:
        yield
    finally:
        for module in modules:
            module.record_routing, module.query_padding_mask = True, None
