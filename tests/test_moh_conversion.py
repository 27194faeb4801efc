"""moa-convert-moh in-process: a converted model with every head active computes what the original
did (translation, teacher-forced and beam search; RoBERTa), the query-norm router's selection and
straight-through gradient against hand-written references, the printed fairseq-train flags, and
the bad inputs that write nothing."""

import argparse
import copy

import pytest
import torch
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.sequence_generator import SequenceGenerator

from helpers import translation_sample
from moa.models.build import build_from_args, dictionary_of_size, model_args
from moa.moh_attention import MixtureOfHeadsAttention
from moa_tools.commands.convert_moh import main as convert_main
from moa_tools.moh_conversion import continue_flags, convert

SHAPE = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim",
         "64", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--dropout", "0",
         "--attention-dropout", "0"]
ROBERTA_SHAPE = ["--encoder-layers", "2", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
                 "--encoder-attention-heads", "4", "--dropout", "0", "--attention-dropout", "0", "--max-positions", "64"]


def build_model(arch, size, extra):
    """The model and the namespace fairseq-train would save with it."""
    args = model_args(arch, extra)
    model = build_from_args(args, dictionary_of_size(size))
    model.saved_args = args
    return model


def fairseq_checkpoint(model):
    """What fairseq-train saves, in the parts conversion reads."""
    return {"cfg": {"model": copy.deepcopy(model.saved_args), "task": {"_name": "translation"}},
            "model": model.state_dict(),
            "optimizer_history": [{"criterion_name": "x", "optimizer_name": "y", "num_updates": 7}],
            "extra_state": {}, "last_optimizer_state": {"state": {}}}


def load_converted(state, size=40):
    model = build_from_args(copy.deepcopy(state["cfg"]["model"]), dictionary_of_size(size))
    model.load_state_dict(state["model"], strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def transformer():
    torch.manual_seed(0)
    return build_model("transformer", 40, SHAPE).eval()


def _sample():
    return translation_sample(pad=1)


@pytest.mark.parametrize("router", ["query-norm", "learned"])
@pytest.mark.parametrize("shared, top_k", [(1, 3), (2, 2), (0, 4)])
def test_with_every_head_active_the_converted_translation_model_is_the_original(transformer, router, shared, top_k):
    state, summary = convert(fairseq_checkpoint(transformer), shared, top_k, router)
    assert "100% active" in summary and "6 attention modules" in summary
    moh = load_converted(state)
    assert sum(isinstance(m, MixtureOfHeadsAttention) for m in moh.modules()) == 6
    net_input = _sample()["net_input"]
    with torch.no_grad():
        expected, converted = transformer(**net_input)[0], moh(**net_input)[0]
    assert torch.allclose(converted, expected, atol=1e-5, rtol=0)
    d = dictionary_of_size(40)
    sample = {"net_input": {k: net_input[k] for k in ("src_tokens", "src_lengths")}}
    hyps = [[h["tokens"].tolist() for h in beams]
            for model in (transformer, moh) for beams in SequenceGenerator([model], d, beam_size=3, max_len_b=8)
            .generate([model], sample)]
    assert hyps[:3] == hyps[3:]


@pytest.mark.parametrize("router", ["query-norm", "learned"])
def test_with_every_head_active_the_converted_roberta_has_the_same_masked_lm_loss(router):
    torch.manual_seed(1)
    roberta = build_model("roberta", 50, ROBERTA_SHAPE).eval()
    state, _ = convert(fairseq_checkpoint(roberta), 2, 2, router)
    assert state["cfg"]["model"].arch == "moh_roberta"
    moh = load_converted(state, 50)
    tokens = torch.randint(4, 50, (3, 12))
    target = torch.randint(4, 50, (3, 12))
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(m(tokens)[0].transpose(1, 2), target) for m in (roberta, moh)]
    assert losses[1].item() == pytest.approx(losses[0].item(), abs=1e-6)


def _moh_layer(state):
    moh = load_converted(state)
    return moh, moh.encoder.layers[0].self_attn


