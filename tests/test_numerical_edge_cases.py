"""Routers and routed attention at the numerical edges: saturated, tied and underflowing routers,
all-padding batches, one token, long sequences, and bf16 autocast on CPU."""

import copy
import math

import pytest
import torch

from helpers import TINY, TINY_MOH, build_model, translation_sample
from moa.moa_attention import MixtureOfAttentionHeads
from moa.moh_attention import MixtureOfHeadsAttention
from moa.routing import TopKRouter, TwoStageHeadRouter
from test_attention_reference import reference_moa
from test_moh_attention import reference_moh
from test_reference_precisions import _active_pairs, assert_within_rounding, float64_copy


def _moa(top_k=2, gate_weights="renormalized", dtype=torch.float32):
    torch.manual_seed(1)
    return MixtureOfAttentionHeads(16, 4, top_k, 8, gate_weights=gate_weights, self_attention=True).to(dtype)


def _moh(dtype=torch.float32, **kw):
    torch.manual_seed(1)
    return MixtureOfHeadsAttention(16, num_heads=4, shared_heads=1, top_k=2, self_attention=True, **kw).to(dtype)


def _routers():
    torch.manual_seed(0)
    return TopKRouter(16, 4, 2), TwoStageHeadRouter(16, 4, 1, 2)


def _choices(routing):
    return routing.selected


def _figures(routing):
    """Every float the routing carries: gates, auxiliary losses and (MoH) the shared gates and alpha1."""
    extra = [] if routing.mean_alpha_shared is None else [routing.shared_gates, routing.mean_alpha_shared]
    return [routing.gates, *routing.aux_losses().values(), *extra]


@pytest.mark.parametrize("scale", [1e3, 1e6])
def test_saturated_routers_stay_finite_and_moas_z_loss_keeps_a_gradient(scale):
    """Logits of order ``scale`` make the softmax one-hot: every figure stays finite and the choices
    deterministic. MoA's router keeps a gradient through L_z, which grows with the logits; MoH's may
    have none left (a saturated softmax has zero derivative, and MoH has no z-loss), but no NaN."""
    torch.manual_seed(1)
    x = torch.randn(12, 16)
    for router in _routers():
        with torch.no_grad():
            for p in router.parameters():
                p.mul_(scale)
        routing = router(x)
        figures = _figures(routing)
        assert all(torch.isfinite(f).all() for f in figures)
        loss = sum(f.float().sum() for f in figures)
        grads = torch.autograd.grad(loss, list(router.parameters()))
        assert all(torch.isfinite(g).all() for g in grads)
        if isinstance(router, TopKRouter):
            assert sum(g.abs().sum() for g in grads) > 0
        again = router(x)
        assert torch.equal(_choices(routing), _choices(again))
    moa_routing = _routers()[0]
    with torch.no_grad():
        moa_routing.weight.mul_(1e6)
    assert moa_routing(x).router_z_loss > 1e6  # L_z grows with the logits, as it should, but finitely


def test_tied_logits_route_deterministically_with_the_exact_losses():
    """A zero router (every logit equal) sends every token to the same k experts, with gates 1/k
    (renormalised), L_a = 1 and L_z = (log E)^2."""
    x = torch.randn(10, 16)
    moa_router, moh_router = _routers()
    for router in (moa_router, moh_router):
        with torch.no_grad():
            for p in router.parameters():
                p.zero_()
    routing = moa_router(x)
    assert (routing.selected == routing.selected[0]).all() and torch.equal(routing.selected, moa_router(x).selected)
    torch.testing.assert_close(routing.gates, torch.full((10, 2), 0.5))
    torch.testing.assert_close(routing.load_balancing_loss, torch.tensor(1.0))
    torch.testing.assert_close(routing.router_z_loss, torch.tensor(math.log(4) ** 2))
    heads = moh_router(x)
    assert (heads.selected == heads.selected[0]).all() and torch.isfinite(heads.balance_loss)
    torch.testing.assert_close(heads.mean_alpha_shared, torch.tensor(0.5))


def test_underflowing_gates_still_give_the_top_experts_output():
    """With raw probabilities as gates and a saturated router, the second expert's gate is exactly 0:
    the output is the top expert's alone, finite, as the reference computes it."""
    m = _moa(gate_weights="raw", dtype=torch.float64)
    with torch.no_grad():
        m.router.weight.mul_(1e4)
    x = torch.randn(5, 2, 16, dtype=torch.float64)
    y, _ = m(x, x, x)
    assert (m.routing.gates[:, 1] == 0).all()
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, reference_moa(m, x, x, x))


def test_an_all_padding_batch_has_zero_auxiliary_losses_and_finite_outputs():
    padding = torch.ones(8, dtype=torch.bool)
    for router in _routers():
        routing = router(torch.randn(8, 16), padding)
        figures = _figures(routing)
        assert all(torch.isfinite(f).all() for f in figures)
        extra = [] if routing.mean_alpha_shared is None else [routing.mean_alpha_shared]
        for value in [*routing.aux_losses().values(), *extra]:
            assert value.item() == 0.0
        assert routing.load.sum() == 0
    # cross-attention whose every query is padding (the keys are real): finite outputs, nothing routed
    for module in (_moa(), _moh()):
        module.self_attention, module.encoder_decoder_attention = False, True
        q, kv = torch.randn(3, 2, 16), torch.randn(4, 2, 16)
        module.query_padding_mask = torch.ones(2, 3, dtype=torch.bool)
        y, _ = module(q, kv, kv, static_kv=True)
        assert torch.isfinite(y).all()
        assert module.routing.load.sum() == 0


