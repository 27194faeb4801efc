"""MixtureOfAttentionHeads against a slow reference that loops over tokens and experts."""

import pytest
import torch

from moa.moa_attention import MixtureOfAttentionHeads

@pytest.fixture(params=["routed", "dense"])
def both_paths(request, monkeypatch):
    """Run the modules of a test on the routed path (per-expert projections) or the dense one (every
    expert in one matmul), whatever their token count and mode."""
    monkeypatch.setattr(MixtureOfAttentionHeads, "path", request.param)
    return request.param


def reference_moa(m: MixtureOfAttentionHeads, query, key, value, key_padding_mask=None, attn_mask=None):
    """The paper's equations token by token: route, then for each selected expert
    q = x W_q^e, o = softmax(q K^T / sqrt(D)) V, y += w * o W_o^e."""
    tgt_len, bsz, _ = query.shape
    src_len = key.shape[0]
    out = torch.zeros_like(query)
    w_k, w_v = m.k_proj.weight, m.v_proj.weight

    def bias(b, index=None):
        return 0 if b is None else (b if index is None else b[index])

    for b in range(bsz):
        keys = key[:, b] @ w_k.T + bias(m.k_proj.bias)  # (S, D)
        values = value[:, b] @ w_v.T + bias(m.v_proj.bias)
        for t in range(tgt_len):
            x = query[t, b]
            router_dtype = torch.promote_types(x.dtype, torch.float32)  # the router's: float32 or wider
            probs = torch.softmax(m.router.weight.to(router_dtype) @ x.to(router_dtype), dim=-1)
            top_p, top_e = probs.topk(m.top_k)
            if m.router.gate_weights == "renormalized":
                gates = top_p / top_p.sum().detach()
            else:
                gates = top_p
            y = torch.zeros_like(x)
            for gate, e in zip(gates, top_e.tolist()):
                q = x @ m.q_experts.expert_weight(e) + bias(m.q_experts.bias, e)
                scores = []
                for s in range(src_len):
                    blocked = key_padding_mask is not None and bool(key_padding_mask[b, s])
                    if attn_mask is not None:
                        blocked = blocked or (bool(attn_mask[t, s]) if attn_mask.dtype == torch.bool
                                              else float(attn_mask[t, s]) == float("-inf"))
                    score = (q @ keys[s]) * m.head_dim ** -0.5
                    scores.append(torch.full_like(score, float("-inf")) if blocked else score)
                attn = torch.softmax(torch.stack(scores), dim=0)
                o = attn @ values
                y = y + gate.to(x.dtype) * (o @ m.o_experts.expert_weight(e) + bias(m.o_experts.bias, e))
            out[t, b] = y
    return out


def _module(num_experts, top_k, gate_weights="renormalized", **kw):
    torch.manual_seed(1)
    return MixtureOfAttentionHeads(16, num_experts, top_k, 8, gate_weights=gate_weights, **kw).double()


