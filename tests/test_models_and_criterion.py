"""Parameter counts of the archs, fairseq's layer wrappers, and the criterion's loss scaling."""

import pytest
import torch
from fairseq.criterions import CRITERION_REGISTRY
from fairseq.modules.multihead_attention import MultiheadAttention

from helpers import (TINY, TINY_SHAPE, attention_parameters, build_model, moa_parameters, translation_parameters,
                     translation_sample)
from moa.moa_attention import MixtureOfAttentionHeads



def _count(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch, attention", [
    ("transformer_wmt_en_de", attention_parameters(512)),
    ("moa_base", moa_parameters(512, 8, 128)),  # 8K8E128D
    ("moa_big", moa_parameters(512, 32, 256)),  # 16K32E256D
])
def test_parameter_counts_with_a_32768_joined_dictionary(arch, attention):
    """The built model's parameters are the shape arithmetic's (512 wide, FFN 2048, 6 + 6 layers), derived
    here, not copied from a run (README's table: 60,915,712, 63,311,872 and 198,012,928)."""
    assert _count(build_model(arch, 32768)) == translation_parameters(32768, 512, 2048, 6, attention)


def test_moa_base_module_shapes():
    model = build_model("moa_base", 100)
    modules = [m for m in model.modules() if isinstance(m, MixtureOfAttentionHeads)]
    assert len(modules) == 18  # encoder self x6, decoder self x6, decoder cross x6
    m = modules[0]
    assert (m.num_experts, m.top_k, m.head_dim) == (8, 8, 128)
    assert _count(m) == moa_parameters(512, 8, 128)
    assert model.encoder.layers[0].dropout_module.p == 0.2
    assert m.dropout_module.p == 0.2


def test_attention_types_flag_keeps_fairseq_attention_elsewhere():
    model = build_model("moa_small", 40, TINY + ["--moa-attention-types", "decoder-cross"])
    layer = model.decoder.layers[0]
    assert isinstance(layer.encoder_attn, MixtureOfAttentionHeads)
    assert isinstance(layer.self_attn, MultiheadAttention)
    assert isinstance(model.encoder.layers[0].self_attn, MultiheadAttention)
    with pytest.raises(ValueError, match="decoder-kross"):
        build_model("moa_small", 40, TINY + ["--moa-attention-types", "decoder-kross"])


def test_impossible_top_k_names_the_flags():
    with pytest.raises(ValueError, match="--moa-top-k 5 with --moa-experts 4"):
        build_model("moa_small", 40, TINY + ["--moa-top-k", "5"])


def _criterion(model, alpha, beta, scale=None):
    task = type("Task", (), {"target_dictionary": model.decoder.dictionary})()
    return CRITERION_REGISTRY["moa_label_smoothed_cross_entropy"](
        task, sentence_avg=False, label_smoothing=0.1, moa_alpha=alpha, moa_beta=beta, moa_aux_loss_scale=scale)


