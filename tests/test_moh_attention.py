"""MixtureOfHeadsAttention against a slow reference written from the paper's equations, loops over
tokens and heads; fairseq's MultiheadAttention as the limit case; incremental decoding; L_b."""

import math

import pytest
import torch
from fairseq.modules.multihead_attention import MultiheadAttention

from moa.moh_attention import MixtureOfHeadsAttention
from moa.routing import TwoStageHeadRouter


@pytest.fixture(params=["packed", "every-head"])
def both_paths(request, monkeypatch):
    """Build the modules of a test with the packed path for the routed heads, or with every head
    computed and gated, whatever their token count (K = 0 and K = E always take the second)."""
    monkeypatch.setattr(MixtureOfHeadsAttention, "path", "packed" if request.param == "packed" else "all-heads")
    return request.param


def reference_query_norm_gates(m: MixtureOfHeadsAttention, x):
    """One token's gate per head under the query-norm router: 1 for the shared heads and for the top-K
    routed heads by the L2 norm of their query, carrying the gradient of p = softmax(s / mean s)
    through a straight-through estimator 1 + p - detach(p)."""
    r, d = m.router, m.head_dim
    gates = torch.zeros(m.num_heads, dtype=x.dtype)
    gates[:r.shared_heads] = 1.0
    if r.top_k:
        norms = torch.stack([(x @ m.q_proj.weight[i * d:(i + 1) * d].T + m.q_proj.bias[i * d:(i + 1) * d]).norm()
                             for i in range(r.shared_heads, m.num_heads)])
        p = torch.softmax(norms / norms.mean(), dim=0)
        for i in p.topk(r.top_k).indices.tolist():
            gates[r.shared_heads + i] = 1.0 + p[i] - p[i].detach()
    return gates


def reference_gates(m: MixtureOfHeadsAttention, x):
    """One token's gate per head, from the equations (Sec. 3.2) or the released code's scaling."""
    r = m.router
    if r.needs_routed_queries:
        return reference_query_norm_gates(m, x)
    unit = r.gate_scale == "unit"
    gates = torch.zeros(m.num_heads, dtype=x.dtype)
    alpha = torch.ones(2, dtype=x.dtype)
    if r.shared_heads and r.routed_heads:  # both groups exist (whatever K is now)
        alpha = torch.softmax(r.mix.weight @ x, dim=0) * (2 if unit else 1)
    if r.shared_heads:
        s = torch.softmax(r.shared.weight @ x, dim=0) * (r.shared_heads if unit else 1)
        gates[:r.shared_heads] = alpha[0] * s
    if r.top_k:
        p = torch.softmax(r.routed.weight @ x, dim=0)
        top_p, top_i = p.topk(r.top_k)
        routed = r.top_k * top_p / top_p.sum() if unit else top_p
        for g, i in zip(routed, top_i.tolist()):
            gates[r.shared_heads + i] = alpha[1] * g
    return gates


def reference_moh(m: MixtureOfHeadsAttention, query, key, value, key_padding_mask=None, attn_mask=None):
    """y_t = b_O + sum_i g_{t,i} softmax(q_{t,i} K_i^T / sqrt(D)) V_i W_O^i, token by token, head by head."""
    tgt_len, bsz, _ = query.shape
    d = m.head_dim
    out = torch.zeros_like(query)
    for b in range(bsz):
        keys = key[:, b] @ m.k_proj.weight.T + m.k_proj.bias
        values = value[:, b] @ m.v_proj.weight.T + m.v_proj.bias
        for t in range(tgt_len):
            x = query[t, b]
            gates = reference_gates(m, x)
            y = m.out_proj.bias.clone()
            for i in range(m.num_heads):
                if gates[i] == 0:
                    continue
                cols = slice(i * d, (i + 1) * d)
                q = x @ m.q_proj.weight[cols].T + m.q_proj.bias[cols]
                scores = (keys[:, cols] @ q) * d ** -0.5
                if key_padding_mask is not None:
                    scores = scores.masked_fill(key_padding_mask[b].bool(), float("-inf"))
                if attn_mask is not None:
                    scores = scores + attn_mask[t]
                head = torch.softmax(scores, dim=0) @ values[:, cols]
                y = y + gates[i] * (head @ m.out_proj.weight[:, cols].T)
            out[t, b] = y
    return out


def _module(num_heads, shared, top_k, gate_scale="unit", embed_dim=24, **kw):
    torch.manual_seed(3)
    m = MixtureOfHeadsAttention(embed_dim, num_heads, shared, top_k, gate_scale=gate_scale, **kw).double()
    with torch.no_grad():
        for p in (m.q_proj.bias, m.k_proj.bias, m.v_proj.bias, m.out_proj.bias):
            p.normal_()  # non-zero biases, so that their gradients are checked too
    return m


