"""The GPU path, in one command on a CUDA machine (skipped elsewhere):

    .venv/bin/python -m pytest -q -m "slow or not slow" tests/gpu

* forward and backward of MoA (routed and dense paths, k < E and k = E) and MoH (learned and
  query-norm routers, the packed and the every-head paths, the shared heads alone) on CUDA equal the
  same model on the CPU, outputs and every gradient;
* incremental decoding with a beam reorder on CUDA equals the full causal forward, for the translation
  models and for the language models' decoding paths (MoA's, MoH's every-head and active-head paths
  over a growing cache store);
* the expert projections by torch's grouped GEMM (what CUDA takes in bfloat16) equal the loop, and a
  MoA module's training step on them runs under ``torch.cuda.set_sync_debug_mode("error")``: no
  synchronisation at all;
* torch.compile of the routed modules (compile_routed_attention, inductor) trains and beam-searches as
  eager, in float32 and bfloat16, with graphs that stop growing (tests/test_torch_compile.py's check);
* MoA and MoH modules on CUDA in float32, bfloat16 and float16 against the float64 references, within the
  rounding bounds of tests/test_reference_precisions.py, with their negative controls;
* fairseq-train with ``--fp16`` and with ``--bf16`` (which the plugin runs without torch_xla) trains MoA
  and MoH for a few updates to a finite loss, and one float32 checkpoint decoded in float32 and in half
  precision gives (nearly) the same hypotheses (slow).

``bash benchmarks/dev/gpu_check.sh`` runs these and then the GPU measurements (benchmarks/dev/gpu_check.py).
"""

import math
import re

import pytest
import torch

