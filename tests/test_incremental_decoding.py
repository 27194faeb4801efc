"""Incremental decoding (beam search's path) equals the full causal forward of the decoder, for
MoA, MoH and SwitchHead models whose routers send tokens to different experts or heads: MoA with a drawn router
(a zero router would send every token to the same experts), on its routed path (per-expert
projections) and its dense one (every expert in one matmul, what small batches take); MoH's learned
and query-norm routers, its sparse decoding path (only the selected heads computed per step) beside
its default, and its shared heads alone (top-K 0, the inference dial); SwitchHead on both paths (its
value experts cached per key token) and with one expert per head."""

import pytest
import torch

from helpers import build_model
from moa.models.routed_transformer import pop_named_routings
from moa.moa_attention import MixtureOfAttentionHeads
from moa.moh_attention import MixtureOfHeadsAttention
from moa.routed_attention import CACHE_GROWTH_MIN_STEPS
from moa.switchhead_attention import SwitchHeadAttention

MOA = ["--moa-experts", "4", "--moa-head-dim", "8", "--moa-router-init", "normal"]
MOH = ["--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--moh-shared-heads", "1"]
SWITCHHEAD = ["--switchhead-heads", "2", "--switchhead-experts", "4", "--switchhead-head-dim", "8"]
MODELS = {  # id: (arch, flags, sparse: MoA's and SwitchHead's routed path at every size, MoH's sparse decoding path)
    "moa-routed-2of4": ("moa_small", MOA + ["--moa-top-k", "2"], True),
    "moa-2of4-dense-path": ("moa_small", MOA + ["--moa-top-k", "2"], False),
    "moa-dense-4of4": ("moa_small", MOA + ["--moa-top-k", "4"], False),
    "moh-1+top1of3": ("moh_small", MOH + ["--moh-top-k", "1"], False),
    "moh-1+top1of3-sparse-decoding": ("moh_small", MOH + ["--moh-top-k", "1"], True),
    "moh-1+top3of3": ("moh_small", MOH + ["--moh-top-k", "3"], False),
    "moh-1+top0of3-shared-only": ("moh_small", MOH + ["--moh-top-k", "0"], False),
    "moh-query-norm-1+top1of3": ("moh_small", MOH + ["--moh-top-k", "1", "--moh-router", "query-norm"], False),
    "moh-query-norm-1+top2of3-sparse-decoding": ("moh_small", MOH + ["--moh-top-k", "2", "--moh-router", "query-norm"],
                                                 True),
    "switchhead-2H2of4-routed": ("switchhead_small", SWITCHHEAD + ["--switchhead-top-k", "2"], True),
    "switchhead-2H2of4-dense-path": ("switchhead_small", SWITCHHEAD + ["--switchhead-top-k", "2"], False),
    "switchhead-2H1of1": ("switchhead_small", ["--switchhead-heads", "2", "--switchhead-experts", "1",
                                               "--switchhead-top-k", "1", "--switchhead-head-dim", "8"], False),
}


@pytest.fixture(params=list(MODELS))
def any_tiny_model(request):
    return tiny_decoding_model(request.param)


def tiny_decoding_model(model_id):
    """The model of MODELS[model_id], in eval mode, with its paths set (also used by tests/gpu)."""
    arch, extra, sparse = MODELS[model_id]
    torch.manual_seed(0)
    shape = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32",
             "--encoder-ffn-embed-dim", "64", "--dropout", "0", "--attention-dropout", "0"]
    model = build_model(arch, 40, shape + extra).eval()
    for module in model.modules():
        if isinstance(module, MixtureOfHeadsAttention):
            module.path = "packed" if sparse else "all-heads"
        if isinstance(module, (MixtureOfAttentionHeads, SwitchHeadAttention)):
            module.path = "routed" if sparse else "dense"
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
    one_expert = any(isinstance(m, SwitchHeadAttention) and m.num_experts == 1 for m in tiny_model.modules())
    if choices and not one_expert:  # the routers did route: the decoded tokens did not all take the same expert or head
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
    check_beam_reorder(any_tiny_model)


def check_beam_reorder(model, device="cpu"):
    """Three steps, a reorder that duplicates and drops hypotheses, three more steps: the logits equal
    the full forward on the reordered prefixes (also run on CUDA by tests/gpu)."""
    torch.manual_seed(4)
    src = torch.randint(4, 40, (4, 6), device=device)
    prev = torch.randint(4, 40, (4, 6), device=device)
    new_order = torch.tensor([2, 2, 0, 3], device=device)  # beam search duplicates and drops hypotheses
    with torch.no_grad():
        encoder_out = _encode(model, src)
        state = {}
        for t in range(3):
            model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
        model.decoder.reorder_incremental_state_scripting(state, new_order)
        encoder_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
        reordered = prev[new_order]
        steps = [model.decoder(reordered[:, : t + 1], encoder_out=encoder_out, incremental_state=state)[0]
                 for t in range(3, 6)]
        full = _full_logits(model, encoder_out, reordered)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 3:], rtol=1e-4, atol=1e-5)


