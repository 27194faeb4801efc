"""SwitchHead attention equals the released layer (tests/switchhead_reference.py) with its weights loaded:
outputs and every gradient in float64 within 1e-10, self- and cross-attention, 1 and 2 heads, k < E and
k = E, with padding and the causal mask, on both of the module's paths; and the same module in float32
and bfloat16 against that float64 reference. Negative controls: a gate off by 1e-8 and a padded key
unmasked fail the comparison."""

import pytest
import torch

import moa  # noqa: F401
from moa.switchhead_attention import SwitchHeadAttention
from tests.switchhead_reference import ReleasedSwitchHead

D_MODEL, D_HEAD, B = 32, 16, 3  # a head width whose 1/sqrt(D) is exact in float32, as the released scale is held
TOL = 1e-10

CONFIGS = [  # (heads, experts, top_k, cross)
    (1, 4, 2, False),
    (2, 4, 2, True),
    (2, 3, 3, False),
    (1, 4, 4, True),
    (2, 5, 2, True),
    (2, 1, 1, False),  # E = 1: dense values, sigmoid-gated heads
]


def _pair(heads, experts, top_k, cross=False, seed=0):
    torch.manual_seed(seed)
    released = ReleasedSwitchHead(D_MODEL, heads, experts, D_HEAD, top_k).double()
    ours = SwitchHeadAttention(D_MODEL, heads, experts, top_k, D_HEAD, self_attention=not cross,
                               encoder_decoder_attention=cross).double()
    ours.load_released_state_dict(released.state_dict())
    return released, ours


def _inputs(cross, dtype=torch.float64, seed=1):
    """query, key (B, len, d) in float64, rounded to ``dtype`` first; the key padding (B, src_len)."""
    torch.manual_seed(seed)
    tgt, src = 7, (5 if cross else 7)  # the released layer wants the query at least as long as the keys
    query = torch.randn(B, tgt, D_MODEL).to(dtype).double()
    key = torch.randn(B, src, D_MODEL).to(dtype).double() if cross else query
    padding = torch.zeros(B, src, dtype=torch.bool)
    padding[1, -2:] = True
    padding[2, -1:] = True
    return query, key, padding


def _run_both(released, ours, cross, causal, path=None, ours_padding=None, gate_factor=None, dtype=torch.float64,
              device="cpu"):
    """(released output, our output, released grads, our grads) for one forward and backward on the same
    inputs and upstream gradient, ours in ``dtype`` on ``device`` (results brought to the CPU); grads: the
    inputs' and the parameters', paired by the released names."""
    query, key, padding = _inputs(cross, dtype)
    causal_mask = torch.triu(torch.ones(query.size(1), key.size(1), dtype=torch.bool), 1) if causal else None
    ours = ours.to(device=device, dtype=dtype)
    ours.path = path
    if gate_factor is not None:  # the negative control: every output gate scaled
        router = ours.output_router
        forward = router.forward
        router.forward = lambda *a, **kw: _scaled(forward(*a, **kw), gate_factor)
    q1, k1 = (t.detach().clone().requires_grad_() for t in (query, key))
    ref = released(q1, k1 if cross else q1, k1 if cross else q1, causal_mask, padding)
    q2, k2 = (t.detach().clone().to(device=device, dtype=dtype).requires_grad_() for t in (query, key))
    kv = k2 if cross else q2
    mask = None if causal_mask is None else torch.zeros(causal_mask.shape, dtype=dtype).masked_fill(causal_mask,
                                                                                                   float("-inf"))
    got, _ = ours(q2.transpose(0, 1), kv.transpose(0, 1), kv.transpose(0, 1),
                  key_padding_mask=(padding if ours_padding is None else ours_padding).to(device),
                  attn_mask=None if mask is None else mask.to(device), need_weights=False)
    got = got.transpose(0, 1)
    upstream = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (ref * upstream).sum().backward()
    (got * upstream.to(device=device, dtype=dtype)).sum().backward()
    theirs = {"query": q1.grad, "key": k1.grad if cross else None, **{n: p.grad for n, p in released.named_parameters()}}
    mine = {"query": q2.grad, "key": k2.grad if cross else None, **ours_grads_by_released_name(ours)}
    return ref, got.cpu(), theirs, {name: None if g is None else g.cpu() for name, g in mine.items()}


def _scaled(routing, factor):
    routing.gates = routing.gates * factor
    return routing


