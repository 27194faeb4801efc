"""MoA and MoH in the dtypes users train in, float32 and bfloat16, against the float64 references.

The references (``reference_moa``, ``reference_moh``) loop over tokens, experts or heads and keys, written
from the papers' equations. In float64 the modules' expert projections run group by group
(:func:`moa.experts.looped_mm`, so that the float64 tests compare exactly); every training run takes
``F.grouped_mm`` instead, in float32 or bfloat16. Here each module path the dispatch rule can pick (MoA:
routed, dense; MoH: packed, all-heads; self-, causal and cross-attention, padded, incremental decoding)
runs in float32 and bfloat16, outputs and gradients, against the reference evaluated in float64 on the
same weights and inputs (rounded to the dtype first, so that only the arithmetic differs).

The bound (:func:`assert_within_rounding`) is stated in units of the dtype's unit roundoff
u = eps / 2 (float32 2^-24, bfloat16 2^-8):

* elementwise, |got - want| <= 32 u max|want|: the longest chain (projection, scores, probabilities,
  attention output, gated output projection, and the gradient's matmuls back through them) stores
  about eight rounded results in series, each within u of the magnitude of its terms, and signed sums'
  terms may exceed the result by a few times (4x room). Measured: at most 14 u (float32) and 3 u
  (bfloat16). A 0.1% error is 16,800 u in float32: far outside.
* in half precision a 1% error can sit within the elementwise bound (bfloat16: 2.6 u; float16, on CUDA
  in tests/gpu: 20 u); but rounding to nearest is unbiased, so the output's gain, <got - want, want> /
  <want, want>, averages the roundings out. Its spread shrinks as one over the square root of the
  independently rounded gates behind the output (one per active (token, head or expert) pair, P of
  them), so the bound is 4 u / sqrt(P) (measured: at most half of it), while gates off by 1% give a gain
  of 0.01 times the routed part of the output. float32 needs no such check (its kernels' own gain
  reaches about u, and the elementwise bound already sees 0.1%).

Every comparison has a negative control here: gates off by 0.1% (float32) or 1% (bfloat16) on the routed
path, and a padded key left unmasked, make it fail.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from moa import experts as experts_module
from moa.moa_attention import MixtureOfAttentionHeads
from moa.moh_attention import MixtureOfHeadsAttention
from moa.routing import TopKRouter, TwoStageHeadRouter
from test_attention_reference import reference_moa
from test_moh_attention import reference_moh

DTYPES = [torch.float32, torch.bfloat16]
ELEMENTWISE = 32  # units of u times max|reference|: see the module's docstring
GAIN = 4  # units of u / sqrt(active pairs), bfloat16 only
T, B, S = 12, 4, 9  # query length, batch, source length for cross-attention


def unit_roundoff(dtype) -> float:
    return torch.finfo(dtype).eps / 2


def assert_within_rounding(got, want, dtype, what, active_pairs=None, scale=None):
    """``got`` (dtype) against ``want`` (float64) within the bounds of the module's docstring; ``scale``
    replaces max|want| where the exact value is zero (a gradient that cancels by symmetry)."""
    u = unit_roundoff(dtype)
    error = got.double().cpu() - want
    scale = want.abs().max() if scale is None else scale
    worst = error.abs().max() / (u * scale)
    assert worst <= ELEMENTWISE, f"{what}: off by {worst:.1f} u of max|reference|, beyond {ELEMENTWISE} u"
    if active_pairs is not None and dtype in (torch.bfloat16, torch.float16):
        gain = (error * want).sum() / (want * want).sum()
        bound = GAIN * u / active_pairs ** 0.5
        assert gain.abs() <= bound, f"{what}: a systematic gain of {gain:.2e}, beyond {bound:.2e}"


def float64_copy(module):
    """The module's weights in float64, for the reference (without the last routing, which may hold a graph)."""
    routing, module.routing = module.routing, None
    try:
        return copy.deepcopy(module).double().cpu()
    finally:
        module.routing = routing


def _inputs(module, dtype, cross, seed=0):
    torch.manual_seed(seed)
    query = torch.randn(T, B, module.embed_dim).to(dtype)
    key = torch.randn(S, B, module.k_proj.in_features).to(dtype) if cross else query
    padding = torch.zeros(B, key.size(0), dtype=torch.bool)
    padding[1, -3:] = True
    padding[3, -1:] = True
    return query, key, padding


def _active_pairs(routing) -> int:
    """The gates behind the output: one per active (token, expert or head) pair."""
    return sum(0 if gates is None else gates.numel() for gates in (routing.gates, getattr(routing, "shared_gates", None)))


