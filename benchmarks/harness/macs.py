"""Multiply-adds: counted by torch's FLOP counter on real models (``import moa`` teaches it the grouped GEMM
and the CPU's fused attention, :mod:`moa.flops`), or written from the equations for one module."""

import os

import torch
from torch.utils.flop_counter import FlopCounterMode

import moa  # noqa: F401  (registers the plugin and moa.flops' formulas)


def forward_macs(model, source, prev):
    """Forward MACs of a translation model on one batch (``source``, ``prev`` output tokens), in float32."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(source, torch.full((source.size(0),), source.size(1)), prev)
    return counter.get_total_flops() / 2


def routed_paths(model):
    """Set MoA, MoH and SwitchHead to their routed paths (only the selected experts' or heads' projections)."""
    from moa.moa_attention import MixtureOfAttentionHeads
    from moa.moh_attention import MixtureOfHeadsAttention
    from moa.switchhead_attention import SwitchHeadAttention

    for module in model.modules():
        if isinstance(module, MixtureOfAttentionHeads):
            module.path = "routed"
        if isinstance(module, MixtureOfHeadsAttention):
            module.path = "packed"
        if isinstance(module, SwitchHeadAttention):
            module.path = "routed"
    return model


def macs_per_target_token(data_dir, src, tgt, checkpoint=None, flags=None, overrides=None, pairs=200):
    """Forward MACs per target token over the first ``pairs`` validation pairs of a prepared translation
    folder, teacher-forced, one pair at a time, in float32, routed paths. The model: ``checkpoint``
    (``overrides``: model arguments to change, as fairseq-generate's --model-overrides), or an untrained
    one built from ``flags`` (fairseq-train's flags after the data; MoA's count does not depend on the
    weights, MoH's attention over its packed queries does, a little)."""
    from fairseq import checkpoint_utils, options, tasks

    from moa_tools import USER_DIR
    from moa_tools.textio import read_lines

    data_bin = os.path.join(data_dir, "data-bin")
    if checkpoint is None:
        torch.manual_seed(1)
        args = options.parse_args_and_arch(options.get_training_parser(), [data_bin, "--user-dir", USER_DIR, *flags])
        task = tasks.setup_task(args)
        model = task.build_model(args)
    else:
        models, _, task = checkpoint_utils.load_model_ensemble_and_task(
            [checkpoint], arg_overrides={"data": data_bin, **(overrides or {})})
        model = models[0]
    model = routed_paths(model.float().eval())
    d = task.source_dictionary
    lines = {lang: list(read_lines(os.path.join(data_dir, "spm", f"val.{lang}")))[:pairs] for lang in (src, tgt)}
    macs, tokens = 0, 0
    for s, t in zip(lines[src], lines[tgt]):
        source = d.encode_line(s, add_if_not_exist=False).long().unsqueeze(0)
        target = d.encode_line(t, add_if_not_exist=False).long().unsqueeze(0)
        macs += forward_macs(model, source, torch.cat([target.new_full((1, 1), d.eos()), target[:, :-1]], dim=1))
        tokens += target.size(1)
    return macs / tokens


def moa_module_macs(d_model, experts, top_k, head_dim, seq):
    """Forward MACs per token of one MoA self-attention module over ``seq`` keys: the router, the ``top_k``
    selected experts' query and output projections, the shared key and value, attention."""
    return d_model * experts + 2 * top_k * d_model * head_dim + 2 * d_model * head_dim + 2 * top_k * seq * head_dim


def moh_module_macs(d_model, heads, active, seq):
    """Forward MACs per token of one self-attention module with ``active`` of ``heads`` heads computed on
    MoH's routed path: the active heads' queries and outputs, every head's keys and values (a later token
    may select any head), the router (heads + 2 logits; none with every head) and attention over ``seq``
    keys. With ``active == heads``: multi-head attention."""
    head_dim = d_model // heads
    router = d_model * (heads + 2) if active < heads else 0
    return 2 * active * head_dim * d_model + 2 * d_model * d_model + router + 2 * active * seq * head_dim