def _check(m, query, key, value, reference_module=None, reference_masks=None, **masks):
    """The module's output and every gradient against the reference's, in float64. ``reference_module`` and
    ``reference_masks`` give the reference other weights or masks (the negative controls)."""
    params = list(m.parameters())
    inputs = [t.detach().clone().requires_grad_() for t in (query, key, value)]
    probe = torch.randn_like(query)
    got, _ = m(*inputs, need_weights=False, **masks)
    got_grads = torch.autograd.grad((got * probe).sum(), params + inputs, allow_unused=True)
    ref_inputs = [t.detach().clone().requires_grad_() for t in (query, key, value)]
    reference = m if reference_module is None else reference_module
    want = reference_moh(reference, *ref_inputs, **(masks if reference_masks is None else reference_masks))
    want_grads = torch.autograd.grad((want * probe).sum(), list(reference.parameters()) + ref_inputs,
                                     allow_unused=True)
    # float64 throughout, the routers included: each operation rounds at 1.1e-16 of its terms, and no chain here
    # sums more than a few hundred terms, so 1e-9 leaves a thousandfold room while an error of 1e-8 fails
    # (test_a_wrong_weight_or_mask_fails_the_comparison)
    tol = dict(rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(got, want, **tol)
    with torch.no_grad():  # the path that returns weights: the same output (its softmax is float64 here too)
        torch.testing.assert_close(m(query, key, value, need_weights=True, **masks)[0], got.detach(), **tol)
    names = [n for n, _ in m.named_parameters()] + ["query", "key", "value"]
    for name, g, w in zip(names, got_grads, want_grads):
        assert (g is None) == (w is None), name  # None only for a router the equations do not use (K = 0)
        if g is None:
            continue
        torch.testing.assert_close(g, w, **tol, msg=lambda msg: f"gradient of {name}: {msg}")


def test_a_wrong_weight_or_mask_fails_the_comparison(both_paths):
    """Negative controls: one output-projection weight of a routed head off by 1e-8 of its size, or one
    padded key left unmasked, in the reference's copy, and the comparison fails."""
    import copy

    m = _module(8, 2, 3, self_attention=True)
    x = torch.randn(6, 3, 24, dtype=torch.double)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[0, 4:] = True
    with torch.no_grad():  # (a routing with a graph would not deep-copy)
        m(x, x, x, key_padding_mask=padding)
    head = m.shared_heads + int(m.routing.selected[0, 0])  # a routed head the first token selected
    wrong = copy.deepcopy(m)
    with torch.no_grad():
        wrong.out_proj.weight[0, head * m.head_dim] *= 1 + 1e-8
    with pytest.raises(AssertionError):
        _check(m, x, x, x, reference_module=wrong, key_padding_mask=padding)
    unmasked = padding.clone()
    unmasked[0, 5] = False
    with pytest.raises(AssertionError):
        _check(m, x, x, x, reference_masks={"key_padding_mask": unmasked}, key_padding_mask=padding)


CONFIGS = [(8, 2, 3), (8, 4, 2), (6, 0, 2), (4, 1, 1), (4, 4, 0), (4, 1, 3)]


@pytest.mark.parametrize("gate_scale", ["unit", "softmax"])
@pytest.mark.parametrize("heads, shared, top_k", CONFIGS, ids=[f"h{h}-s{s}-k{k}" for h, s, k in CONFIGS])
def test_self_attention_with_padding_matches_the_reference(heads, shared, top_k, gate_scale, both_paths):
    m = _module(heads, shared, top_k, gate_scale, self_attention=True)
    x = torch.randn(6, 3, 24, dtype=torch.double)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[0, 4:] = True
    padding[2, :1] = True  # left padding, as fairseq pads source sentences
    _check(m, x, x, x, key_padding_mask=padding)


@pytest.mark.parametrize("gate_scale", ["unit", "softmax"])
@pytest.mark.parametrize("heads, shared, top_k", CONFIGS[:3], ids=[f"h{h}-s{s}-k{k}" for h, s, k in CONFIGS[:3]])
def test_causal_self_attention_matches_the_reference(heads, shared, top_k, gate_scale, both_paths):
    m = _module(heads, shared, top_k, gate_scale, self_attention=True)
    x = torch.randn(7, 2, 24, dtype=torch.double)
    future = torch.triu(torch.full((7, 7), float("-inf"), dtype=torch.double), 1)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 5:] = True
    _check(m, x, x, x, key_padding_mask=padding, attn_mask=future)


def test_cross_attention_matches_the_reference(both_paths):
    m = _module(8, 2, 3, kdim=16, vdim=16, encoder_decoder_attention=True)
    query = torch.randn(5, 2, 24, dtype=torch.double)
    memory = torch.randn(9, 2, 16, dtype=torch.double)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[0, :3] = True
    _check(m, query, memory, memory, key_padding_mask=padding)


