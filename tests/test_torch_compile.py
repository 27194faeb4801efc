"""torch.compile of the routed attention modules (moa.routed_attention.compile_routed_attention, the models'
--compile-routed-attention): MoA, MoH and SwitchHead, training and beam search through fairseq's SequenceGenerator, in
float32 and bfloat16, equal to eager, with a number of graphs that stops growing once each kind of call has
been seen (other lengths, batches and routings run the same graphs).

The fast set traces float32 with the ``aot_eager`` backend: dynamo, the fake-tensor shape functions (where
float32's grouped GEMM failed) and AOT autograd, everything but inductor's code generation; the slow set adds
bfloat16 and inductor."""

import pytest
import torch
from fairseq.sequence_generator import SequenceGenerator
from torch._dynamo.utils import counters

from helpers import build_model
from moa.routed_attention import compile_routed_attention

FLAGS = {"moa_small": ["--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "8", "--moa-router-init", "normal"],
         "moh_small": ["--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--moh-shared-heads", "1",
                       "--moh-top-k", "1"],
         "switchhead_small": ["--switchhead-heads", "2", "--switchhead-experts", "4", "--switchhead-top-k", "2",
                              "--switchhead-head-dim", "8"]}
SHAPE = ["--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
         "--dropout", "0", "--attention-dropout", "0"]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def tiny(arch, dtype, device):
    torch.manual_seed(0)
    return build_model(arch, 40, SHAPE + FLAGS[arch]).to(device, dtype)


def graphs():
    return counters["stats"]["unique_graphs"]


def compiled_against_eager(arch, dtype, backend, lengths, device="cpu"):
    """Train one step and beam-search a batch at each source length, compiled and eager side by side; returns
    the graphs made after each length (also run on CUDA by tests/gpu)."""
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = tiny(arch, dtype, device), tiny(arch, dtype, device)
    assert compile_routed_attention(compiled, backend) == 6  # 2 encoder layers, 2 decoder layers with two each
    made = []
    for length in lengths:
        torch.manual_seed(length)
        src = torch.randint(4, 40, (3, length), device=device)
        src_lengths = torch.full((3,), length, device=device)
        prev = torch.randint(4, 40, (3, length + 1), device=device)
        results = []
        for model in (eager, compiled):
            model.train()
            model.zero_grad()
            out = model(src, src_lengths, prev)[0]
            (out.float() * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            model.eval()
            generator = SequenceGenerator([model], model.decoder.dictionary, beam_size=2, max_len_b=length, min_len=2)
            hypotheses = generator.generate([model], {"net_input": {"src_tokens": src, "src_lengths": src_lengths}})
            results.append((out, grads, [[h["tokens"].tolist() for h in sentence] for sentence in hypotheses]))
        (out_e, grads_e, hyps_e), (out_c, grads_c, hyps_c) = results
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out_c, out_e, rtol=tol, atol=tol)
        assert len(grads_c) == len(grads_e)
        for a, b in zip(grads_c, grads_e):
            if dtype == torch.float32:
                torch.testing.assert_close(a, b, rtol=tol * 5, atol=tol * 5)
            else:  # bfloat16: another fusion order may round a few elements apart; the whole must agree
                assert (a - b).float().norm() <= 0.03 * b.float().norm() + 1e-3
        if dtype == torch.float32:  # bfloat16's rounding may tip a beam's choice; its logits are compared above
            assert hyps_c == hyps_e
        made.append(graphs())
    return made


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)],
                         ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["moa_small", "moh_small", "switchhead_small"])
def test_compiled_routed_modules_train_and_beam_search_as_eager_with_bounded_graphs(arch, dtype):
    made = compiled_against_eager(arch, dtype, "aot_eager", lengths=(5, 8, 6, 7))
    assert 0 < made[0] <= 16
    assert made[3] == made[2], made  # a fourth length and routing: no new graph


@pytest.mark.slow
@pytest.mark.parametrize("arch, dtype", [("moa_small", torch.float32)], ids=["moa-float32"])
def test_inductor_compiles_them_too(arch, dtype):
    made = compiled_against_eager(arch, dtype, "inductor", lengths=(5, 7))
    assert made[1] == made[0]