from helpers import run_cli, translation_sample
from moa import experts
from moa.moa_attention import MixtureOfAttentionHeads
from moa_tools import USER_DIR
from moa_tools.commands.demo import write_corpus
from test_incremental_decoding import MODELS, check_beam_reorder, tiny_decoding_model
from test_language_models import PATHS, check_lm_decoding

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """TF32 would round the CUDA matmuls to 10 mantissa bits; the comparisons are of float32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("model_id", list(MODELS))
def test_forward_and_backward_on_cuda_equal_the_cpu(model_id):
    """Outputs at the target's real tokens, and gradients of a probe there, as the criterion sees them. A
    padded position's input is exactly zero, so all its router scores tie and top-k picks among them in an
    order each device defines: no loss reads those outputs."""
    cpu = tiny_decoding_model(model_id)
    cuda = tiny_decoding_model(model_id).cuda()
    pad = cpu.decoder.dictionary.pad()
    sample = translation_sample(pad, batch=4, src_len=7, tgt_len=6)
    real = sample["target"].ne(pad)
    probe = torch.randn(4, 6, 40) * real.unsqueeze(-1)
    grads = []
    for model, device in ((cpu, "cpu"), (cuda, "cuda")):
        inputs = {k: v.to(device) for k, v in sample["net_input"].items()}
        logits, _ = model(**inputs)
        (logits * probe.to(device)).sum().backward()
        grads.append((logits.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}))
    (want, want_grads), (got, got_grads) = grads
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-3, atol=1e-5,
                                   msg=lambda msg: f"gradient of {name}: {msg}")


@pytest.mark.parametrize("model_id", list(MODELS))
def test_incremental_decoding_on_cuda_equals_the_full_forward(model_id):
    check_beam_reorder(tiny_decoding_model(model_id).cuda(), "cuda")


@pytest.mark.parametrize("path_id", list(PATHS))
def test_language_model_decoding_on_cuda_equals_the_full_forward(path_id):
    check_lm_decoding(path_id, "cuda")


def test_the_grouped_projections_on_cuda_equal_the_loop():
    """bfloat16, groups padded to the kernel's 16 rows, repeated destination rows summed by index_add,
    against the float64 loop within bfloat16 rounding."""
    from test_expert_linear import assert_within_half_precision_rounding, loop_reference

    torch.manual_seed(0)
    x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(8, 64, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    counts = torch.tensor([37, 0, 101, 3, 59, 60, 21, 19], device="cuda")
    src = torch.randint(0, 300, (int(counts.sum()),), device="cuda")
    dst = torch.randint(0, 250, (int(counts.sum()),), device="cuda")
    assert experts.padded_counts(counts, x, src.numel()) is not None
    assert_within_half_precision_rounding(lambda a, w: experts.expert_linear(a, w, None, src, dst, counts, 250),
                                          lambda a, w: loop_reference(a, w, None, src, dst, counts, 250), (x, weight))


@pytest.mark.parametrize("path", ["routed", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_moa_and_moh_on_cuda_match_the_float64_references(dtype, path):
    """The CPU tests' reference comparison (tests/test_reference_precisions.py, its bounds in units of u)
    with the module on CUDA: MoA on the routed or dense path, MoH on the packed or all-heads one, causal
    self-attention and padded cross-attention; and gates off by 0.1% (float32) or 1% (half precision) fail it."""
    from moa.moh_attention import MixtureOfHeadsAttention
    from moa.routing import TopKRouter, TwoStageHeadRouter
    from test_reference_precisions import _gates_off_by, _moa, _moh, compare_with_reference

    moh_path = "packed" if path == "routed" else "all-heads"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MixtureOfAttentionHeads, "path", path)
        patch.setattr(MixtureOfHeadsAttention, "path", moh_path)
        for make in (_moa, _moh):
            compare_with_reference(make(), dtype, causal=True, device="cuda")
            compare_with_reference(make(cross=True), dtype, cross=True, device="cuda")
        error = 1e-3 if dtype == torch.float32 else 1e-2
        for router, make in ((TopKRouter, _moa), (TwoStageHeadRouter, _moh)):
            with pytest.MonkeyPatch.context() as wrong:
                _gates_off_by(wrong, router, 1 + error)
                with pytest.raises(AssertionError, match="output"):
                    compare_with_reference(make(), dtype, device="cuda")


@pytest.mark.parametrize("path", ["routed", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_switchhead_on_cuda_matches_the_released_layer_in_float64(dtype, path):
    """tests/test_switchhead_released.py's check with the module on CUDA: within 32 units of the dtype's
    roundoff of the float64 reference of the released layer, on the same rounded weights and inputs."""
    from test_switchhead_released import _pair, _run_both, _worst

    released, ours = _pair(2, 4, 2, cross=True, seed=3)
    rounded = {n: p.to(dtype).double() for n, p in released.state_dict().items()}
    released.load_state_dict(rounded)
    ours.load_released_state_dict(rounded)
    ref, got, theirs, mine = _run_both(released, ours, cross=True, causal=False, path=path, dtype=dtype, device="cuda")
    assert _worst(ref, got, theirs, mine) < 32 * torch.finfo(dtype).eps / 2


@pytest.mark.parametrize("experts_, top_k", [(8, 8), (32, 16)])
def test_a_moa_training_step_in_bf16_does_not_synchronise(experts_, top_k):
    torch.manual_seed(0)
    module = MixtureOfAttentionHeads(512, experts_, top_k, 64, self_attention=True,
                                     router_init="normal").cuda().bfloat16().train()
    module.path = "routed"
    x = torch.randn(64, 8, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        y, _ = module(x, x, x, need_weights=False)
        (y.float().square().mean() + sum(module.routing.aux_losses().values())).backward()

    step()  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


TRAIN_SHAPE = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "64",
               "--encoder-ffn-embed-dim", "128", "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
               "--share-all-embeddings"]
ARCHS = {"moa": ["--arch", "moa_small", "--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "16"],
         "moh": ["--arch", "moh_small", "--moh-shared-heads", "1", "--moh-top-k", "2"],
         "switchhead": ["--arch", "switchhead_small", "--switchhead-experts", "4", "--switchhead-top-k", "2",
                        "--switchhead-head-dim", "16"]}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["--fp16", "--bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_training_and_generation(arch, precision, tmp_path):
    """fairseq-train in half precision to a finite loss; then half-precision inference isolated: the
    float32-trained checkpoint decoded in float32 and in ``precision``, where roundings may tip a close beam:
    at most a quarter of the 12 hypotheses differ (the scores' bound: the module references above, and
    fairseq-eval-lm --bf16 on the CPU in tests/test_half_precision_cli.py)."""
    raw, data_bin = str(tmp_path / "raw"), str(tmp_path / "bin")
    write_corpus(raw, {"train": 400, "valid": 20, "test": 12}, seed=3)
    run_cli("fairseq-preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", f"{raw}/train",
            "--validpref", f"{raw}/valid", "--testpref", f"{raw}/test", "--destdir", data_bin,
            "--joined-dictionary", "--workers", "1")

    def train(ckpt, *extra):
        proc = run_cli("fairseq-train", data_bin, "--user-dir", USER_DIR, *ARCHS[arch], *TRAIN_SHAPE, *extra,
                       "--criterion", "moa_label_smoothed_cross_entropy", "--optimizer", "adam", "--lr", "1e-3",
                       "--max-tokens", "1000", "--num-workers", "0", "--log-format", "simple", "--log-interval", "1",
                       "--max-update", "8", "--save-dir", ckpt)
        return proc.stdout + proc.stderr

    log = train(str(tmp_path / "half"), precision)
    losses = [float(v) for v in re.findall(r"\| train \|.* loss ([-\d.naninf]+)", log)]
    assert losses and all(math.isfinite(v) for v in losses), log[-2000:]
    assert "num_updates 8" in log or "num_updates=8" in log
    float32 = str(tmp_path / "float32" / "checkpoint_last.pt")
    train(str(tmp_path / "float32"))
    hypotheses = {}
    for run, extra in (("float32", []), ("half", [precision])):
        proc = run_cli("fairseq-generate", data_bin, "--user-dir", USER_DIR, "--path", float32, "--gen-subset", "test",
                       "--beam", "4", "--batch-size", "6", "--required-batch-size-multiple", "1", *extra)
        if run == "half" and precision == "--bf16":
            assert "runs in bfloat16" in proc.stdout + proc.stderr
        hypotheses[run] = dict(re.findall(r"^H-(\d+)\t\S+\t(.*)$", proc.stdout, re.M))
    assert len(hypotheses["half"]) == len(hypotheses["float32"]) == 12
    assert sum(hypotheses["half"][i] != text for i, text in hypotheses["float32"].items()) <= 3, hypotheses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["moa_small", "moh_small", "switchhead_small"])
def test_compiled_routed_modules_train_and_beam_search_as_eager_on_cuda(arch, dtype):
    from test_torch_compile import compiled_against_eager

    made = compiled_against_eager(arch, dtype, "inductor", lengths=(5, 8, 6, 7), device="cuda")
    assert made[3] == made[2], made