def test_learned_conversion_starts_every_active_head_at_a_gate_of_one(transformer):
    state, summary = convert(fairseq_checkpoint(transformer), 2, 1, "learned")
    assert "75% active" in summary and f"{6 * 32 * (4 + 2):,} parameters added" in summary
    router_weights = [v for k, v in state["model"].items() if ".router." in k]
    assert len(router_weights) == 18 and all(w.abs().sum() == 0 for w in router_weights)
    _, attn = _moh_layer(state)
    routing = attn.router(torch.randn(10, 32))
    assert torch.equal(routing.shared_gates, torch.ones(10, 2)) and torch.equal(routing.gates, torch.ones(10, 1))


def test_query_norm_router_selects_the_largest_query_and_sparse_equals_dense(transformer):
    state, _ = convert(fairseq_checkpoint(transformer), 1, 1, "query-norm")
    _, attn = _moh_layer(state)
    torch.manual_seed(3)
    x = torch.randn(7, 2, 32, dtype=torch.float64, requires_grad=True)
    attn = attn.double()
    q = torch.nn.functional.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(7, 2, 4, 8)
    expected_heads = q[..., 1:, :].norm(dim=-1).argmax(dim=-1).reshape(-1)  # routed heads 1..3 -> 0..2
    outputs, grads = [], []
    for dense in (False, True):
        attn.path = "all-heads" if dense else "packed"
        y, _ = attn(x, x, x)
        assert torch.equal(attn.routing.selected[:, 0], expected_heads)
        assert torch.equal(attn.routing.gates, torch.ones(14, 1, dtype=torch.float64))
        outputs.append(y)
        grads.append(torch.autograd.grad(y.square().sum(), [x, attn.q_proj.weight]))
    assert torch.allclose(outputs[0], outputs[1], rtol=1e-9, atol=1e-12)
    for sparse_grad, dense_grad in zip(*grads):
        assert torch.allclose(sparse_grad, dense_grad, rtol=1e-9, atol=1e-10)