def compare_with_reference(module, dtype, cross=False, causal=False, reference_padding=None, device="cpu"):
    """One forward and backward of ``module`` in ``dtype`` on ``device`` against its reference in float64 (on
    the CPU) on the same weights and inputs: the output and the gradient of every parameter and input.
    ``reference_padding`` hands the reference another key padding than the module's (the negative control)."""
    module = module.to(device=device, dtype=dtype)
    wide = float64_copy(module)
    reference = reference_moa if isinstance(module, MixtureOfAttentionHeads) else reference_moh
    query, key, padding = _inputs(module, dtype, cross)
    masks = {"key_padding_mask": padding}
    if causal:
        masks["attn_mask"] = torch.triu(torch.full((T, T), float("-inf")), 1)
    leaves = [t.detach().to(device).requires_grad_() for t in (query, key)]
    got, _ = module(leaves[0], leaves[1], leaves[1], need_weights=False,
                    **{k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in masks.items()})
    active = _active_pairs(module.routing)
    wide_leaves = [t.detach().double().requires_grad_() for t in (query, key)]
    if reference_padding is not None:
        masks["key_padding_mask"] = reference_padding
    want = reference(wide, wide_leaves[0], wide_leaves[1], wide_leaves[1],
                     **{k: (v.double() if v.is_floating_point() else v) for k, v in masks.items()})
    assert_within_rounding(got, want, dtype, "output", active_pairs=active)
    probe = torch.randn(want.shape, dtype=torch.float64)
    params = [p for _, p in module.named_parameters()]
    grads = torch.autograd.grad((got.double() * probe.to(device)).sum(), params + leaves, allow_unused=True)
    want_grads = torch.autograd.grad((want * probe).sum(), list(wide.parameters()) + wide_leaves, allow_unused=True)
    names = [n for n, _ in module.named_parameters()] + ["query", "key"]  # distinct leaves in self-attention too
    by_name = dict(zip(names, want_grads))
    for name, g, w in zip(names, grads, want_grads):
        assert (g is None) == (w is None), name  # None only for a router the equations do not use (K = 0)
        if g is None:
            continue
        # softmax is invariant to a bias added to every key: that gradient is exactly 0, its computed value
        # rounding alone, measured against the scale of the key projection's weight gradient
        scale = by_name["k_proj.weight"].abs().max() if name == "k_proj.bias" else None
        assert_within_rounding(g, w, dtype, f"gradient of {name}", scale=scale)


def _moa(top_k=2, num_experts=6, cross=False, **kw):
    torch.manual_seed(1)
    kv = dict(kdim=24, vdim=24, encoder_decoder_attention=True) if cross else dict(self_attention=True)
    return MixtureOfAttentionHeads(32, num_experts, top_k, 16, **kv, **kw)


def _moh(heads=8, shared=2, top_k=3, cross=False, **kw):
    torch.manual_seed(1)
    kv = dict(kdim=24, vdim=24, encoder_decoder_attention=True) if cross else dict(self_attention=True)
    return MixtureOfHeadsAttention(64, heads, shared, top_k, **kv, **kw)


