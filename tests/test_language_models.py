"""The decoder-only language models: the archs' shapes and K/V widths, per-layer budgets and their
errors, incremental decoding (sampling's path) against the full causal forward on every decoding
path (MoA, MoH, SwitchHead), the moa_cross_entropy criterion, and moa-convert-moh on a transformer_lm (exact at all heads)."""

import argparse
import subprocess
import sys

import pytest
import torch
from fairseq.criterions.cross_entropy import CrossEntropyCriterion
from fairseq.models.transformer_lm import base_lm_architecture

import moa  # noqa: F401
from moa.criterions.moa_cross_entropy import MoACrossEntropyCriterion
from moa.models.build import build_from_args, dictionary_of_size, model_args
from moa.models.routed_transformer import pop_named_routings
from moa.moa_attention import MixtureOfAttentionHeads
from moa.moh_attention import MixtureOfHeadsAttention
from moa.routed_attention import store_capacity
from moa.switchhead_attention import SwitchHeadAttention
from moa_tools.moh_conversion import convert

TINY_LM = ["--decoder-layers", "3", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
           "--decoder-attention-heads", "4", "--dropout", "0", "--attention-dropout", "0"]


def build_lm(arch, extra=(), dict_size=50, seed=0):
    torch.manual_seed(seed)
    args = model_args(arch, list(extra))
    args.tokens_per_sample = args.max_target_positions = 64
    if arch == "transformer_lm":  # fairseq's arch of that name is its dataclass's defaults, which these are
        base_lm_architecture(args)
    return build_from_args(args, dictionary_of_size(dict_size))


def routed(model, kind):
    return [m for m in model.modules() if isinstance(m, kind)]


@pytest.mark.parametrize("arch,twin", [("moa_lm_small", "transformer_lm_small"), ("moh_lm_small", "transformer_lm_small"),
                                       ("moa_lm_base", "transformer_lm"), ("moh_lm_base", "transformer_lm_gpt"),
                                       ("switchhead_lm_small", "transformer_lm_small")])
def test_lm_archs_have_their_twins_shape_and_routed_self_attention_in_every_layer(arch, twin):
    model, reference = build_lm(arch), build_lm(twin)
    assert len(model.decoder.layers) == len(reference.decoder.layers)
    assert model.decoder.embed_dim == reference.decoder.embed_dim
    assert model.decoder.layers[0].fc1.out_features == reference.decoder.layers[0].fc1.out_features
    assert all(layer.encoder_attn is None for layer in model.decoder.layers)
    kind = {"moa": MixtureOfAttentionHeads, "moh": MixtureOfHeadsAttention,
            "switchhead": SwitchHeadAttention}[arch.split("_")[0]]
    assert len(routed(model, kind)) == len(model.decoder.layers)
    if kind is SwitchHeadAttention:  # two heads of 56 cached against four of 64: 7/16 of the twin's cache
        cache = model.decoder.layers[0].self_attn.k_proj.out_features
        assert cache / reference.decoder.layers[0].self_attn.k_proj.out_features == 7 / 16
    elif kind is MixtureOfAttentionHeads:  # one shared K/V head: a quarter of the twin's cache
        cache = model.decoder.layers[0].self_attn.k_proj.out_features
        assert cache / reference.decoder.layers[0].self_attn.k_proj.out_features == 0.25
    else:  # MoH keeps every head's K/V and the twin's parameter names
        assert {k for k in reference.state_dict()} <= {k for k in model.state_dict()}


def test_per_layer_budgets_set_each_layers_top_k_and_the_active_share():
    moh = build_lm("moh_lm_small", TINY_LM + ["--moh-shared-heads", "1", "--moh-top-k-per-layer", "1,2,3"])
    assert [m.top_k for m in routed(moh, MixtureOfHeadsAttention)] == [1, 2, 3]
    assert moh.active_share() == {"MoH": (2 + 3 + 4, 12)}
    assert "MoH: 9 of 12 heads active per token (75.0%)" == moh.describe_active_share()
    moa_ = build_lm("moa_lm_small", TINY_LM + ["--moa-experts", "4", "--moa-head-dim", "8",
                                             "--moa-top-k-per-layer", "1,1,4"])
    assert [m.top_k for m in routed(moa_, MixtureOfAttentionHeads)] == [1, 1, 4]
    assert moa_.active_share() == {"MoA": (6, 12)}