@pytest.mark.parametrize("length", [1, 1200])
def test_one_token_and_long_sequences_match_the_reference(length):
    """One token, and 1,200 (longer than any training sequence here): the first three queries'
    outputs equal the token-by-token reference over all the keys; MoH's sparse path equals its dense one."""
    m = _moa(dtype=torch.float64)
    x = torch.randn(length, 1, 16, dtype=torch.float64)
    y, _ = m(x, x, x)
    torch.testing.assert_close(y[:3], reference_moa(m, x[:3], x, x))
    h = _moh(dtype=torch.float64)
    h.path = "packed"  # against computing every head
    y_sparse, _ = h(x, x, x)
    h.path = "all-heads"
    y_dense, _ = h(x, x, x)
    torch.testing.assert_close(y_sparse, y_dense)


@pytest.mark.parametrize("kind", ["moa", "moh"])
def test_bf16_autocast_keeps_the_router_in_float32_and_the_output_within_bf16_rounding(kind):
    """Under autocast the router runs in float32 on float32 weights, so it chooses what float32 chooses; the
    projections run in bfloat16 on rounded weights and inputs. The output is the float64 reference's on
    those rounded weights within the rounding bound of test_reference_precisions."""
    module = _moa() if kind == "moa" else _moh()
    x = torch.randn(20, 3, 16)
    module(x, x, x)
    chosen32 = _choices(module.routing)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16, _ = module(x, x, x)
    routing = module.routing
    assert routing.probs.dtype == torch.float32  # the router ran in float32 under autocast
    assert torch.equal(_choices(routing), chosen32)  # so it chose exactly the same experts
    assert y16.dtype == torch.bfloat16
    wide = float64_copy(module)
    with torch.no_grad():
        for name, p in wide.named_parameters():
            if not name.startswith("router."):  # what autocast rounds
                p.copy_(p.to(torch.bfloat16).double())
    reference = reference_moa if kind == "moa" else reference_moh
    want = reference(wide, *(x.double(),) * 3)
    assert_within_rounding(y16, want, torch.bfloat16, "output under autocast", active_pairs=_active_pairs(routing))


@pytest.mark.parametrize("arch, flags", [("moa_small", TINY), ("moh_small", TINY_MOH)])
def test_a_whole_model_under_bf16_autocast_gives_the_float32_loss_within_bf16_tolerance(arch, flags):
    torch.manual_seed(0)
    model = build_model(arch, 40, flags).eval()
    sample = translation_sample(model.decoder.padding_idx)
    logits32 = model(**sample["net_input"])[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits16 = model(**sample["net_input"])[0]
    routings = model.pop_routings()
    assert all(r.probs.dtype == torch.float32 for r in routings)
    nll = [torch.nn.functional.cross_entropy(out.float().flatten(0, 1), sample["target"].flatten(),
                                             ignore_index=model.decoder.padding_idx) for out in (logits32, logits16)]
    assert abs(nll[1] - nll[0]) < 0.02 * nll[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch, flags", [("moa_small", TINY), ("moh_small", TINY_MOH)])
def test_a_model_converted_to_half_precision_routes_in_float32(arch, flags, dtype):
    """What fairseq's --bf16 and --fp16 trainers do (the whole model converted): the routers' logits,
    softmax and auxiliary losses still run in float32, and the loss is the float64 model's on the same
    (rounded) weights within 4 u of it: a mean of log-probabilities, each a few roundings off (measured: at
    most 1.6 u over three seeds)."""
    from moa import routing as routing_module

    torch.manual_seed(0)
    model = build_model(arch, 40, flags).to(dtype).train()
    wide = copy.deepcopy(model).double()
    logits = []
    original = routing_module.router_linear
    sample = translation_sample(model.decoder.padding_idx)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(routing_module, "router_linear", lambda x, w: logits.append(original(x, w)) or logits[-1])
        out = model(**sample["net_input"])[0]
    routings = model.pop_routings()
    assert out.dtype == dtype and torch.isfinite(out.float()).all()
    nll = [torch.nn.functional.cross_entropy(o.double().flatten(0, 1), sample["target"].flatten(),
                                             ignore_index=model.decoder.padding_idx)
           for o in (out, wide(**sample["net_input"])[0])]
    assert abs(nll[0] - nll[1]) <= 4 * torch.finfo(dtype).eps / 2 * nll[1], nll
    assert logits and all(l.dtype == torch.float32 for l in logits)
    for r in routings:
        assert r.probs.dtype == torch.float32 and r.gates.dtype == dtype
        assert all(loss.dtype == torch.float32 and torch.isfinite(loss) for loss in r.aux_losses().values())
