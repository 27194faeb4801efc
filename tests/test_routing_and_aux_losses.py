"""Routing weights, the auxiliary losses on hand-computed examples, and the hard cases."""

import math

import pytest
import torch

from moa.moa_attention import MixtureOfAttentionHeads
from moa.routing import TopKRouter


def _router(weight, top_k, gate_weights="renormalized"):
    r = TopKRouter(weight.shape[1], weight.shape[0], top_k, gate_weights)
    with torch.no_grad():
        r.weight.copy_(weight)
    return r


def _softmax(row):
    z = sum(math.exp(v) for v in row)
    return [math.exp(v) / z for v in row]


def test_aux_losses_match_hand_computation():
    router = _router(torch.eye(2), top_k=1)  # logits = x
    tokens = [[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]
    routing = router(torch.tensor(tokens))
    probs = [_softmax(t) for t in tokens]
    f = [2 / 3, 1 / 3]  # tokens 1 and 3 go to expert 0, token 2 to expert 1
    mean_p = [sum(p[i] for p in probs) / 3 for i in range(2)]
    want_la = 2 * sum(fi * pi for fi, pi in zip(f, mean_p))
    want_lz = sum(math.log(sum(math.exp(v) for v in t)) ** 2 for t in tokens) / 3
    assert routing.selected.flatten().tolist() == [0, 1, 0]
    assert routing.load_balancing_loss.item() == pytest.approx(want_la, rel=1e-6)
    assert routing.router_z_loss.item() == pytest.approx(want_lz, rel=1e-6)
    assert routing.load.tolist() == [2.0, 1.0]


def test_padding_does_not_change_aux_losses():
    torch.manual_seed(0)
    router = _router(torch.randn(4, 8), top_k=2)
    x = torch.randn(5, 8)
    clean = router(x)
    padded_x = torch.cat([x, 10 * torch.randn(3, 8)])
    padding = torch.tensor([False] * 5 + [True] * 3)
    padded = router(padded_x, padding)
    torch.testing.assert_close(padded.load_balancing_loss, clean.load_balancing_loss)
    torch.testing.assert_close(padded.router_z_loss, clean.router_z_loss)
    torch.testing.assert_close(padded.load, clean.load)


def test_padding_is_excluded_inside_the_attention_module():
    torch.manual_seed(0)
    m = MixtureOfAttentionHeads(16, 4, 2, 8, self_attention=True)
    x = torch.randn(4, 1, 16)
    m(x, x, x)
    clean = m.routing
    padded_x = torch.cat([x, torch.randn(3, 1, 16)])
    m(padded_x, padded_x, padded_x, key_padding_mask=torch.tensor([[False] * 4 + [True] * 3]))
    torch.testing.assert_close(m.routing.load_balancing_loss, clean.load_balancing_loss)
    torch.testing.assert_close(m.routing.router_z_loss, clean.router_z_loss)


def test_renormalised_weights_sum_to_one_and_detach_the_denominator():
    torch.manual_seed(0)
    router = _router(torch.randn(6, 8), top_k=3)
    x = torch.randn(4, 8)
    routing = router(x)
    torch.testing.assert_close(routing.gates.sum(-1), torch.ones(4))
    weight = router.weight.detach().clone().requires_grad_()
    top = torch.softmax(x @ weight.T, -1).topk(3).values
    raw = _router(router.weight.detach(), 3, "raw")(x)
    torch.testing.assert_close(raw.gates, top.detach())
    torch.testing.assert_close(routing.gates, (top / top.sum(-1, keepdim=True)).detach())
    # the gradient: d w_0 / d p_0 is 1 / sum(top p) (denominator detached), not (sum - p_0) / sum^2
    got = torch.autograd.grad(routing.gates[:, 0].sum(), router.weight)[0]
    detached = torch.autograd.grad((top[:, 0] / top.sum(-1).detach()).sum(), weight, retain_graph=True)[0]
    attached = torch.autograd.grad((top[:, 0] / top.sum(-1)).sum(), weight)[0]
    torch.testing.assert_close(got, detached)
    assert not torch.allclose(got, attached, atol=1e-4)


def test_all_experts_selected_balances_trivially():
    router = _router(torch.randn(4, 8), top_k=4)
    routing = router(torch.randn(10, 8))
    assert routing.load_balancing_loss.item() == pytest.approx(1.0, rel=1e-6)  # f_i = 1/E, sum P_i = 1
    assert routing.load.tolist() == [10.0] * 4


def test_one_dominant_expert():
    weight = torch.zeros(4, 8)
    weight[2] = 5.0
    routing = _router(weight, top_k=1)(torch.ones(6, 8))
    assert routing.selected.flatten().tolist() == [2] * 6
    assert routing.load.tolist() == [0.0, 0.0, 6.0, 0.0]
    # f = (0,0,1,0), P_2 ~ 1: L_a approaches E = 4, the most unbalanced value.
    assert routing.load_balancing_loss.item() == pytest.approx(4.0, rel=1e-6)


def test_expert_without_tokens_gets_zero_gradient():
    torch.manual_seed(0)
    m = MixtureOfAttentionHeads(16, 4, 1, 8, self_attention=True)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[1] = 3.0  # every token picks expert 1
    x = torch.rand(5, 2, 16) + 0.5
    y, _ = m(x, x, x)
    assert m.routing.load.tolist() == [0.0, 10.0, 0.0, 0.0]
    y.square().sum().backward()
    def grad(experts, e):
        return experts.weight.grad.select(experts.expert_dim, e)

    for unused in (0, 2, 3):
        assert torch.count_nonzero(grad(m.q_experts, unused)) == 0
        assert torch.count_nonzero(grad(m.o_experts, unused)) == 0
    assert torch.count_nonzero(grad(m.q_experts, 1)) > 0
    assert torch.isfinite(y).all()