@pytest.mark.parametrize("extra,message", [
    (["--moh-top-k-per-layer", "1,2"], "2 values, but decoder-self attention has 3 layers"),
    (["--moh-top-k-per-layer", "1,x,1"], "give one integer per layer"),
    (["--moh-shared-heads", "2", "--moh-top-k-per-layer", "1,3,1"], "--moh-top-k-per-layer 3 do not fit the 4 heads"),
    (["--moh-attention-types", "encoder-self"], "a language model has only decoder-self attention"),
])
def test_bad_per_layer_and_attention_type_flags_are_named(extra, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build_lm("moh_lm_small", TINY_LM + extra)


def test_a_moa_k_out_of_range_in_one_layer_is_named():
    with pytest.raises(ValueError, match="--moa-top-k-per-layer 5 with --moa-experts 4"):
        build_lm("moa_lm_small", TINY_LM + ["--moa-experts", "4", "--moa-head-dim", "8", "--moa-top-k-per-layer", "1,5,2"])


MOA = ["--moa-experts", "4", "--moa-head-dim", "8", "--moa-router-init", "normal", "--moa-top-k-per-layer", "1,2,4"]
PATHS = {  # id: (arch, flags, module attribute -> value)
    "moa-dense-projections": ("moa_lm_small", MOA, {"path": "dense"}),
    "moa-routed": ("moa_lm_small", MOA, {"path": "routed"}),
    "moh-all-heads": ("moh_lm_small", ["--moh-shared-heads", "1", "--moh-top-k-per-layer", "1,2,3"],
                      {"path": "all-heads"}),
    "moh-packed": ("moh_lm_small", ["--moh-shared-heads", "1", "--moh-top-k-per-layer", "1,2,3"], {"path": "packed"}),
    "moh-query-norm": ("moh_lm_small", ["--moh-shared-heads", "1", "--moh-top-k", "2", "--moh-router", "query-norm"], {}),
    "moh-no-shared-head": ("moh_lm_small", ["--moh-shared-heads", "0", "--moh-top-k", "2"], {}),
    "switchhead-routed": ("switchhead_lm_small", ["--switchhead-experts", "4", "--switchhead-top-k", "2",
                                                  "--switchhead-head-dim", "8"], {"path": "routed"}),
    "switchhead-dense": ("switchhead_lm_small", ["--switchhead-experts", "4", "--switchhead-top-k", "2",
                                                 "--switchhead-head-dim", "8"], {"path": "dense"}),
}


@pytest.mark.parametrize("path_id", list(PATHS))
def test_incremental_decoding_equals_the_full_forward_with_a_growing_cache(path_id):
    check_lm_decoding(path_id, "cpu")


def check_lm_decoding(path_id, device):
    """Decoding step by step, with a reorder on the way, gives the full causal forward's outputs
    (also run on CUDA by tests/gpu)."""
    arch, extra, settings = PATHS[path_id]
    model = build_lm(arch, TINY_LM + extra).eval()
    for module in model.modules():
        for name, value in settings.items():
            if hasattr(module, name):
                setattr(module, name, value)
    for module in routed(model, MixtureOfHeadsAttention):  # a learned router that routes tokens apart
        for p in module.router.parameters():
            torch.nn.init.normal_(p, std=1.0)
    model = model.to(device)
    torch.manual_seed(1)
    tokens = torch.randint(4, 50, (3, 90), device=device)  # longer than the cache's first allocation (64 steps)
    with torch.no_grad():
        full = model(tokens)[0]
        state, steps = {}, []
        for t in range(tokens.size(1)):
            steps.append(model(tokens[:, :t + 1], incremental_state=state)[0])
            if t == 40:  # beam search's reordering on the way: the store moves with the cache
                order = torch.tensor([2, 0, 1], device=device)
                model.decoder.reorder_incremental_state_scripting(state, order)
                tokens, full = tokens[order], full[order]
                steps = [s[order] for s in steps]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)
    selected = [r.selected for _, r in pop_named_routings(model) if r.selected is not None]
    assert selected and any(len(set(s[:, 0].tolist())) > 1 for s in selected)  # tokens routed apart


