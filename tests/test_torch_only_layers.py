"""The routed attention layers without fairseq: MoA, MoH and SwitchHead import and run in a process where
``import fairseq`` raises, and give the outputs of the fairseq models' own modules with the same weights:
self- and encoder-decoder attention, whole sequences with padding, and incremental decoding step by step."""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, build_model

SHAPE = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
         "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--dropout", "0", "--attention-dropout", "0"]
MODELS = {  # arch: (flags, the module's class, the constructor arguments read off a built module)
    "moa_small": (["--moa-experts", "4", "--moa-top-k", "2", "--moa-head-dim", "8", "--moa-router-init", "normal"],
                  "moa.moa_attention.MixtureOfAttentionHeads",
                  lambda m: dict(embed_dim=m.embed_dim, num_experts=m.num_experts, top_k=m.top_k, head_dim=m.head_dim,
                                 kdim=m.k_proj.in_features, vdim=m.v_proj.in_features, bias=m.k_proj.bias is not None,
                                 gate_weights=m.router.gate_weights, router_init=m.router.init)),
    "moh_small": (["--moh-shared-heads", "1", "--moh-top-k", "2"], "moa.moh_attention.MixtureOfHeadsAttention",
                  lambda m: dict(embed_dim=m.embed_dim, num_heads=m.num_heads, shared_heads=m.shared_heads,
                                 top_k=m.top_k, kdim=m.k_proj.in_features, vdim=m.v_proj.in_features,
                                 gate_scale=m.router.gate_scale, balance_loss=m.router.balance_loss)),
    "switchhead_small": (["--switchhead-heads", "2", "--switchhead-experts", "4", "--switchhead-top-k", "2",
                          "--switchhead-head-dim", "8"], "moa.switchhead_attention.SwitchHeadAttention",
                         lambda m: dict(embed_dim=m.embed_dim, num_heads=m.num_heads, num_experts=m.num_experts,
                                        top_k=m.top_k, head_dim=m.head_dim, kdim=m.k_proj.in_features,
                                        vdim=m.v_experts.in_dim)),
}
T, S, B = 5, 6, 3

CHILD = r'''
import importlib, importlib.abc, json, sys
import torch

class NoFairseq(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "fairseq" or name.startswith("fairseq."):
            raise ImportError(f"{name}: not installed in this process")

sys.meta_path.insert(0, NoFairseq())
folder = sys.argv[1]
with open(folder + "/modules.json") as f:
    specs = json.load(f)
outputs = {}
for name, spec in specs.items():
    module_path, _, class_name = spec["class"].rpartition(".")
    module = getattr(importlib.import_module(module_path), class_name)(**spec["kwargs"]).eval()
    module.load_state_dict(torch.load(folder + f"/{name}.pt", weights_only=True))
    inputs = torch.load(folder + f"/{name}-inputs.pt", weights_only=True)
    with torch.no_grad():
        full = module(inputs["query"], inputs["key"], inputs["key"], key_padding_mask=inputs.get("padding"),
                      attn_mask=inputs.get("attn_mask"), need_weights=False)[0]
        steps, state = [], {}
        for t in range(inputs["query"].size(0)):  # incremental decoding, one query step at a time
            key = inputs["key"] if spec["kwargs"]["encoder_decoder_attention"] else inputs["query"][t:t + 1]
            steps.append(module(inputs["query"][t:t + 1], key, key, incremental_state=state, need_weights=False,
                                static_kv=spec["kwargs"]["encoder_decoder_attention"],
                                key_padding_mask=inputs.get("padding"))[0])
    outputs[name] = {"full": full, "steps": torch.cat(steps)}
outputs["fairseq_modules"] = torch.tensor(sum(m.startswith("fairseq") for m in sys.modules))
torch.save(outputs, folder + "/outputs.pt")
'''