QUERY_NORM = [(8, 2, 3), (4, 1, 1), (6, 0, 2)]  # fewer active heads than routed ones


@pytest.mark.parametrize("heads, shared, top_k", QUERY_NORM, ids=[f"h{h}-s{s}-k{k}" for h, s, k in QUERY_NORM])
def test_query_norm_router_matches_the_reference_with_padding_causal_masks_and_cross_attention(heads, shared, top_k,
                                                                                               both_paths):
    m = _module(heads, shared, top_k, self_attention=True, router="query-norm")
    x = torch.randn(7, 3, 24, dtype=torch.double)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[0, 5:] = True
    padding[2, :2] = True
    _check(m, x, x, x, key_padding_mask=padding)
    future = torch.triu(torch.full((7, 7), float("-inf"), dtype=torch.double), 1)
    right_padding = torch.zeros(3, 7, dtype=torch.bool)
    right_padding[1, 4:] = True  # a causal mask goes with right padding (the decoder's target side)
    _check(m, x, x, x, key_padding_mask=right_padding, attn_mask=future)
    cross = _module(heads, shared, top_k, kdim=16, vdim=16, encoder_decoder_attention=True, router="query-norm")
    memory = torch.randn(9, 3, 16, dtype=torch.double)
    memory_padding = torch.zeros(3, 9, dtype=torch.bool)
    memory_padding[1, :4] = True
    _check(cross, x, memory, memory, key_padding_mask=memory_padding)
    # the tokens did not all select the same routed heads
    assert len({tuple(row) for row in cross.routing.selected.tolist()}) > 1


def test_active_heads_path_equals_computing_every_head():
    m = _module(8, 2, 3, self_attention=True)
    m.path = "packed"
    x = torch.randn(11, 4, 24, dtype=torch.double)
    future = torch.triu(torch.full((11, 11), float("-inf"), dtype=torch.double), 1)
    sparse, sparse_weights = m(x, x, x, attn_mask=future, need_weights=True)
    m.path = "all-heads"
    dense, dense_weights = m(x, x, x, attn_mask=future, need_weights=True)
    torch.testing.assert_close(sparse, dense)
    torch.testing.assert_close(sparse_weights, dense_weights)
    torch.testing.assert_close(sparse_weights.sum(-1), torch.ones(4, 11, dtype=torch.double))


def test_every_head_active_with_uniform_routers_is_fairseqs_multihead_attention():
    torch.manual_seed(0)
    mha = MultiheadAttention(32, 4, self_attention=True).double().eval()
    m = MixtureOfHeadsAttention(32, 4, 1, 3, self_attention=True, gate_scale="unit").double().eval()
    missing = m.load_state_dict(mha.state_dict(), strict=False)
    assert sorted(missing.missing_keys) == ["router.mix.weight", "router.routed.weight", "router.shared.weight"]
    assert not missing.unexpected_keys
    with torch.no_grad():
        for p in m.router.parameters():
            p.zero_()  # uniform routing: every active gate is exactly 1
    x = torch.randn(6, 3, 32, dtype=torch.double)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, 4:] = True
    want, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False)
    got, _ = m(x, x, x, key_padding_mask=padding, need_weights=False)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)  # float64: see _check
    with torch.no_grad():  # negative control: one of fairseq's weights off by 1e-8, and they differ
        mha.out_proj.weight[0, 0] *= 1 + 1e-8
    with pytest.raises(AssertionError):
        torch.testing.assert_close(m(x, x, x, key_padding_mask=padding, need_weights=False)[0],
                                   mha(x, x, x, key_padding_mask=padding, need_weights=False)[0], rtol=1e-9, atol=1e-10)
    assert sum(p.numel() for p in m.router.parameters()) == 32 * (4 + 2)


def test_incremental_decoding_equals_the_causal_forward_also_after_a_beam_reorder():
    m = _module(8, 2, 2, self_attention=True).eval()
    x = torch.randn(6, 4, 24, dtype=torch.double)
    future = torch.triu(torch.full((6, 6), float("-inf"), dtype=torch.double), 1)
    full, _ = m(x, x, x, attn_mask=future, need_weights=False)
    state, steps = {}, []
    for t in range(6):
        step = x[t:t + 1]
        y, _ = m(step, step, step, incremental_state=state, need_weights=False)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps), full)
    assert m._get_input_buffer(state)["prev_key"].shape == (4, 8, 6, 3)  # every head is cached
    order = torch.tensor([2, 0, 3, 1])
    m.reorder_incremental_state(state, order)
    x_next = torch.randn(1, 4, 24, dtype=torch.double)
    y, _ = m(x_next, x_next, x_next, incremental_state=state, need_weights=False)
    reordered = torch.cat([x[:, order], x_next])
    mask = torch.triu(torch.full((7, 7), float("-inf"), dtype=torch.double), 1)
    want, _ = m(reordered, reordered, reordered, attn_mask=mask, need_weights=False)
    torch.testing.assert_close(y, want[-1:])