def ours_grads_by_released_name(module):
    """Our parameters' gradients in the released layout and names."""
    h, e, d = module.num_heads, module.num_experts, module.head_dim
    v, o = module.v_experts.weight.grad, module.o_experts.weight.grad
    grads = {"q.weight": module.q_proj.weight.grad, "k.weight": module.k_proj.weight.grad,
             "sel_o": module.output_router.weight.grad}
    if e > 1:
        grads.update({"sel_v": module.value_router.weight.grad, "v": v.transpose(0, 1), "o": o})
    else:
        grads.update({"v": v.permute(1, 2, 0).reshape(h * d, -1), "o": o.reshape(h * d, -1).t()})
    return grads


def _worst(ref, got, theirs, mine):
    """The largest difference, relative to each tensor's largest reference magnitude."""
    pairs = [(ref, got)] + [(theirs[n], mine[n]) for n in theirs if theirs[n] is not None]
    return max(((a - b.double()).abs().max() / a.abs().max().clamp(min=1e-30)).item() for a, b in pairs)


@pytest.mark.parametrize("heads,experts,top_k,cross", CONFIGS)
@pytest.mark.parametrize("path", ["routed", "dense"])
def test_equal_to_released_layer_in_float64(heads, experts, top_k, cross, path):
    released, ours = _pair(heads, experts, top_k, cross)
    ref, got, theirs, mine = _run_both(released, ours, cross, causal=not cross, path=path)
    assert set(theirs) == set(mine)
    for name in theirs:
        if theirs[name] is not None:
            assert torch.allclose(mine[name], theirs[name], rtol=TOL, atol=TOL), name
    assert torch.allclose(got, ref, rtol=TOL, atol=TOL)


def test_state_dict_of_the_released_layer_is_the_whole_of_ours():
    """Every parameter of ours comes from the released state dict (nothing left at its initialisation)."""
    released, ours = _pair(2, 4, 2)
    ours_names = {n for n, _ in ours.named_parameters()}
    assert ours_names == {"q_proj.weight", "k_proj.weight", "value_router.weight", "output_router.weight",
                          "v_experts.weight", "o_experts.weight"}
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in released.parameters())


@pytest.mark.parametrize("control", ["gate", "padding"])
def test_comparison_catches_a_small_error(control):
    released, ours = _pair(2, 4, 2, cross=True)
    if control == "gate":
        args = dict(gate_factor=1 + 1e-8)
    else:
        args = dict(ours_padding=torch.zeros(B, 5, dtype=torch.bool))
    ref, got, theirs, mine = _run_both(released, ours, cross=True, causal=False, path="routed", **args)
    assert _worst(ref, got, theirs, mine) > 10 * TOL


@pytest.mark.parametrize("dtype,units", [(torch.float32, 32), (torch.bfloat16, 32)])
@pytest.mark.parametrize("path", ["routed", "dense"])
def test_float32_and_bfloat16_against_the_float64_reference(dtype, units, path):
    """The paths users train on: the module in float32 and bfloat16 (grouped GEMM) on the float64 weights
    rounded to that dtype, against the released reference in float64 on the same rounded weights; within
    ``units`` unit roundoffs of the largest magnitude, as the MoA and MoH checks
    (tests/test_reference_precisions.py)."""
    released, ours = _pair(2, 4, 2, cross=True, seed=3)
    rounded = {n: p.to(dtype).double() for n, p in released.state_dict().items()}
    released.load_state_dict(rounded)
    ours.load_released_state_dict(rounded)
    ref, got, theirs, mine = _run_both(released, ours, cross=True, causal=False, path=path, dtype=dtype)
    unit = torch.finfo(dtype).eps / 2
    assert _worst(ref, got, theirs, mine) < units * unit



@pytest.mark.parametrize("sentences", [1, 3])
def test_beam_search_decodes_one_sentence_and_several(sentences):
    """fairseq's beam search on a tiny SwitchHead model: every step on the dense output path, one sentence
    included (its beam-folded encoder-decoder attention gives layouts whose permutes are views); equal to
    the hypotheses of the routed path."""
    from fairseq.sequence_generator import SequenceGenerator

    from helpers import build_model

    torch.manual_seed(0)
    model = build_model("switchhead_small", 40, ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim",
                                                 "32", "--encoder-ffn-embed-dim", "64", "--switchhead-experts", "4",
                                                 "--switchhead-head-dim", "8"]).eval()
    src = torch.randint(4, 40, (sentences, 6))
    hypotheses = []
    for path in (None, "routed"):
        for module in model.modules():
            if isinstance(module, SwitchHeadAttention):
                module.path = path
        generator = SequenceGenerator([model], model.decoder.dictionary, beam_size=4, max_len_b=5)
        out = generator.generate([model], {"net_input": {"src_tokens": src, "src_lengths": torch.full((sentences,), 6)}})
        hypotheses.append([[h["tokens"].tolist() for h in sentence] for sentence in out])
    assert hypotheses[0] == hypotheses[1] and len(hypotheses[0]) == sentences