def _cases():
    """(name, module of a fairseq model, its class path, its constructor arguments, its inputs)."""
    cases = []
    for arch, (flags, class_path, kwargs_of) in MODELS.items():
        torch.manual_seed(0)
        model = build_model(arch, 40, SHAPE + flags).eval()
        for kind, module in (("self", model.decoder.layers[0].self_attn), ("cross", model.decoder.layers[0].encoder_attn)):
            cross = kind == "cross"
            torch.manual_seed(1)
            query = torch.randn(T, B, module.embed_dim)
            key = torch.randn(S, B, module.embed_dim) if cross else query
            padding = torch.zeros(B, S if cross else T, dtype=torch.bool)
            padding[1, -2:] = True
            inputs = {"query": query, "key": key, "padding": padding if cross else None}
            if not cross:  # a decoder's self-attention: causal, no padding (incremental decoding's case)
                inputs["attn_mask"] = torch.triu(torch.full((T, T), float("-inf")), 1)
            kwargs = dict(kwargs_of(module), self_attention=not cross, encoder_decoder_attention=cross)
            cases.append((f"{arch}-{kind}", module, class_path, kwargs, inputs))
    return cases


def test_the_layers_run_without_fairseq_and_equal_the_fairseq_models_modules(tmp_path):
    cases = _cases()
    specs = {}
    for name, module, class_path, kwargs, inputs in cases:
        torch.save(module.state_dict(), tmp_path / f"{name}.pt")
        torch.save({k: v for k, v in inputs.items() if v is not None}, tmp_path / f"{name}-inputs.pt")
        specs[name] = {"class": class_path, "kwargs": kwargs}
    (tmp_path / "modules.json").write_text(json.dumps(specs))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = torch.load(tmp_path / "outputs.pt", weights_only=True)
    assert int(outputs["fairseq_modules"]) == 0  # nothing of fairseq was imported
    for name, module, _, kwargs, inputs in cases:
        with torch.no_grad():
            expected = module(inputs["query"], inputs["key"], inputs["key"], key_padding_mask=inputs["padding"],
                              attn_mask=inputs.get("attn_mask"), need_weights=False)[0]
        assert torch.equal(outputs[name]["full"], expected), name  # the same code on the same weights: bit for bit
        torch.testing.assert_close(outputs[name]["steps"], expected, rtol=1e-5, atol=1e-6, msg=name)


def test_the_check_fails_for_another_weight():
    """The comparison sees a difference: a module rebuilt with one weight changed does not equal the model's."""
    name, module, class_path, kwargs, inputs = _cases()[4]  # switchhead_small, self-attention
    module_path, _, class_name = class_path.rpartition(".")
    rebuilt = getattr(__import__(module_path, fromlist=[class_name]), class_name)(**kwargs).eval()
    state = module.state_dict()
    state["o_experts.weight"] = state["o_experts.weight"] * (1 + 1e-3)
    rebuilt.load_state_dict(state)
    with torch.no_grad():
        args = (inputs["query"], inputs["key"], inputs["key"])
        kw = dict(key_padding_mask=inputs["padding"], attn_mask=inputs.get("attn_mask"), need_weights=False)
        assert not torch.equal(rebuilt(*args, **kw)[0], module(*args, **kw)[0])


@pytest.mark.parametrize("name", ["moa", "moh", "switchhead"])
def test_no_layer_module_imports_fairseq(name):
    """The layer files themselves name no fairseq import (the subprocess test shows none is made)."""
    for path in ("routing.py", "dispatch.py", "experts.py", "routed_attention.py", "incremental_state.py",
                 f"{name}_attention.py"):
        text = open(os.path.join(ROOT, "moa", path), encoding="utf-8").read()
        assert "import fairseq" not in text and "from fairseq" not in text, path


def test_retain_dropout_reaches_the_routed_modules():
    """fairseq-generate --retain-dropout (the model's make_generation_fast_) keeps the routed modules' attention
    dropout on at inference, as it does fairseq's own; without it, inference has none."""
    flags, _, _ = MODELS["switchhead_small"]
    model = build_model("switchhead_small", 40, [*SHAPE[:-2], "--attention-dropout", "0.5", *flags]).eval()
    attention = model.decoder.layers[0].self_attn
    assert not attention.dropout_module.apply_during_inference
    model.make_generation_fast_(retain_dropout=True)
    assert attention.dropout_module.apply_during_inference and attention.dropout_module.p == 0.5
    x = torch.randn(T, B, 32)
    with torch.no_grad():
        first, second = (attention(x, x, x, need_weights=False)[0] for _ in range(2))
    assert not torch.equal(first, second)  # dropout drew twice
