"""The figures of moa-analyze on hand-built routings whose answers are known, the head recomputation
against the modules' own outputs, and the per-module training figures for TensorBoard."""

import math

import pytest
import torch
from fairseq.modules.multihead_attention import MultiheadAttention

from helpers import TINY, build_model, translation_sample
from moa.criterions.aux_loss import RoutingLossConfig, log_module_figures, routing_aux_loss
from moa.models.routed_transformer import attention_site
from moa.moh_attention import MixtureOfHeadsAttention
from moa.moa_attention import MixtureOfAttentionHeads
from moa_tools.routing_analysis import HeadSimilarity, ModuleRouting, head_outputs, pmi_table, top_choice_changes


def test_uniform_routing_has_entropy_log_e_and_load_one_over_e_and_padding_is_left_out():
    e, n = 4, 8
    experts = torch.arange(n * 2).remainder(e).view(n, 2)  # every expert twice per 4 tokens
    probs = torch.full((n, e), 1 / e)
    module = ModuleRouting("encoder.layers.0.self_attn", "encoder-self", 0, "MoA", e, 2)
    padding_experts = torch.zeros(3, 2, dtype=torch.long)  # padding: all on expert 0, a peaked router
    padding_probs = torch.tensor([[1.0, 0, 0, 0]]).expand(3, -1)
    module.add(torch.cat([experts, padding_experts]), torch.cat([probs, padding_probs]), torch.full((n + 3,), 0.5),
               torch.tensor([True] * n + [False] * 3), torch.arange(n + 3))
    summary = module.summary()
    assert summary["tokens"] == n and summary["load"] == [0.25] * 4
    assert summary["router_entropy"] == pytest.approx(math.log(4)) == pytest.approx(summary["max_entropy"])
    assert summary["top_gate_weight"] == pytest.approx(0.5)


def test_a_token_always_sent_to_one_expert_has_the_top_pmi_for_it():
    torch.manual_seed(0)
    tokens = torch.randint(10, 30, (400,))
    tokens[::4] = 7
    experts = torch.randint(0, 4, (400, 1))
    experts[tokens == 7] = 2
    table = pmi_table(tokens, experts, 4, min_count=5, top=3)
    best = table[2][0]
    assert best[0] == 7 and best[2] == best[3] == 100
    p_expert_2 = float((experts == 2).double().mean())
    assert best[1] == pytest.approx(math.log(1 / p_expert_2))
    assert all(row[0] != 7 for e in (0, 1, 3) for row in table[e])  # never routed there
    rare = pmi_table(torch.tensor([5, 6, 6, 6]), torch.tensor([[0], [1], [1], [1]]), 2, min_count=2, top=5)
    assert [row[0] for row in rare[0]] == [] and [row[0] for row in rare[1]] == [6]


def test_top_choice_changes_between_neighbouring_layers_of_one_type():
    def module(layer, top, kind="encoder-self"):
        m = ModuleRouting(f"encoder.layers.{layer}.self_attn", kind, layer, "MoA", 4, 1)
        m.add(top[:, None], torch.full((4, 4), 0.25), torch.ones(4), torch.ones(4, dtype=torch.bool), torch.arange(4))
        return m

    a, b, c = module(0, torch.tensor([0, 1, 2, 3])), module(1, torch.tensor([0, 1, 0, 0])), \
        module(2, torch.tensor([0, 1, 0, 0]))
    other = module(0, torch.tensor([3, 3, 3, 3]), "decoder-self")
    assert top_choice_changes([c, a, other, b]) == {b.name: 0.5, c.name: 0.0}


def test_head_similarity_is_one_for_equal_heads_and_zero_for_disjoint_ones():
    equal = HeadSimilarity("x", "encoder-self", 0)
    pattern = torch.softmax(torch.randn(2, 1, 3, 5), dim=-1).expand(-1, 2, -1, -1)
    outputs = torch.randn(2, 1, 3, 8).expand(-1, 2, -1, -1)
    keep = torch.tensor([[True, True, False], [True, False, False]])
    equal.add(pattern, outputs, keep)
    assert equal.summary()["attention_similarity"] == pytest.approx(1.0)
    assert equal.summary()["output_cosine"] == pytest.approx(1.0)
    assert equal.count == 3  # pairs x kept queries

    disjoint = HeadSimilarity("x", "encoder-self", 0)
    one_hot = torch.zeros(1, 2, 1, 4)
    one_hot[0, 0, 0, 0] = one_hot[0, 1, 0, 3] = 1.0
    disjoint.add(one_hot, torch.tensor([[1.0, 0], [0, 1.0]]).view(1, 2, 1, 2), torch.ones(1, 1, dtype=torch.bool))
    assert disjoint.summary() == {"name": "x", "type": "encoder-self", "layer": 0, "heads": 2,
                                  "attention_similarity": 0.0, "output_cosine": 0.0}


