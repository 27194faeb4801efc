"""--checkpoint-activations / --offload-activations with MoA and MoH: the same loss and gradients."""

import pytest
import torch
from fairseq.criterions import CRITERION_REGISTRY

from helpers import TINY, TINY_MOH, build_model, translation_sample
from moa.routed_attention import RoutedAttention

DROPOUT = ["--dropout", "0.1", "--attention-dropout", "0.1"]  # recomputation must replay the same masks
CASES = {
    "moa": ("moa_small", TINY + DROPOUT),
    "moh-learned": ("moh_small", TINY_MOH + DROPOUT),
    "moh-query-norm": ("moh_small", TINY_MOH + DROPOUT + ["--moh-router", "query-norm"]),
}


def _loss_and_gradients(arch, flags):
    torch.manual_seed(0)
    model = build_model(arch, 40, flags).train()
    sample = translation_sample(model.decoder.padding_idx)
    task = type("Task", (), {"target_dictionary": model.decoder.dictionary})()
    criterion = CRITERION_REGISTRY["moa_label_smoothed_cross_entropy"](
        task, sentence_avg=False, label_smoothing=0.1, moa_alpha=0.5, moa_beta=0.1, moh_beta=0.5)
    torch.manual_seed(1)
    loss, _, log = criterion(model, sample)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return model, loss.detach(), log, grads


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("flag", ["--checkpoint-activations", "--offload-activations"])
def test_checkpointed_layers_give_the_same_loss_and_gradients(case, flag):
    arch, flags = CASES[case]
    _, loss, log, grads = _loss_and_gradients(arch, flags)
    model, loss_ckpt, log_ckpt, grads_ckpt = _loss_and_gradients(arch, flags + [flag])
    assert hasattr(model.encoder.layers[0], "precheckpoint_forward")  # the layers are checkpointed
    torch.testing.assert_close(loss_ckpt, loss)
    torch.testing.assert_close(log_ckpt["aux_loss"], log["aux_loss"])
    assert grads_ckpt.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], msg=name)
    routers = [name for name in grads if ".router." in name]
    assert routers or case == "moh-query-norm"
    for name in routers:  # the routers learn from the auxiliary losses too
        assert grads[name].abs().sum() > 0
    # the backward's recomputation left no routing behind for the next step's criterion
    assert all(m.routing is None for m in model.modules() if isinstance(m, RoutedAttention))



@pytest.mark.parametrize("arch", ["moa_roberta_small", "moh_roberta_small"])
@pytest.mark.parametrize("flag", ["--checkpoint-activations", "--offload-activations"])
def test_the_masked_lm_archs_take_the_flags_fairseqs_roberta_lacks(arch, flag):
    model = build_model(arch, 40, ["--encoder-layers", "1", flag])
    layer = model.encoder.sentence_encoder.layers[0]
    assert hasattr(layer, "precheckpoint_forward") and isinstance(layer.self_attn, RoutedAttention)