def test_the_cache_grows_in_place_and_keeps_its_length():
    model = build_lm("moa_lm_small", TINY_LM + ["--moa-experts", "4", "--moa-head-dim", "8"]).eval()
    tokens = torch.randint(4, 50, (2, 70))
    state = {}
    with torch.no_grad():
        stores = set()
        for t in range(tokens.size(1)):
            model(tokens[:, :t + 1], incremental_state=state)
            buffer = model.decoder.layers[0].self_attn._get_input_buffer(state)
            stores.add(buffer["prev_key_store"].data_ptr() if "prev_key_store" in buffer else None)
            assert buffer["prev_key"].shape == (2, t + 1, 8)
    capacities, length = [], 2  # a store is made at the second step, and again each time it is full
    while length <= tokens.size(1):
        capacities.append(store_capacity(length))
        length = capacities[-1] + 1
    assert len(stores - {None}) == len(capacities)
    assert buffer["prev_key_store"].size(1) == capacities[-1]


def test_moa_cross_entropy_is_fairseqs_cross_entropy_plus_the_routers_terms():
    model = build_lm("moh_lm_small", TINY_LM)
    torch.manual_seed(2)
    tokens = torch.randint(4, 50, (2, 12))
    sample = {"net_input": {"src_tokens": tokens, "src_lengths": torch.full((2,), 12)},
              "target": torch.roll(tokens, -1, 1), "ntokens": 24, "nsentences": 2}
    task = argparse.Namespace(target_dictionary=dictionary_of_size(50))
    ours = MoACrossEntropyCriterion(task, sentence_avg=False)
    theirs = CrossEntropyCriterion(task, sentence_avg=False)
    loss, size, log = ours(model, sample)
    plain, _, plain_log = theirs(model, sample)
    pop_named_routings(model)
    assert log["loss"] == pytest.approx(plain_log["loss"])  # the logged loss stays the pure LM figure
    assert float(loss - plain) == pytest.approx(float(log["aux_loss"]), rel=1e-5) and float(log["aux_loss"]) > 0
    assert {"moh_lb", "moh_active"} <= set(log)


def transformer_lm_state(model):
    args = model_args("transformer_lm_small", TINY_LM)
    args.tokens_per_sample = args.max_target_positions = 64
    from fairseq.models import ARCH_CONFIG_REGISTRY
    ARCH_CONFIG_REGISTRY["transformer_lm_small"](args)
    config = {k: v for k, v in vars(args).items() if k != "arch"}
    return {"model": model.state_dict(), "cfg": {"model": dict(config, _name="transformer_lm_small")}}


def test_a_transformer_lm_checkpoint_converts_to_moh_exactly_at_all_heads():
    lm = build_lm("transformer_lm_small", TINY_LM).eval()
    state = transformer_lm_state(lm)  # as fairseq-train saves a dataclass model: cfg.model a dict with _name
    tokens = torch.randint(4, 50, (2, 10))
    for shared, top_k, exact in ((1, 3, True), (2, 1, False)):
        for router in ("query-norm", "learned"):
            new_state, summary = convert(state, shared, top_k, router, "lm.pt")
            args = new_state["cfg"]["model"]
            assert args.arch == "moh_lm" and args.moh_attention_types == "decoder-self"
            moh = build_from_args(args, dictionary_of_size(50)).eval()
            moh.load_state_dict(new_state["model"])
            with torch.no_grad():
                same = torch.allclose(moh(tokens)[0], lm(tokens)[0], atol=1e-5)
            assert same == exact, (shared, top_k, router)
            assert f"{shared} shared + top-{top_k} of {4 - shared} routed" in summary


def test_the_plugin_imports_nothing_from_moa_tools():
    code = "import sys, moa, moa.hub; print(sorted(m for m in sys.modules if m.split('.')[0] == 'moa_tools'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_token_blocks_in_eos_mode_build_on_numpy_2():
    """fairseq-interactive's LM input: TokenBlockDataset(break_mode='eos') names np.compat.long."""
    from fairseq.data import TokenBlockDataset

    data = [torch.tensor([5, 6, 2]), torch.tensor([7, 2])]
    blocks = TokenBlockDataset(data, [3, 2], block_size=None, pad=1, eos=2, break_mode="eos")
    assert [blocks[i].tolist() for i in range(len(blocks))] == [[5, 6, 2], [7, 2]]