@pytest.mark.parametrize("kind", ["mha", "moh"])
def test_head_outputs_recompute_the_modules_weights_and_output(kind):
    torch.manual_seed(2)
    if kind == "mha":
        module = MultiheadAttention(16, 4, self_attention=True)
        module.skip_embed_dim_check = True  # fairseq's own path: torch's fast path drops need_head_weights
    else:  # zero routers under the unit scale: every head active with a gate of exactly 1
        module = MixtureOfHeadsAttention(16, 4, shared_heads=1, top_k=3, self_attention=True, gate_scale="unit")
        for p in module.router.parameters():
            torch.nn.init.zeros_(p)
    dtype = torch.float32 if kind == "mha" else torch.float64  # fairseq's own MHA path mixes in float32
    module = module.to(dtype).eval()
    x = torch.randn(5, 2, 16, dtype=dtype)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    future = torch.triu(torch.full((5, 5), float("-inf"), dtype=dtype), 1)
    y, weights = module(x, x, x, key_padding_mask=padding, attn_mask=future, need_weights=True, need_head_weights=True)
    attention, outputs = head_outputs(module, x, x, padding, future)
    # float32 (fairseq's MHA): torch's float32 defaults; float64: rounding only, as the reference tests
    tol = dict(rtol=1.3e-6, atol=1e-5) if kind == "mha" else dict(rtol=1e-9, atol=1e-12)
    assert torch.allclose(attention, weights.transpose(0, 1), **tol)  # fairseq: (H, B, T, S)
    assert torch.allclose(outputs.sum(dim=1).transpose(0, 1) + module.out_proj.bias, y, **tol)


def test_moa_expert_outputs_gated_by_the_routing_are_the_modules_output():
    torch.manual_seed(3)
    module = MixtureOfAttentionHeads(16, 6, 2, 8, self_attention=True).double().eval()  # drawn router: routed
    x = torch.randn(5, 2, 16, dtype=torch.float64)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    future = torch.triu(torch.full((5, 5), float("-inf"), dtype=torch.float64), 1)
    y, _ = module(x, x, x, key_padding_mask=padding, attn_mask=future, need_weights=False)
    attention, outputs = head_outputs(module, x, x, padding, future)  # (B, E, T, S), (B, E, T, C)
    assert attention.shape == (2, 6, 5, 5) and outputs.shape == (2, 6, 5, 16)
    routing = module.routing  # tokens time-first: n = t * B + b
    per_token = outputs.permute(2, 0, 1, 3).reshape(10, 6, 16)  # (T * B, E, C)
    chosen = per_token.gather(1, routing.selected[..., None].expand(-1, -1, 16))  # (N, k, C)
    assert len(set(routing.selected[:, 0].tolist())) > 1  # tokens really route to different experts
    torch.testing.assert_close((routing.gates[..., None] * chosen).sum(1).view(5, 2, 16), y)


def test_attention_sites_by_module_name():
    assert attention_site("encoder.layers.2.self_attn") == ("encoder-self", 2)
    assert attention_site("decoder.layers.0.self_attn") == ("decoder-self", 0)
    assert attention_site("decoder.layers.1.encoder_attn") == ("decoder-cross", 1)
    assert attention_site("encoder.sentence_encoder.layers.3.self_attn") == ("encoder-self", 3)
    with pytest.raises(ValueError, match="not the attention module"):
        attention_site("decoder.output_projection")


def test_per_module_figures_average_to_the_logged_means():
    model = build_model("moa_small", 40, TINY).train()
    model(**translation_sample(pad=1)["net_input"])
    named = model.pop_named_routings()
    assert [attention_site(name) for name, _ in named][:2] == [("encoder-self", 0), ("encoder-self", 1)]
    logged = {}
    log_module_figures(named, 10, logged)
    routing_aux_loss([r for _, r in named], 10, RoutingLossConfig(), logged)
    per_module = [key for key in logged if key.startswith("routing/") and key.endswith("/la")]
    assert len(per_module) == 6 and "routing/decoder-cross.1/lz" in logged
    assert float(sum(logged[key] for key in per_module) / 6) == pytest.approx(float(logged["moa_la"]), rel=1e-6)