def _check_outputs_and_grads(m, query, key, value, reference_module=None, reference_masks=None, **masks):
    """The module's output and every gradient against the reference's, in float64. ``reference_module`` and
    ``reference_masks`` give the reference other weights or masks (the negative controls)."""
    inputs = [t.detach().clone().requires_grad_() for t in (query, key, value)]
    params = [p for p in m.parameters()]
    probe = torch.randn_like(query)
    got, _ = m(*inputs, need_weights=False, **masks)
    got_grads = torch.autograd.grad((got * probe).sum(), params + inputs)
    ref_inputs = [t.detach().clone().requires_grad_() for t in (query, key, value)]
    reference = m if reference_module is None else reference_module
    want = reference_moa(reference, *ref_inputs, **(masks if reference_masks is None else reference_masks))
    want_grads = torch.autograd.grad((want * probe).sum(), list(reference.parameters()) + ref_inputs)
    # float64 throughout, the router included: each operation rounds at 1.1e-16 of its terms, and no chain here
    # sums more than a few hundred terms, so 1e-9 leaves a thousandfold room while an error of 1e-8 fails
    # (test_a_wrong_weight_or_mask_fails_the_comparison)
    tol = dict(rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(got, want, **tol)
    with torch.no_grad():  # the path that returns attention weights computes the same output
        torch.testing.assert_close(m(query, key, value, need_weights=True, **masks)[0], got.detach(), **tol)
    names = [n for n, _ in m.named_parameters()] + ["query", "key", "value"]
    for name, g, w in zip(names, got_grads, want_grads):
        torch.testing.assert_close(g, w, **tol, msg=lambda msg: f"gradient of {name}: {msg}")


def test_a_wrong_weight_or_mask_fails_the_comparison(both_paths):
    """Negative controls: one output-projection weight of one expert off by 1e-8 of its size, or one padded
    key left unmasked, in the reference's copy, and the comparison fails."""
    import copy

    m = _module(6, 2, self_attention=True)
    x = torch.randn(7, 3, 16, dtype=torch.double)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[1, 5:] = True
    wrong = copy.deepcopy(m)
    with torch.no_grad():  # (a routing with a graph would not deep-copy)
        m(x, x, x, key_padding_mask=padding)
    used = int(m.routing.selected[0, 0])  # an expert the first token selected
    with torch.no_grad():
        wrong.o_experts.weight[used, 0, 0] *= 1 + 1e-8
    with pytest.raises(AssertionError):
        _check_outputs_and_grads(m, x, x, x, reference_module=wrong, key_padding_mask=padding)
    unmasked = padding.clone()
    unmasked[1, 6] = False
    with pytest.raises(AssertionError):
        _check_outputs_and_grads(m, x, x, x, reference_masks={"key_padding_mask": unmasked}, key_padding_mask=padding)


@pytest.mark.parametrize("gate_weights", ["renormalized", "raw"])
def test_self_attention_with_padding_matches_reference(gate_weights, both_paths):
    m = _module(6, 2, gate_weights, self_attention=True)
    x = torch.randn(7, 3, 16, dtype=torch.double)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[1, 5:] = True
    padding[2, 3:] = True
    _check_outputs_and_grads(m, x, x, x, key_padding_mask=padding)


def test_causal_self_attention_matches_reference(both_paths):
    m = _module(5, 3, self_attention=True)
    x = torch.randn(6, 2, 16, dtype=torch.double)
    future = torch.triu(torch.full((6, 6), float("-inf"), dtype=torch.double), 1)
    _check_outputs_and_grads(m, x, x, x, attn_mask=future)
    bool_future = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    _check_outputs_and_grads(m, x, x, x, attn_mask=bool_future)


def test_encoder_decoder_attention_matches_reference(both_paths):
    torch.manual_seed(2)
    m = MixtureOfAttentionHeads(16, 4, 2, 8, kdim=12, vdim=12, encoder_decoder_attention=True).double()
    query = torch.randn(5, 2, 16, dtype=torch.double)
    memory = torch.randn(9, 2, 12, dtype=torch.double)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[0, 6:] = True
    _check_outputs_and_grads(m, query, memory, memory, key_padding_mask=padding)


@pytest.mark.parametrize("top_k", [4, 2])  # k == E always takes the dense path
def test_biases_match_reference(top_k, both_paths):
    m = _module(4, top_k, self_attention=True, bias=True)
    with torch.no_grad():
        for p in (m.q_experts.bias, m.o_experts.bias, m.k_proj.bias, m.v_proj.bias):
            p.normal_()
    x = torch.randn(5, 2, 16, dtype=torch.double)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[0, 3:] = True
    _check_outputs_and_grads(m, x, x, x, key_padding_mask=padding)


def test_all_experts_selected_matches_reference():
    m = _module(4, 4, self_attention=True)
    x = torch.randn(5, 2, 16, dtype=torch.double)
    _check_outputs_and_grads(m, x, x, x)
    future = torch.triu(torch.full((5, 5), float("-inf"), dtype=torch.double), 1)
    _check_outputs_and_grads(m, x, x, x, attn_mask=future)


def test_attention_weights_are_averaged_over_selected_experts(both_paths):
    m = _module(4, 2, self_attention=True)
    x = torch.randn(5, 2, 16, dtype=torch.double)
    _, mean_weights = m(x, x, x, need_weights=True)
    _, per_slot = m(x, x, x, need_head_weights=True)
    assert mean_weights.shape == (2, 5, 5) and per_slot.shape == (2, 2, 5, 5)
    torch.testing.assert_close(mean_weights, per_slot.mean(dim=0))
    torch.testing.assert_close(mean_weights.sum(-1), torch.ones(2, 5, dtype=torch.double))


def test_projections_run_only_on_routed_rows(monkeypatch):
    """Each expert matmul sees exactly the rows routed to it: N*k rows in all, not N*E."""
    m = _module(8, 2, self_attention=True)
    m.path = "routed"
    x = torch.randn(6, 3, 16, dtype=torch.double)
    seen = []
    original = type(m.q_experts).forward

    def counting(self, rows, src, dst, counts, out_rows, **kwargs):
        seen.append((src.numel(), counts.tolist()))
        return original(self, rows, src, dst, counts, out_rows, **kwargs)

    monkeypatch.setattr(type(m.q_experts), "forward", counting)
    m(x, x, x)
    load = m.routing.load.long().tolist()
    assert seen == [(18 * 2, load), (18 * 2, load)]


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="top_k"):
        MixtureOfAttentionHeads(16, 4, 5, 8)
    with pytest.raises(ValueError, match="gate_weights"):
        MixtureOfAttentionHeads(16, 4, 2, 8, gate_weights="softmax")
