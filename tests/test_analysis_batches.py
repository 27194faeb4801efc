"""moa-analyze's evaluation pass loads its batches without asking for pinned memory where there is
no accelerator (fairseq's own iterator always does, and torch then warns), and gets the same batches."""

import types
import warnings

import pytest
import torch
import torch.utils.data
from fairseq.data import Dictionary, LanguagePairDataset
from fairseq.tasks import FairseqTask

from moa_tools.routing_analysis import evaluation_batches


def small_dataset():
    d = Dictionary()
    for i in range(20):
        d.add_symbol(f"w{i}")
    torch.manual_seed(0)
    lengths = torch.randint(2, 9, (23,))
    src = [torch.cat([torch.randint(4, len(d), (int(n),)), torch.tensor([d.eos()])]) for n in lengths]
    tgt = [s.flip(0)[1:] for s in src]  # the source reversed, eos last
    tgt = [torch.cat([t, torch.tensor([d.eos()])]) for t in tgt]
    return LanguagePairDataset(src, [len(s) for s in src], d, tgt, [len(t) for t in tgt], d, shuffle=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's data loading")
def test_evaluation_batches_pin_nothing_without_an_accelerator_and_match_fairseqs(monkeypatch):
    dataset = small_dataset()
    task = FairseqTask(types.SimpleNamespace())
    reference = list(task.get_batch_iterator(dataset, max_tokens=40, required_batch_size_multiple=1)
                     .next_epoch_itr(shuffle=False))

    pinned = []
    original = torch.utils.data.DataLoader.__init__

    def recording_init(self, *args, **kwargs):
        pinned.append(kwargs.get("pin_memory", False))
        original(self, *args, **kwargs)

    monkeypatch.setattr(torch.utils.data.DataLoader, "__init__", recording_init)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's pin_memory warning would fail the test
        batches = evaluation_batches(FairseqTask(types.SimpleNamespace()), dataset, max_tokens=40)
        got = list(batches)
    assert not any(pinned), "the evaluation pass built a DataLoader with pin_memory=True"
    assert len(batches) == len(got) == len(reference) > 1
    for ours, theirs in zip(got, reference):
        assert ours["id"].tolist() == theirs["id"].tolist()
        assert torch.equal(ours["net_input"]["src_tokens"], theirs["net_input"]["src_tokens"])
        assert torch.equal(ours["target"], theirs["target"])