KINDS = {"self-padded": {}, "causal": {"causal": True}, "cross-padded": {"cross": True}}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ["routed", "dense"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moa_matches_the_reference_in_the_training_dtypes(dtype, path, kind, monkeypatch):
    monkeypatch.setattr(MixtureOfAttentionHeads, "path", path)
    compare_with_reference(_moa(cross=KINDS[kind].get("cross", False)), dtype, **KINDS[kind])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moa_with_every_expert_selected_matches_the_reference(dtype):
    """k = E: the dense path by the dispatch rule, with biases."""
    m = _moa(top_k=4, num_experts=4, bias=True)
    with torch.no_grad():
        for p in (m.q_experts.bias, m.o_experts.bias, m.v_proj.bias):
            p.normal_(std=0.1)
    compare_with_reference(m, dtype, causal=True)


MOH_CONFIGS = {"2-shared-top-3-of-6": (8, 2, 3), "no-shared-top-2-of-4": (4, 0, 2)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("config", MOH_CONFIGS)
@pytest.mark.parametrize("path", ["packed", "all-heads"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moh_matches_the_reference_in_the_training_dtypes(dtype, path, config, kind, monkeypatch):
    monkeypatch.setattr(MixtureOfHeadsAttention, "path", path)
    compare_with_reference(_moh(*MOH_CONFIGS[config], cross=KINDS[kind].get("cross", False)), dtype,
                           **KINDS[kind])


@pytest.mark.parametrize("top_k", [0, 6], ids=["shared-heads-only", "every-head"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moh_at_the_dial_ends_matches_the_reference(dtype, top_k):
    """K = 0 and K = E: all-heads by the dispatch rule (K = 0 is an inference setting: eval mode)."""
    m = _moh(8, 2, top_k)
    compare_with_reference(m.eval(), dtype, causal=True)


def _decode_against_reference(module, dtype, cross):
    """Incremental decoding one query at a time (the cached keys and values; MoA: the dense path, MoH:
    all-heads, as the dispatch rule picks for decoding) against the reference over the whole sequence."""
    module = module.to(dtype).eval()
    wide = float64_copy(module)
    query, key, padding = _inputs(module, dtype, cross)
    state, steps = {}, []
    with torch.no_grad():
        for t in range(T):
            if cross:
                y, _ = module(query[t:t + 1], key, key, key_padding_mask=padding, incremental_state=state,
                              static_kv=True, need_weights=False)
            else:
                y, _ = module(query[t:t + 1], query[t:t + 1], query[t:t + 1], incremental_state=state,
                              need_weights=False)
            steps.append(y)
    reference = reference_moa if isinstance(module, MixtureOfAttentionHeads) else reference_moh
    masks = {"key_padding_mask": padding} if cross else {"attn_mask": torch.triu(torch.full((T, T), float("-inf"),
                                                                                         dtype=torch.float64), 1)}
    want = reference(wide, query.double(), key.double(), key.double(), **masks)
    assert_within_rounding(torch.cat(steps), want, dtype, "decoded output")


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_incremental_decoding_matches_the_reference_in_the_training_dtypes(dtype, cross):
    _decode_against_reference(_moa(cross=cross), dtype, cross)
    _decode_against_reference(_moh(cross=cross), dtype, cross)


@pytest.mark.parametrize("kind", ["moa", "moh"])
def test_the_two_paths_agree_in_float32(kind):
    """MoA routed against dense, MoH packed against all-heads, in float32 with attention weights: each
    within the rounding bound of the other (both within it of the reference, above)."""
    m = (_moa() if kind == "moa" else _moh()).float()
    first, second = ("routed", "dense") if kind == "moa" else ("packed", "all-heads")
    query, _, padding = _inputs(m, torch.float32, False)
    future = torch.triu(torch.full((T, T), float("-inf")), 1)
    outputs = {}
    for path in (first, second):
        m.path = path
        outputs[path] = m(query, query, query, key_padding_mask=padding, attn_mask=future, need_weights=True)
    for got, want, what in zip(outputs[first], outputs[second], ("output", "weights")):
        assert_within_rounding(got, want.double(), torch.float32, f"{first} against {second}: {what}")


def _gates_off_by(monkeypatch, router_class, factor):
    """Every routed gate the router returns multiplied by ``factor``: a wrong weight on the routed path."""
    forward = router_class.forward

    def wrong(self, *args, **kwargs):
        routing = forward(self, *args, **kwargs)
        routing.gates = routing.gates * factor
        return routing

    monkeypatch.setattr(router_class, "forward", wrong)


ERRORS = {torch.float32: 1e-3, torch.bfloat16: 1e-2}  # the smallest errors the comparison must see


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gates_off_by_a_small_factor_fail_the_comparison(dtype, monkeypatch):
    """Negative control: 0.1% (float32) or 1% (bfloat16) on the routed gates, MoA's and MoH's routed heads'
    only (MoH's shared heads, a third of the output here, stay right), on the routed and packed paths."""
    for router_class, module, path in ((TopKRouter, _moa(), "routed"), (TwoStageHeadRouter, _moh(), "packed")):
        with monkeypatch.context() as patch:
            patch.setattr(type(module), "path", path)
            _gates_off_by(patch, router_class, 1 + ERRORS[dtype])
            with pytest.raises(AssertionError, match="output"):
                compare_with_reference(module, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_padded_key_left_unmasked_fails_the_comparison(dtype):
    """Negative control: the reference sees one key the module masks."""
    for module in (_moa(), _moh()):
        _, _, padding = _inputs(module, dtype, False)
        unmasked = padding.clone()
        unmasked[1, -1] = False
        with pytest.raises(AssertionError):
            compare_with_reference(module, dtype, reference_padding=unmasked)


def test_float64_and_the_training_dtypes_take_different_expert_code(monkeypatch):
    """float64 multiplies group by group (the exact references); float32 and bfloat16 call torch's grouped
    GEMM and never the loop, so a regression in one cannot hide behind the other."""
    calls = []
    looped, grouped = experts_module.looped_mm, F.grouped_mm
    monkeypatch.setattr(experts_module, "looped_mm", lambda *a: calls.append("loop") or looped(*a))
    monkeypatch.setattr(experts_module.F, "grouped_mm", lambda *a, **k: calls.append("grouped") or grouped(*a, **k))
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        for module in (_moa(), _moh()):
            module.path = "routed" if isinstance(module, MixtureOfAttentionHeads) else "packed"
            module = module.to(dtype)
            calls.clear()
            query, _, padding = _inputs(module, dtype, False)
            module(query, query, query, key_padding_mask=padding)[0].float().sum().backward()
            assert calls and set(calls) == ({"loop"} if dtype == torch.float64 else {"grouped"}), (dtype, calls)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ["packed", "all-heads"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moh_with_the_query_norm_router_matches_the_reference_in_the_training_dtypes(dtype, path, kind, monkeypatch):
    """The parameter-free router of converted models, which scores the routed heads by their queries' norms."""
    monkeypatch.setattr(MixtureOfHeadsAttention, "path", path)
    compare_with_reference(_moh(cross=KINDS[kind].get("cross", False), router="query-norm"), dtype, **KINDS[kind])
