"""A training step that never waits on the host, proved on a CPU (benchmarks/harness/host_reads.py counts what would).

MoA's routed path on the grouped expert projections makes no host read in the forward, the backward
and the criterion, nor does the reduction of its figures; MoH's packed path reads once per module (the
packed layout's length is a shape); a decoding step (every expert or head) reads nothing. fairseq's own Transformer code reads a few times per
step (its padding checks), which docs/gpus-and-precision.md lists; they are not the plugin's.
"""

import pytest
import torch
from fairseq import metrics

from helpers import TINY, TINY_MOH, build_model, translation_sample
from benchmarks.harness.host_reads import HostReads
from moa.criterions.moa_label_smoothed_cross_entropy import MoALabelSmoothedCrossEntropyCriterion
from moa.moa_attention import MixtureOfAttentionHeads
from moa.moh_attention import MixtureOfHeadsAttention

MOH = TINY_MOH + ["--moh-shared-heads", "1", "--moh-top-k", "1"]


def criterion(model):
    task = type("Task", (), {"target_dictionary": model.decoder.dictionary})()
    return MoALabelSmoothedCrossEntropyCriterion(task, sentence_avg=False, label_smoothing=0.1)


def training_step_reads(model, checkpoint=False):
    crit = criterion(model.train())
    sample = translation_sample(model.decoder.dictionary.pad())
    with HostReads() as reads:
        loss, _, logging_output = crit(model, sample)
        loss.backward()
        with metrics.aggregate():
            type(crit).reduce_metrics([logging_output])
    return reads


@pytest.mark.parametrize("flags", [TINY, TINY + ["--checkpoint-activations"]], ids=["plain", "checkpointed"])
def test_a_moa_training_step_on_the_grouped_projections_reads_nothing_on_the_host(flags):
    reads = training_step_reads(build_model("moa_small", 40, flags))
    assert reads.from_package("moa") == []
    assert reads.calls and all("fairseq" in where for _, where in reads.calls)  # fairseq's padding checks


def test_a_moh_training_step_reads_once_per_packed_module():
    model = build_model("moh_small", 40, MOH)
    modules = sum(isinstance(m, MixtureOfHeadsAttention) for m in model.modules())
    reads = training_step_reads(model).from_package("moa")
    assert 0 < len(reads) <= modules
    assert {name for name, _ in reads} == {"item"} and all("dispatch.py" in where for _, where in reads)


@pytest.mark.parametrize("arch, flags", [("moa_small", TINY), ("moh_small", MOH)])
def test_decoding_steps_read_nothing_on_the_host(monkeypatch, arch, flags):
    """Beam search's steps after the first (which checks once whether the beam's rows share a source)."""
    from fairseq.sequence_generator import SequenceGenerator

    model = build_model(arch, 40, flags).eval()
    steps = []
    original = type(model.decoder).forward

    def counting(self, *args, **kwargs):
        with HostReads() as reads:
            out = original(self, *args, **kwargs)
        steps.append(reads.from_package("moa"))
        return out

    monkeypatch.setattr(type(model.decoder), "forward", counting)
    src = torch.randint(4, 40, (3, 6))
    generator = SequenceGenerator([model], model.decoder.dictionary, beam_size=2, max_len_b=6, min_len=6)
    generator.generate([model], {"net_input": {"src_tokens": src, "src_lengths": torch.full((3,), 6)}})
    assert len(steps) > 2
    assert [name for name, _ in steps[0]] in ([], ["equal"] * 2)  # the first step of each cross-attention
    assert all(step == [] for step in steps[1:])


@pytest.mark.slow
def test_the_moa_routed_training_path_compiles_whole_and_equals_eager():
    """torch.compile(fullgraph=True, dynamic=True) of a MoA module's routed training forward (the grouped
    projections in bfloat16, their groups padded for the CPU's kernels) gives eager's output, losses and every gradient."""
    torch.manual_seed(0)
    module = MixtureOfAttentionHeads(32, 4, 2, 8, self_attention=True, router_init="normal").bfloat16().train()
    module.dropout_module.p = 0.0

    def step(x):
        y, _ = module(x, x, x, need_weights=False)
        return y, module.routing.load_balancing_loss, module.routing.router_z_loss

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for length in (5, 7):  # a second length runs the same dynamic graph
        x = torch.randn(length, 3, 32, dtype=torch.bfloat16, requires_grad=True)
        results = []
        for run in (compiled, step):
            out = run(x)
            loss = (out[0].float() * torch.linspace(-1, 1, out[0].numel()).view_as(out[0])).sum() + out[1] + out[2]
            grads = torch.autograd.grad(loss, [x, *module.parameters()])
            results.append((out, grads))
        (out_c, grads_c), (out_e, grads_e) = results
        for a, b in zip(out_c, out_e):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
        for a, b in zip(grads_c, grads_e):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