def _criterion_config(extra):
    """The criterion config fairseq-train builds from a command line (arch presets applied)."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_training_parser(), [
        "data-bin", "--task", "translation", "--arch", "moa_small", "--criterion",
        "moa_label_smoothed_cross_entropy", *extra])
    return convert_namespace_to_omegaconf(args).criterion


def test_criterion_adds_aux_losses_with_exact_per_token_weights():
    torch.manual_seed(0)
    model = build_model("moa_small", 40, TINY)
    sample = translation_sample(model.decoder.padding_idx)
    model(**sample["net_input"])  # dropout is 0: the criterion's forwards route identically
    routings = model.pop_routings()
    base_loss, sample_size, base_log = _criterion(model, 0.0, 0.0)(model, sample)
    assert len(routings) == 6  # 2 encoder self + 2 decoder self + 2 cross
    loss, sample_size2, log = _criterion(model, 0.01, 0.001)(model, sample)
    assert sample_size == sample_size2 == sample["ntokens"]
    l_a = sum(r.load_balancing_loss for r in routings)
    l_z = sum(r.router_z_loss for r in routings)
    # fairseq divides by sample_size: the per-token objective is CE + 0.01 L_a + 0.001 L_z exactly.
    torch.testing.assert_close(loss / sample_size, base_loss / sample_size + 0.01 * l_a + 0.001 * l_z)
    torch.testing.assert_close(log["moa_la"] / sample_size, l_a / 6)
    # the logged loss stays the pure translation loss, as a Transformer's criterion logs it
    torch.testing.assert_close(log["loss"], base_log["loss"])
    torch.testing.assert_close(log["aux_loss"], (loss - base_loss).detach())


def test_cross_attention_routing_ignores_target_padding():
    torch.manual_seed(0)
    model = build_model("moa_small", 40, TINY)
    pad = model.decoder.padding_idx
    sample = translation_sample(pad)
    model(**sample["net_input"])
    cross = [m for m in model.modules() if isinstance(m, MixtureOfAttentionHeads) and m.encoder_decoder_attention]
    real_tokens = int(sample["net_input"]["prev_output_tokens"].ne(pad).sum())
    for m in cross:
        assert m.routing.load.sum().item() == real_tokens * m.top_k
        assert m.query_padding_mask is None  # the decoder clears what it set


def test_defaults_and_the_released_code_preset_and_explicit_flags_win():
    default = build_model("moa_small", 40, TINY_SHAPE)  # the paper's gates and scale, the released code's zero router
    normal = build_model("moa_small", 40, TINY_SHAPE + ["--moa-router-init", "normal"])
    released = build_model("moa_small", 40, TINY_SHAPE + ["--moa-released-code"])
    mixed = build_model("moa_small", 40, TINY_SHAPE + ["--moa-released-code", "--moa-gate-weights", "renormalized"])
    for model, gates, init, scale in ((default, "renormalized", "zeros", "per-token"),
                                      (normal, "renormalized", "normal", "per-token"),
                                      (released, "raw", "zeros", "per-batch"),
                                      (mixed, "renormalized", "zeros", "per-batch")):
        router = model.encoder.layers[0].self_attn.router
        assert (router.gate_weights, router.init) == (gates, init)
        assert (router.weight.abs().sum() == 0) == (init == "zeros")
    # the loss scale is the criterion's flag; the preset sets it through fairseq's own parsing
    for extra, scale in (([], "per-token"), (["--moa-released-code"], "per-batch"),
                         (["--moa-released-code", "--moa-aux-loss-scale", "per-token"], "per-token"),
                         (["--moa-aux-loss-scale", "per-batch"], "per-batch")):
        assert _criterion_config(extra).moa_aux_loss_scale == scale
    zero = build_model("moa_roberta_small", 40, ["--encoder-layers", "1"])
    assert zero.encoder.sentence_encoder.layers[0].self_attn.router.weight.abs().sum() == 0  # after BERT's init
    drawn = build_model("moa_roberta_small", 40, ["--encoder-layers", "1", "--moa-router-init", "normal"])
    assert drawn.encoder.sentence_encoder.layers[0].self_attn.router.weight.std().item() == pytest.approx(0.02, rel=0.2)


def test_per_batch_aux_loss_scale_divides_the_aux_weight_by_the_batch_tokens():
    torch.manual_seed(0)
    model = build_model("moa_small", 40, TINY)
    sample = translation_sample(model.decoder.padding_idx)
    model(**sample["net_input"])
    routings = model.pop_routings()
    base, sample_size, _ = _criterion(model, 0.0, 0.0, "per-batch")(model, sample)
    loss, _, log = _criterion(model, 0.01, 0.001, "per-batch")(model, sample)
    aux = sum(0.01 * r.load_balancing_loss + 0.001 * r.router_z_loss for r in routings)
    torch.testing.assert_close(loss - base, aux)  # added once to the summed loss, as the released code does
    torch.testing.assert_close(loss / sample_size, base / sample_size + aux / sample_size)
