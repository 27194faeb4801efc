"""Incremental decoding (beam search's path) equals the full causal forward of the decoder, for
MoA and MoH models whose routers send tokens to different experts or heads: MoA with a drawn router
(a zero router would send every token to the same experts), MoH's learned and query-norm routers,
and MoH's sparse decoding path (only the selected heads computed per step) beside its default."""

import pytest
import torch

from helpers import build_model
from moa.models.routed_transformer import pop_named_routings
from moa.moa_attention import MixtureOfAttentionHeads
from moa.moh_attention import MixtureOfHeadsAttention

MOA = ["--moa-experts", "4", "--moa-head-dim", "8", "--moa-router-init", "normal"]
MOH = ["--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--moh-shared-heads", "1"]
MODELS = {  # id: (arch, flags, MoH's sparse decoding path)
    "moa-routed-2of4": ("moa_small", MOA + ["--moa-top-k", "2"], False),
    "moa-dense-4of4": ("moa_small", MOA + ["--moa-top-k", "4"], False),
    "moh-1+top1of3": ("moh_small", MOH + ["--moh-top-k", "1"], False),
    "moh-1+top1of3-sparse-decoding": ("moh_small", MOH + ["--moh-top-k", "1"], True),
    "moh-1+top3of3": ("moh_small", MOH + ["--moh-top-k", "3"], False),
    "moh-query-norm-1+top1of3": ("moh_small", MOH + ["--moh-top-k", "1", "--moh-router", "query-norm"], False),
    "moh-query-norm-1+top2of3-sparse-decoding": ("moh_small", MOH + ["--moh-top-k", "2", "--moh-router", "query-norm"],
                                                 True),
}


@pytest.fixture(params=list(MODELS))
def any_tiny_model(request):
    arch, extra, sparse_decoding = MODELS[request.param]
    torch.manual_seed(0)
    shape = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32",
             "--encoder-ffn-embed-dim", "64", "--dropout", "0", "--attention-dropout", "0"]
    model = build_model(arch, 40, shape + extra).eval()
    for module in model.modules():
        if isinstance(module, MixtureOfHeadsAttention):
            module.decode_all_heads = not sparse_decoding
    return model


def _decoder_choices(model):
    """The first choice of every query token of the decoder's routed self-attention modules, popped."""
    return [routing.selected[:, 0] for name, routing in pop_named_routings(model)
            if name.startswith("decoder.") and name.endswith("self_attn") and routing.selected is not None]


def _encode(model, src_tokens):
    lengths = src_tokens.ne(model.encoder.padding_idx).sum(1)
    return model.encoder(src_tokens, src_lengths=lengths)


def _full_logits(model, encoder_out, prev_tokens):
    logits, _ = model.decoder(prev_tokens, encoder_out=encoder_out)
    return logits


def test_step_by_step_equals_full_forward(any_tiny_model):
    tiny_model = any_tiny_model
    torch.manual_seed(3)
    src = torch.randint(4, 40, (3, 6))
    src[1, :2] = tiny_model.encoder.padding_idx  # left padding, as fairseq batches sources
    prev = torch.randint(4, 40, (3, 7))
    prev[:, 0] = tiny_model.decoder.dictionary.eos()
    with torch.no_grad():
        encoder_out = _encode(tiny_model, src)
        full = _full_logits(tiny_model, encoder_out, prev)
        pop_named_routings(tiny_model)
        state, steps, choices = {}, [], []
        for t in range(prev.size(1)):
            steps.append(tiny_model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)[0])
            choices += _decoder_choices(tiny_model)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)
    if choices:  # the routers did route: the decoded tokens did not all take the same expert or head
        assert len(set(torch.cat(choices).tolist())) > 1


def test_cache_holds_one_shared_head(tiny_model):
    src = torch.randint(4, 40, (2, 5))
    prev = torch.randint(4, 40, (2, 4))
    with torch.no_grad():
        encoder_out = _encode(tiny_model, src)
        state = {}
        for t in range(4):
            tiny_model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
    modules = [m for m in tiny_model.decoder.modules() if isinstance(m, MixtureOfAttentionHeads)]
    assert len(modules) == 4  # 2 layers x (self, cross)
    for m in modules:
        buffer = m._get_input_buffer(state)
        expected_len = 5 if m.encoder_decoder_attention else 4
        assert buffer["prev_key"].shape == (2, expected_len, m.head_dim)
        assert buffer["prev_value"].shape == (2, expected_len, m.head_dim)


def test_beam_reorder_equals_full_forward_on_reordered_prefixes(any_tiny_model):
    tiny_model = any_tiny_model
    torch.manual_seed(4)
    src = torch.randint(4, 40, (4, 6))
    prev = torch.randint(4, 40, (4, 6))
    new_order = torch.tensor([2, 2, 0, 3])  # beam search duplicates and drops hypotheses
    with torch.no_grad():
        encoder_out = _encode(tiny_model, src)
        state = {}
        for t in range(3):
            tiny_model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
        tiny_model.decoder.reorder_incremental_state_scripting(state, new_order)
        encoder_out = tiny_model.encoder.reorder_encoder_out(encoder_out, new_order)
        reordered = prev[new_order]
        steps = [tiny_model.decoder(reordered[:, : t + 1], encoder_out=encoder_out, incremental_state=state)[0]
                 for t in range(3, 6)]
        full = _full_logits(tiny_model, encoder_out, reordered)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 3:], rtol=1e-4, atol=1e-5)
