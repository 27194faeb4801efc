"""The criteria's auxiliary-loss code on its own: load CV, the reduction of logged figures, the guard
for losses that lost their gradient, per-module logging of MoH, and the masked-LM criterion."""

import math
import types

import pytest
import torch
from fairseq import metrics

from helpers import build_model
from moa.criterions.aux_loss import (AUX_LOSS, RoutingLossConfig, log_module_figures, reduce_routing_metrics,
                                     routing_aux_loss)
from moa.criterions.moa_masked_lm import MoAMaskedLmConfig, MoAMaskedLmLoss
from moa.models.routed_transformer import pop_named_routings
from moa.routing import TopKRouter, TwoStageHeadRouter, load_cv


def test_load_cv_matches_a_hand_computation():
    # load (2, 1, 1): mean 4/3, population std sqrt(((2/3)^2 + 2 (1/3)^2) / 3) = sqrt(2) / 3
    assert load_cv(torch.tensor([2.0, 1.0, 1.0])).item() == pytest.approx((math.sqrt(2) / 3) / (4 / 3))
    assert load_cv(torch.tensor([5.0, 5.0, 5.0, 5.0])).item() == 0.0
    assert load_cv(torch.zeros(4)).item() == 0.0  # no tokens at all: balanced, not NaN


def test_reduce_weighs_by_sample_size_and_gives_the_aux_loss_in_bits():
    logs = [{"sample_size": 10, AUX_LOSS: 10 * 0.5, "moa_la": 10 * 1.2, "routing/encoder-self.0/la": 10 * 1.4},
            {"sample_size": 30, AUX_LOSS: 30 * 0.1, "moa_la": 30 * 1.0, "routing/encoder-self.0/la": 30 * 1.0}]
    with metrics.aggregate() as aggregated:
        reduce_routing_metrics(logs)
    values = aggregated.get_smoothed_values()
    assert values[AUX_LOSS] == pytest.approx((5 + 3) / 40 / math.log(2), abs=1e-4)  # nats -> bits
    assert values["moa_la"] == pytest.approx((12 + 30) / 40, abs=1e-4)  # a weighted mean, not (1.2 + 1.0) / 2
    assert values["routing/encoder-self.0/la"] == pytest.approx((14 + 30) / 40, abs=1e-4)
    with metrics.aggregate() as nothing:
        reduce_routing_metrics([{"sample_size": 0}])
    assert not nothing.get_smoothed_values()


def test_losses_without_gradient_are_refused_unless_their_weights_are_zero():
    torch.manual_seed(0)
    router = TopKRouter(8, 4, 2)
    with torch.no_grad():  # what fairseq's own checkpoint_wrapper does to the first forward
        routing = router(torch.randn(5, 8))
    with pytest.raises(RuntimeError, match="carry no gradient"):
        routing_aux_loss([routing], 5, RoutingLossConfig(), {})
    assert routing_aux_loss([routing], 5, RoutingLossConfig(moa_alpha=0.0, moa_beta=0.0), {}) == 0.0
    with torch.no_grad():  # evaluation: nothing to train, nothing to refuse
        assert routing_aux_loss([routing], 5, RoutingLossConfig(), {}).item() > 0


def test_moh_figures_per_module_and_as_means():
    torch.manual_seed(1)
    routers = [TwoStageHeadRouter(8, 4, 1, 2), TwoStageHeadRouter(8, 4, 1, 2)]
    routings = [router(torch.randn(6, 8)) for router in routers]
    named = [("encoder.layers.0.self_attn", routings[0]), ("decoder.layers.1.encoder_attn", routings[1])]
    logged = {}
    log_module_figures(named, 6, logged)
    assert set(logged) == {f"routing/{site}/{figure}" for site in ("encoder-self.0", "decoder-cross.1")
                           for figure in ("lb", "active", "alpha1", "load_cv")}
    assert logged["routing/encoder-self.0/lb"].item() == pytest.approx(6 * routings[0].balance_loss.item())
    assert logged["routing/decoder-cross.1/active"].item() == pytest.approx(6 * 3 / 4)
    cfg = RoutingLossConfig(moh_beta=0.1)
    aux = routing_aux_loss(routings, 6, cfg, logged)
    mean_lb = (routings[0].balance_loss + routings[1].balance_loss) / 2
    torch.testing.assert_close(aux, 6 * 0.1 * mean_lb)  # averaged over the MoH modules, per token
    assert logged["moh_lb"].item() == pytest.approx(6 * mean_lb.item())
    assert logged["moh_load_cv"].item() == pytest.approx(
        6 * (load_cv(routings[0].load) + load_cv(routings[1].load)).item() / 2)


def test_masked_lm_criterion_adds_the_moa_terms_with_exact_per_token_weights():
    torch.manual_seed(2)
    model = build_model("moa_roberta_small", 40, ["--encoder-layers", "2", "--moa-experts", "4", "--moa-top-k", "2",
                                                  "--moa-head-dim", "8", "--moa-router-init", "normal",
                                                  "--dropout", "0", "--attention-dropout", "0"])
    dictionary = model.encoder.sentence_encoder.embed_tokens.num_embeddings
    pad = model.encoder.sentence_encoder.padding_idx
    tokens = torch.randint(4, dictionary, (3, 9))
    target = torch.full_like(tokens, pad)
    target[:, 2::3] = tokens[:, 2::3]  # every third token is masked
    sample = {"net_input": {"src_tokens": tokens}, "target": target, "ntokens": int(target.ne(pad).sum()),
              "nsentences": 3}
    task = types.SimpleNamespace(target_dictionary=types.SimpleNamespace(pad=lambda: pad))

    def criterion(alpha, beta):
        return MoAMaskedLmLoss(MoAMaskedLmConfig(moa_alpha=alpha, moa_beta=beta), task)

    base, sample_size, _ = criterion(0.0, 0.0)(model, sample)
    loss, _, log = criterion(0.01, 0.001)(model, sample)
    model(**sample["net_input"])
    routings = [routing for _, routing in pop_named_routings(model)]
    assert len(routings) == 2
    aux = sum(0.01 * r.load_balancing_loss + 0.001 * r.router_z_loss for r in routings)
    assert sample_size == sample["ntokens"]
    torch.testing.assert_close(loss - base, sample_size * aux)
    torch.testing.assert_close(log[AUX_LOSS], (sample_size * aux).detach())
    assert log["moa_la"].item() == pytest.approx(
        float(sample_size) * sum(r.load_balancing_loss.item() for r in routings) / 2, rel=1e-6)