def test_beam_search_with_per_sentence_source_cache_equals_one_copy_per_hypothesis(any_tiny_model, monkeypatch):
    """fairseq's SequenceGenerator sets the beam on the model: the routed encoder-decoder attention then
    caches the source once per sentence and folds the hypotheses into the query length. Hypotheses and
    scores equal those of a copy per hypothesis, also after sentences finish and leave the batch."""
    from fairseq.sequence_generator import SequenceGenerator

    model = any_tiny_model
    with torch.no_grad():  # make </s> likely, so that sentences finish at different steps
        model.decoder.embed_tokens.weight[model.decoder.dictionary.eos()] *= 4
    torch.manual_seed(6)
    src = torch.randint(4, 40, (6, 7))
    src[2, :3] = model.encoder.padding_idx
    sample = {"net_input": {"src_tokens": src, "src_lengths": src.ne(model.encoder.padding_idx).sum(1)}}
    from moa.routed_attention import RoutedAttention

    source_rows = []  # rows of the cached source keys each folded call saw
    original = RoutedAttention._beamable_forward

    def counting(self, query, key, *args):
        out = original(self, query, key, *args)
        source_rows.append(query.size(1) // self.beam_size)
        return out

    monkeypatch.setattr(RoutedAttention, "_beamable_forward", counting)
    results = []
    for beamable in (True, False):
        generator = SequenceGenerator([model], model.decoder.dictionary, beam_size=4, max_len_b=12)
        if not beamable:
            model.set_beam_size(1)  # what the modules do when nothing sets the beam
        cross = [m for m in model.modules() if getattr(m, "encoder_decoder_attention", False)
                 and hasattr(m, "beam_size") and not hasattr(m, "in_proj_bias")]
        assert cross and {m.beam_size for m in cross} == {4 if beamable else 1}
        results.append(generator.generate([model], sample))
    lengths = set()
    for with_cache, without in zip(*results):
        for a, b in zip(with_cache, without):
            assert torch.equal(a["tokens"], b["tokens"])
            torch.testing.assert_close(a["score"], b["score"])
            lengths.add(len(a["tokens"]))
    assert len(lengths) > 1  # sentences finished at different steps, so the batch shrank on the way
    assert source_rows and max(source_rows) == 6 and min(source_rows) < 6  # per sentence, and fewer later

    # Greedy decoding afterwards (fairseq sets no beam for beam 1, so the modules keep 4): 8 distinct
    # sentences in 8 rows are not 2 beams of 4, and decode as with no beam set.
    src = torch.randint(4, 40, (8, 7))
    greedy_sample = {"net_input": {"src_tokens": src, "src_lengths": torch.full((8,), 7)}}
    greedy = SequenceGenerator([model], model.decoder.dictionary, beam_size=1, max_len_b=12)
    model.set_beam_size(4)
    after_beam = greedy.generate([model], greedy_sample)
    model.set_beam_size(1)
    plain = greedy.generate([model], greedy_sample)
    for a, b in zip(after_beam, plain):
        assert torch.equal(a[0]["tokens"], b[0]["tokens"])


@pytest.mark.parametrize("module", ["moa", "moh"])
def test_a_beam_reorder_leaves_a_contiguous_cache_in_one_of_two_buffers(module):
    """After each reorder the cache is written into a store of one more position, which the next step
    fills: attention reads a contiguous cache; once the spare memory has grown, the steps alternate
    between two buffers and allocate nothing; the outputs equal decoding without reorders."""
    torch.manual_seed(0)
    m = (MixtureOfAttentionHeads(16, 4, 2, 8, self_attention=True) if module == "moa" else
         MixtureOfHeadsAttention(16, 4, 1, 1, self_attention=True)).eval()
    x = torch.randn(12, 3, 16)
    identity = torch.arange(3)
    state, plain, memory, outputs = {}, {}, [], []
    with torch.no_grad():
        for t in range(12):
            if t:
                m.reorder_incremental_state(state, identity)
            y, _ = m(x[t:t + 1], x[t:t + 1], x[t:t + 1], incremental_state=state, need_weights=False)
            outputs.append(y)
            expected, _ = m(x[t:t + 1], x[t:t + 1], x[t:t + 1], incremental_state=plain, need_weights=False)
            torch.testing.assert_close(y, expected)
            cache = m._get_input_buffer(state)
            if t:
                assert cache["prev_key"].is_contiguous() and cache["prev_value"].is_contiguous()
                assert cache["prev_key"].size(m.time_dim) == t + 1
            memory.append(cache["prev_key"].untyped_storage().data_ptr())
    # the spare memory made at step 2 holds CACHE_GROWTH_MIN_STEPS more positions: till then, two buffers
    window = memory[2:2 + CACHE_GROWTH_MIN_STEPS]
    assert len(set(window)) == 2 and window[::2] == [window[0]] * (len(window) // 2)