def test_query_norm_gradient_reaches_the_query_projection_through_the_gate():
    """One token attending to itself: attention returns its own value whatever the queries, so the
    query projection gets a gradient only through the straight-through gate; checked against a
    hand-written MoH of the same weights."""
    torch.manual_seed(4)
    attn = MixtureOfHeadsAttention(16, 4, shared_heads=1, top_k=1, self_attention=True, router="query-norm").double()
    x = torch.randn(1, 1, 16, dtype=torch.float64)
    y, _ = attn(x, x, x)
    y.square().sum().backward()
    assert attn.q_proj.weight.grad.abs().sum() > 0

    w_q, w_v, w_o = (p.detach().clone().requires_grad_() for p in (attn.q_proj.weight, attn.v_proj.weight,
                                                                   attn.out_proj.weight))
    t = x[0, 0]
    q = (w_q @ t + attn.q_proj.bias.detach()).view(4, 4)
    v = (w_v @ t + attn.v_proj.bias.detach()).view(4, 4)  # the one key's value is each head's output
    scores = q[1:].norm(dim=-1)
    p = (scores / scores.mean()).softmax(dim=-1)
    chosen = int(p.argmax())
    gates = torch.cat([torch.ones(1, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)])
    gates = gates + torch.nn.functional.one_hot(torch.tensor(chosen + 1), 4).double() * (1 + p[chosen] - p[chosen].detach())
    reference = (w_o.view(16, 4, 4) * (gates[:, None] * v)[None]).sum(dim=(1, 2)) + attn.out_proj.bias.detach()
    assert torch.allclose(reference, y.detach().view(16), rtol=1e-9, atol=1e-12)
    reference.square().sum().backward()
    assert torch.allclose(attn.q_proj.weight.grad, w_q.grad, rtol=1e-9, atol=1e-10)
    assert torch.allclose(attn.v_proj.weight.grad, w_v.grad, rtol=1e-9, atol=1e-10)
    # negative control: the reference with its straight-through gate off by 1e-8 differs beyond these tolerances
    wrong = (w_o.view(16, 4, 4) * ((gates * (1 + 1e-8))[:, None] * v)[None]).sum(dim=(1, 2)) + attn.out_proj.bias.detach()
    assert not torch.allclose(wrong, y.detach().view(16), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("router", ["query-norm", "learned"])
def test_the_printed_fairseq_train_flags_build_the_converted_model(transformer, router):
    state, _ = convert(fairseq_checkpoint(transformer), 2, 1, router)
    flags = continue_flags(state)
    assert flags[:2] == ["--arch", "moh_transformer"] and "--moh-router" in flags
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    ARCH_MODEL_REGISTRY["moh_transformer"].add_args(parser)
    args = parser.parse_args(flags[2:])
    args.arch = "moh_transformer"
    model = build_from_args(args, dictionary_of_size(40))
    model.load_state_dict(state["model"], strict=True)
    attn = model.decoder.layers[1].encoder_attn
    assert (attn.shared_heads, attn.top_k, type(attn.router).__name__) == \
        (2, 1, "QueryNormHeadRouter" if router == "query-norm" else "TwoStageHeadRouter")


def _run(argv, capsys):
    code = convert_main(argv)
    return code, capsys.readouterr()


@pytest.fixture
def saved(tmp_path, transformer):
    path = str(tmp_path / "transformer.pt")
    torch.save(fairseq_checkpoint(transformer), path)
    return path


def test_the_tool_writes_a_checkpoint_fairseq_loads(saved, tmp_path, capsys):
    out = str(tmp_path / "moh.pt")
    code, printed = _run([saved, "--shared-heads", "2", "--top-k", "1", "--router", "query-norm", "--out", out], capsys)
    assert code == 0 and f"wrote {out}" in printed.out and "--finetune-from-model " + out in printed.out
    state = torch.load(out)  # the safe loader
    assert state["last_optimizer_state"] is None and state["optimizer_history"][-1]["num_updates"] == 7
    assert type(load_converted(state).encoder.layers[0].self_attn.router).__name__ == "QueryNormHeadRouter"


@pytest.mark.parametrize("case, message", [
    ("moa", "holds a 'moa_transformer' model (arch moa_small) (it is routed already)"),
    ("too-many", "--shared-heads 3 --top-k 2 do not fit the 4 heads of encoder-self attention"),
    ("no-routed-k", "--shared-heads 2 --top-k 0 do not fit the 4 heads"),
    ("heads-do-not-divide", "the encoder-self attention has d_model 32, which its 3 heads do not divide"),
    ("truncated", "is truncated or corrupt"),
    ("not-fairseq", "is not a fairseq checkpoint"),
    ("missing", "no such checkpoint"),
])
def test_bad_input_is_named_and_writes_nothing(case, message, saved, tmp_path, capsys):
    shared, top_k, path = 2, 1, saved
    if case == "moa":
        moa = build_model("moa_small", 40, SHAPE[:-4] + ["--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "8"])
        torch.save(fairseq_checkpoint(moa), path)
    elif case == "too-many":
        shared, top_k = 3, 2
    elif case == "no-routed-k":
        top_k = 0
    elif case == "heads-do-not-divide":
        state = torch.load(path)
        state["cfg"]["model"].encoder_attention_heads = 3
        torch.save(state, path)
    elif case == "truncated":
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
    elif case == "not-fairseq":
        torch.save({"weights": torch.zeros(2)}, path)
    else:
        path = str(tmp_path / "absent.pt")
    out = tmp_path / "moh.pt"
    code, printed = _run([path, "--shared-heads", str(shared), "--top-k", str(top_k), "--router", "learned",
                          "--out", str(out)], capsys)
    assert code == 1 and printed.err.startswith("moa-convert-moh: error: ") and message in printed.err
    assert not out.exists() and not (tmp_path / "moh.pt.tmp").exists()