DIAL = [0, 1, 2, 6]  # the module below trained with K = 3 of 6 routed heads


@pytest.mark.parametrize("gate_scale", ["unit", "softmax"])
@pytest.mark.parametrize("top_k", DIAL, ids=[f"k{k}" for k in DIAL])
def test_the_routed_top_k_is_an_inference_dial(top_k, gate_scale, both_paths):
    """A model trained with K = 3 decodes with K' routed heads (0: the shared heads only): the trained
    weights load unchanged and the output is the equations' at K', the other heads' terms dropped."""
    trained = _module(8, 2, 3, gate_scale, self_attention=True)
    m = MixtureOfHeadsAttention(24, 8, 2, top_k, gate_scale=gate_scale, self_attention=True).double().eval()
    m.load_state_dict(trained.state_dict())  # strict: K changes no parameter
    x = torch.randn(6, 3, 24, dtype=torch.double)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[0, 4:] = True
    _check(m, x, x, x, key_padding_mask=padding)
    future = torch.triu(torch.full((6, 6), float("-inf"), dtype=torch.double), 1)
    with torch.no_grad():
        full, _ = m(x, x, x, attn_mask=future)
        state = {}
        steps = [m(x[t:t + 1], x[t:t + 1], x[t:t + 1], incremental_state=state)[0] for t in range(6)]
    torch.testing.assert_close(torch.cat(steps), full)
    # K = 0 caches, and projects, the keys and values of the shared heads only
    assert m._get_input_buffer(state)["prev_key"].shape == (3, 8 if top_k else 2, 6, 3)


def test_training_with_no_routed_head_active_is_refused():
    m = _module(8, 2, 0, self_attention=True)  # training mode
    x = torch.randn(3, 2, 24, dtype=torch.double)
    with pytest.raises(ValueError, match="inference setting .*--model-overrides.*train with --moh-top-k"):
        m(x, x, x)
    assert m.eval()(x, x, x)[0].shape == x.shape


def _softmax(row):
    z = sum(math.exp(v) for v in row)
    return [math.exp(v) / z for v in row]


@pytest.mark.parametrize("balance_loss, scale", [("paper", 1), ("experts-scaled", 3)])
def test_balance_loss_matches_hand_computation_and_ignores_padding(balance_loss, scale):
    router = TwoStageHeadRouter(3, num_heads=4, shared_heads=1, top_k=1, balance_loss=balance_loss)
    with torch.no_grad():
        router.routed.weight.copy_(torch.eye(3))  # routed logits = x
    tokens = [[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [3.0, 0.0, 1.0], [0.0, 0.0, 2.0]]
    probs = [_softmax(t) for t in tokens]
    f = [2 / 4, 1 / 4, 1 / 4]  # tokens 1 and 3 select head 0, token 2 head 1, token 4 head 2
    mean_p = [sum(p[i] for p in probs) / 4 for i in range(3)]
    want = scale * sum(fi * pi for fi, pi in zip(f, mean_p))
    routing = router(torch.tensor(tokens))
    assert routing.selected.flatten().tolist() == [0, 1, 0, 2]
    assert routing.balance_loss.item() == pytest.approx(want, rel=1e-6)
    assert routing.load.tolist() == [2.0, 1.0, 1.0]
    padded = router(torch.tensor(tokens + [[9.0, -3.0, 5.0]] * 2),
                    torch.tensor([False] * 4 + [True] * 2))
    assert padded.balance_loss.item() == pytest.approx(want, rel=1e-6)
    assert padded.load.tolist() == [2.0, 1.0, 1.0]
    uniform = TwoStageHeadRouter(3, 4, 1, 1, balance_loss=balance_loss)
    torch.nn.init.zeros_(uniform.routed.weight)
    assert uniform(torch.randn(6, 3)).balance_loss.item() == pytest.approx(scale * 1 / 3)  # K/E, or K


def test_bad_head_counts_are_refused():
    with pytest.raises(ValueError, match="top_k must be between 0 and the 4 routed heads, got 5"):
        TwoStageHeadRouter(8, 4, 0, 5)
    with pytest.raises(ValueError, match="top_k must be at least 1 when no head is shared"):
        TwoStageHeadRouter(8, 4, 0, 0)
    with pytest.raises(ValueError, match="shared_heads must be between 0 and num_heads=4"):
        TwoStageHeadRouter(8, 4, 5, 0)
    with pytest.raises(ValueError, match="not divisible"):
        MixtureOfHeadsAttention(30, 4, 1, 1)
