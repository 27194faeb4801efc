"""moa.path_choice: paths measured where they run, once per problem size, and what training takes."""

import pytest
import torch

from moa import path_choice
from moa.moa_attention import MixtureOfAttentionHeads
from moa.moh_attention import MixtureOfHeadsAttention


@pytest.fixture(autouse=True)
def fresh_choices():
    path_choice.forget()
    yield
    path_choice.forget()


class Clock:
    """A stand-in for time.perf_counter that only the candidates advance, so that timings are exact."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(path_choice.time, "perf_counter", fake)
    return fake


def counting(calls, name, seconds=0.0, clock=None):
    def run():
        calls.append(name)
        if clock is not None:
            clock.now += seconds
        return name
    return run


def test_the_faster_candidate_is_measured_once_per_size_and_then_taken_alone(clock):
    calls = []
    candidates = {"slow": counting(calls, "slow", 0.003, clock), "fast": counting(calls, "fast", 0.001, clock)}
    with torch.no_grad():
        assert path_choice.fastest("demo", (8,), candidates) == "fast"
        assert calls.count("slow") == calls.count("fast") == path_choice.REPEATS + 1
        calls.clear()
        assert path_choice.fastest("demo", (8,), candidates) == "fast"
        assert calls == ["fast"]
        path_choice.fastest("demo", (16,), candidates)  # another size is measured afresh
        assert calls.count("slow") == path_choice.REPEATS + 1
    assert path_choice.chosen() == {("demo", 8): "fast", ("demo", 16): "fast"}


def test_a_near_tie_keeps_the_first_candidate(clock):
    """Another candidate replaces the first only when faster by more than MARGIN."""
    calls = []
    with torch.no_grad():
        just_within = 1 - path_choice.MARGIN / 2
        assert path_choice.fastest("tie", (1,), {"first": counting(calls, "first", 1.0, clock),
                                                 "second": counting(calls, "second", just_within, clock)}) == "first"
        beyond = 1 - 2 * path_choice.MARGIN
        assert path_choice.fastest("tie", (2,), {"first": counting(calls, "first", 1.0, clock),
                                                 "second": counting(calls, "second", beyond, clock)}) == "second"


def test_training_pinned_and_default_paths_are_taken_without_measuring(clock):
    calls = []
    candidates = {"slow": counting(calls, "slow", 0.003, clock), "fast": counting(calls, "fast", 0.001, clock)}
    assert torch.is_grad_enabled()
    assert path_choice.fastest("demo", (8,), candidates, training="slow") == "slow"
    assert path_choice.fastest("demo", (8,), candidates) == "slow"  # no training path named: the first
    with torch.no_grad():
        assert path_choice.fastest("demo", (8,), candidates, pinned="slow") == "slow"
        with path_choice.defaults():
            assert path_choice.fastest("demo", (8,), candidates) == "slow"
    assert calls == ["slow"] * 4 and path_choice.chosen() == {}


def test_moa_trains_on_the_routed_path_and_decodes_on_the_measured_one(monkeypatch):
    """Training plans a dispatch (the routed path) whatever the size; without autograd both paths are
    measured, agree, and the faster one is remembered for the size."""
    torch.manual_seed(0)
    m = MixtureOfAttentionHeads(16, 8, 2, 8, self_attention=True).double()
    plans = []
    from moa import moa_attention
    original = moa_attention.ExpertDispatch.__init__
    monkeypatch.setattr(moa_attention.ExpertDispatch, "__init__", lambda self, *a: plans.append(1) or original(self, *a))
    x = torch.randn(3, 2, 16, dtype=torch.double)
    m(x, x, x)
    assert len(plans) == 1
    with torch.no_grad():
        measured, _ = m(x, x, x)
        (key, name), = path_choice.chosen().items()
        assert key[0] == "MoA routed or dense" and name in ("routed", "dense")
        for path in ("routed", "dense"):
            m.path = path
            torch.testing.assert_close(m(x, x, x)[0], measured)


def test_moh_decoding_measures_its_three_paths_and_they_agree():
    torch.manual_seed(0)
    m = MixtureOfHeadsAttention(24, 4, 1, 2, self_attention=True).double().eval()
    x = torch.randn(5, 3, 24, dtype=torch.double)
    outputs = {}
    with torch.no_grad():
        for path in (None, "all-heads", "packed", "active-heads"):
            m.path = path
            state = {}
            steps = [m(x[t:t + 1], x[t:t + 1], x[t:t + 1], incremental_state=state, need_weights=False)[0]
                     for t in range(5)]
            outputs[path] = torch.cat(steps)
    names = {name for key, name in path_choice.chosen().items() if key[0] == "MoH paths"}
    assert names <= {"all-heads", "packed", "active-heads"} and names
    for path, y in outputs.items():
        torch.testing.assert_close(y, outputs["all-heads"], msg=f"path {path}")
