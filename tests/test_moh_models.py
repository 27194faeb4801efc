"""The MoH archs: parameter counts, a Transformer's weights loading unchanged, the attention-type
flag, bad flags, and the criterion's MoH term with its exact per-token weight."""

import pytest
import torch
from fairseq.criterions import CRITERION_REGISTRY
from fairseq.modules.multihead_attention import MultiheadAttention

from helpers import TINY_MOH, attention_parameters, build_model, translation_parameters, translation_sample
from moa.moh_attention import MixtureOfHeadsAttention



def _count(model):
    return sum(p.numel() for p in model.parameters())


def test_moh_base_parameter_count_with_a_32768_joined_dictionary():
    model = build_model("moh_base", 32768)
    # fairseq's attention plus each MoH router's d x (h + 2): W_s, W_r (h weights in all) and the mixing W_h (2)
    assert _count(model) == translation_parameters(32768, 512, 2048, 6, attention_parameters(512) + 512 * (8 + 2))
    modules = [m for m in model.modules() if isinstance(m, MixtureOfHeadsAttention)]
    assert len(modules) == 18
    assert {(m.num_heads, m.shared_heads, m.top_k, m.head_dim) for m in modules} == {(8, 4, 2, 64)}


def test_moh_roberta_base_adds_its_routers_to_roberta_base():
    assert _count(build_model("moh_roberta_base", 50005)) == _count(build_model("roberta_base", 50005)) \
        + 12 * 768 * (12 + 2)


@pytest.mark.parametrize("arch, heads, shared, top_k, modules", [
    ("moh_small", 4, 2, 1, 9), ("moh_roberta_small", 4, 2, 1, 4), ("moh_roberta_base", 12, 6, 3, 12)])
def test_cpu_and_roberta_archs(arch, heads, shared, top_k, modules):
    model = build_model(arch, 100)
    found = [m for m in model.modules() if isinstance(m, MixtureOfHeadsAttention)]
    assert len(found) == modules
    assert {(m.num_heads, m.shared_heads, m.top_k) for m in found} == {(heads, shared, top_k)}


def test_a_transformers_weights_load_unchanged():
    torch.manual_seed(0)
    transformer = build_model("transformer", 50, TINY_MOH)
    moh = build_model("moh_small", 50, TINY_MOH)
    missing, unexpected = moh.load_state_dict(transformer.state_dict(), strict=False)
    assert not unexpected
    assert missing and all(".router." in name for name in missing)
    assert len(missing) == 6 * 3  # 6 modules, each with W_s, W_r, W_h
    moh_state = moh.state_dict()
    for name, tensor in transformer.state_dict().items():
        assert moh_state[name].shape == tensor.shape and torch.equal(moh_state[name], tensor)


def test_attention_types_flag_and_bad_head_counts():
    model = build_model("moh_small", 40, TINY_MOH + ["--moh-attention-types", "decoder-self"])
    assert isinstance(model.decoder.layers[0].self_attn, MixtureOfHeadsAttention)
    assert isinstance(model.decoder.layers[0].encoder_attn, MultiheadAttention)
    assert isinstance(model.encoder.layers[0].self_attn, MultiheadAttention)
    with pytest.raises(ValueError, match="--moh-attention-types: unknown"):
        build_model("moh_small", 40, TINY_MOH + ["--moh-attention-types", "encoder"])
    with pytest.raises(ValueError, match="--moh-shared-heads 2 --moh-top-k 3 do not fit the 4 heads"):
        build_model("moh_small", 40, TINY_MOH + ["--moh-top-k", "3"])


@pytest.mark.parametrize("balance_loss", ["paper", "experts-scaled"])
def test_criterion_adds_the_mean_balance_loss_with_an_exact_per_token_weight(balance_loss):
    torch.manual_seed(0)
    model = build_model("moh_small", 40, TINY_MOH + ["--moh-balance-loss", balance_loss])
    sample = translation_sample(model.decoder.padding_idx)
    model(**sample["net_input"])
    routings = model.pop_routings()
    assert len(routings) == 6

    def criterion(moh_beta):
        task = type("Task", (), {"target_dictionary": model.decoder.dictionary})()
        return CRITERION_REGISTRY["moa_label_smoothed_cross_entropy"](task, sentence_avg=False, label_smoothing=0.1,
                                                                      moh_beta=moh_beta)

    base, sample_size, base_log = criterion(0.0)(model, sample)
    loss, _, log = criterion(0.01)(model, sample)
    l_b = torch.stack([r.balance_loss for r in routings])
    torch.testing.assert_close(loss / sample_size, base / sample_size + 0.01 * l_b.mean())
    torch.testing.assert_close(log["loss"], base_log["loss"])
    torch.testing.assert_close(log["moh_lb"] / sample_size, l_b.mean())
    assert log["moh_active"] / sample_size == pytest.approx(0.75)
    assert 0 < log["moh_alpha1"] / sample_size < 1
    assert "moa_la" not in log  # no MoA module, no MoA figures
    real = int(sample["net_input"]["prev_output_tokens"].ne(model.decoder.padding_idx).sum())
    cross = [m for m in model.modules() if isinstance(m, MixtureOfHeadsAttention) and m.encoder_decoder_attention]
    model(**sample["net_input"])
    for m in cross:  # cross-attention routing skips target padding
        assert m.routing.load.sum().item() == real * m.top_k
