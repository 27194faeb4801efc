"""MoA and MoH speed and memory, side by side with fairseq's multi-head attention, in one run.

    .venv/bin/python -m benchmarks.moa_speed                # full run
    .venv/bin/python -m benchmarks.moa_speed --quick        # a smaller grid, for a smoke test
    .venv/bin/python -m benchmarks.moa_speed --device cuda  # the same on a GPU

Prints a markdown report and writes it with the raw figures as JSON, each section with the command,
commit and versions that measured it (``--out``, default benchmarks/results/speed/<device>.json and .md). Timings are
medians of --repeats runs after warm-up. FLOPs are counted analytically
(router, selected-expert Q, shared K/V, q K^T and attention @ V, selected-expert O;
backward = 2x forward) and compared with a float32 matmul peak measured in
the same run (median of 2048^3 matmuls, before and after the module grid).

The MoH section times one self-attention module of 16 heads of 64 (d_model 1024) at 75% (8 shared
+ top-4 of 8) and 50% (4 shared + top-4 of 12) of the heads active, and the same modules computing
every head and multiplying by the gates (the released code's dense-masked path), against fairseq's
16x64 multi-head attention, at 512 and 2048 tokens per sequence. The modules are timed in turn,
round after round, and each ratio is a median over rounds; MACs are counted analytically (K/V stay
dense: per token 2 C^2 for K and V, 2 a C^2 for Q and O, 2 a T C for the attention core, at an
active fraction a).
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import moa  # noqa: F401  (registers the plugin)
from benchmarks.authors_style_moa import AuthorsStyleMoA
from benchmarks.common import RESULTS, ROOT, provenance, provenance_line, write_atomically
from fairseq.modules.multihead_attention import MultiheadAttention
from moa.moa_attention import MixtureOfAttentionHeads
from moa.moh_attention import MixtureOfHeadsAttention
from moa.models.build import build_translation_model, dictionary_of_size

D_MODEL = 512
MOA_CONFIGS = {"8K8E128D": (8, 8, 128), "16K32E256D": (32, 16, 256), "2K8E64D": (8, 2, 64), "4K16E64D": (16, 4, 64)}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, device, repeats, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak(device, repeats):
    a, b = (torch.randn(2048, 2048, device=device) for _ in range(2))
    return 2 * 2048 ** 3 / median_time(lambda: a @ b, device, max(repeats, 5))


def forward_flops(name, tokens, bsz, seq):
    """Analytic forward FLOPs of one self-attention module over tokens = bsz * seq."""
    if name == "MHA 8x64":
        return 4 * 2 * tokens * D_MODEL * D_MODEL + 2 * 2 * bsz * 8 * seq * seq * 64
    experts, k, head = MOA_CONFIGS[name]
    return (2 * tokens * D_MODEL * experts + 2 * 2 * tokens * k * D_MODEL * head
            + 2 * 2 * tokens * D_MODEL * head + 2 * 2 * bsz * k * seq * seq * head)


def make_module(name, device):
    torch.manual_seed(0)
    if name == "MHA 8x64":
        return MultiheadAttention(D_MODEL, 8, self_attention=True).to(device)
    experts, k, head = MOA_CONFIGS[name]
    return MixtureOfAttentionHeads(D_MODEL, experts, k, head, self_attention=True).to(device)


def run_module(module, x, backward):
    out = module(x, x, x, need_weights=False)[0] if not isinstance(module, AuthorsStyleMoA) else module(x)
    if backward:
        out.sum().backward()


def compute_floor(module, x, bsz, seq):
    """The same GEMMs and attention kernel on ready-made contiguous inputs, forward and backward:
    what the module would cost if routing, grouping, scatter and gating were free."""
    m, dim = module, D_MODEL
    flat = x.detach().reshape(-1, dim)
    with torch.no_grad():
        experts = m.router(flat).selected
    sizes = torch.bincount(experts.flatten(), minlength=m.num_experts).tolist()
    dense = m.top_k == m.num_experts
    leaf = lambda *shape: torch.randn(*shape, device=x.device, requires_grad=True)  # noqa: E731
    rows_q = [leaf(n, dim) for n in sizes]
    rows_o = [leaf(n, m.head_dim) for n in sizes]
    kv_in, q_in = leaf(flat.size(0), dim), leaf(bsz, m.top_k, seq, m.head_dim)

    def step():
        if dense:
            outs = [kv_in @ m.q_experts.weight.view(dim, -1),
                    leaf(flat.size(0), m.num_experts * m.head_dim) @ m.o_experts.weight.reshape(-1, dim)]
        else:
            wq, wo = m.q_experts.weight.unbind(1), m.o_experts.weight.unbind(0)
            outs = [r @ w for r, w in zip(rows_q, wq)] + [r @ w for r, w in zip(rows_o, wo)]
        keys = m.k_proj(kv_in).view(bsz, 1, seq, m.head_dim)
        values = m.v_proj(kv_in).view(bsz, 1, seq, m.head_dim)
        outs.append(F.scaled_dot_product_attention(q_in, keys, values, enable_gqa=True))
        sum(o.sum() for o in outs).backward()

    return step


def module_grid(device, repeats, token_counts, seq_lens, peak):
    rows = []
    names = ["MHA 8x64", *MOA_CONFIGS]
    for seq in seq_lens:
        for tokens in token_counts:
            if tokens < seq:
                continue
            bsz = tokens // seq
            x = torch.randn(seq, bsz, D_MODEL, device=device, requires_grad=True)
            for name in names:
                module = make_module(name, device)
                row = {"module": name, "tokens": tokens, "seq_len": seq, "batch": bsz}
                for mode, backward in (("fwd", False), ("fwd_bwd", True)):
                    ctx = torch.no_grad() if not backward else torch.enable_grad()
                    with ctx:
                        seconds = median_time(lambda: run_module(module, x, backward), device, repeats)
                    flops = forward_flops(name, tokens, bsz, seq) * (3 if backward else 1)
                    row[f"{mode}_ms"] = seconds * 1e3
                    row[f"{mode}_peak_fraction"] = flops / seconds / peak
                if name != "MHA 8x64":
                    floor = median_time(compute_floor(module, x, bsz, seq), device, repeats)
                    row["fwd_bwd_overhead_fraction"] = 1 - floor / (row["fwd_bwd_ms"] / 1e3)
                    if name in ("8K8E128D", "16K32E256D") and tokens == 1024 and seq == 64:
                        authors = AuthorsStyleMoA(module)
                        row["authors_style_fwd_bwd_ms"] = 1e3 * median_time(
                            lambda: run_module(authors, x, True), device, repeats)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


SECTIONS = ("modules", "moh", "crossover", "small", "models")
MOH_D_MODEL, MOH_HEADS = 1024, 16
MOH_CONFIGS = {"MoH 75% (8 + top-4 of 8)": (8, 4), "MoH 50% (4 + top-4 of 12)": (4, 4)}


def moh_macs_per_token(active_fraction, seq):
    """Forward MACs per token of one self-attention module at ``active_fraction`` of its heads."""
    c = MOH_D_MODEL
    return 2 * c * c + 2 * active_fraction * c * c + 2 * active_fraction * seq * c


def moh_grid(device, repeats, shapes):
    """MoH against fairseq's MHA of the same shape; ``shapes``: (seq_len, batch) pairs."""
    torch.manual_seed(0)
    modules = {"MHA 16x64": MultiheadAttention(MOH_D_MODEL, MOH_HEADS, self_attention=True).to(device)}
    for name, (shared, top_k) in MOH_CONFIGS.items():
        modules[name] = MixtureOfHeadsAttention(MOH_D_MODEL, MOH_HEADS, shared, top_k, self_attention=True).to(device)
        modules[name].path = "packed"
        dense = MixtureOfHeadsAttention(MOH_D_MODEL, MOH_HEADS, shared, top_k, self_attention=True).to(device)
        dense.load_state_dict(modules[name].state_dict())
        dense.path = "all-heads"
        modules[name + ", dense-masked"] = dense
    rows = []
    for seq, bsz in shapes:
        x = torch.randn(seq, bsz, MOH_D_MODEL, device=device, requires_grad=True)
        times = {(name, mode): [] for name in modules for mode in ("fwd", "fwd_bwd")}
        for _ in range(repeats + 1):  # the first round warms up
            for name, module in modules.items():
                for mode, backward in (("fwd", False), ("fwd_bwd", True)):
                    with (torch.enable_grad() if backward else torch.no_grad()):
                        times[(name, mode)].append(median_time(lambda: run_module(module, x, backward), device, 1,
                                                               warmup=0))
        for name, module in modules.items():
            fraction = 1.0 if name.startswith("MHA") else module.router.active_fraction
            row = {"module": name, "seq_len": seq, "batch": bsz, "active_fraction": fraction,
                   "macs_ratio": moh_macs_per_token(fraction, seq) / moh_macs_per_token(1.0, seq)}
            for mode in ("fwd", "fwd_bwd"):
                own, mha = times[(name, mode)][1:], times[("MHA 16x64", mode)][1:]
                row[f"{mode}_ms"] = 1e3 * statistics.median(own)
                row[f"{mode}_ratio"] = statistics.median(a / b for a, b in zip(own, mha))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


CROSSOVER_MODULES = {  # name -> (d_model, build); the routed/sparse path against the dense one
    "MoA 4K8E64D, d 256 (moa_small)": (256, lambda: MixtureOfAttentionHeads(256, 8, 4, 64, self_attention=True)),
    "MoA 2K8E64D, d 512": (512, lambda: MixtureOfAttentionHeads(512, 8, 2, 64, self_attention=True)),
    "MoA 4K16E64D, d 512": (512, lambda: MixtureOfAttentionHeads(512, 16, 4, 64, self_attention=True)),
    "MoA 16K32E256D, d 512": (512, lambda: MixtureOfAttentionHeads(512, 32, 16, 256, self_attention=True)),
    "MoH 2 + top-1 of 2, d 256 (moh_small)": (256, lambda: MixtureOfHeadsAttention(256, 4, 2, 1, self_attention=True)),
    "MoH 4 + top-4 of 12, d 1024": (1024, lambda: MixtureOfHeadsAttention(1024, 16, 4, 4, self_attention=True)),
}


def use_dense_path(module, dense):
    """MoA: every expert in one matmul (dense) or per expert on its rows; MoH: every head computed
    and gated (dense) or the active heads packed, in training and in decoding alike."""
    if isinstance(module, MixtureOfAttentionHeads):
        module.path = "dense" if dense else "routed"
    else:
        module.path = "all-heads" if dense else "packed"


def crossover(device, repeats, token_counts=(32, 128, 512, 2048, 8192), seq=16):
    """Each routed module's two paths timed in turn (medians of ``repeats`` rounds) at growing token
    counts (sequences of ``seq`` tokens), forward alone (no gradient) and forward+backward, and one
    incremental decoding step (one query per sentence over ``seq`` cached positions): where the two
    paths cross on this machine (the modules choose by the shape of the work: see their ``mix``)."""
    rows = []
    for name, (dim, build) in CROSSOVER_MODULES.items():
        torch.manual_seed(0)
        module = build().to(device)
        for tokens in token_counts:
            bsz = max(tokens // seq, 1)
            x = torch.randn(seq, bsz, dim, device=device, requires_grad=True)
            step = torch.randn(1, bsz, dim, device=device)
            jobs = {"fwd": lambda: run_module(module, x, False), "fwd_bwd": lambda: run_module(module, x, True),
                    "decode_step": decode_step(module.eval(), x.detach(), step)}
            module.train()
            for mode, job in jobs.items():
                times = {True: [], False: []}
                for _ in range(repeats + 1):
                    for dense in (True, False):
                        use_dense_path(module, dense)
                        with (torch.enable_grad() if mode == "fwd_bwd" else torch.no_grad()):
                            times[dense].append(median_time(job, device, 1, warmup=0))
                ratio = statistics.median(a / b for a, b in zip(times[False][1:], times[True][1:]))
                row = {"module": name, "tokens": bsz * seq if mode != "decode_step" else bsz, "mode": mode,
                       "dense_ms": 1e3 * statistics.median(times[True][1:]),
                       "sparse_ms": 1e3 * statistics.median(times[False][1:]), "sparse_over_dense": ratio}
                if isinstance(module, MixtureOfAttentionHeads):
                    row["rows_per_expert"] = row["tokens"] * module.top_k / module.num_experts
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def decode_step(module, prefix, step):
    """A job that runs one incremental step of ``module`` (query ``step``, time-first) after the
    cached ``prefix``, each time from the same cache."""
    state = {}
    with torch.no_grad():
        module(prefix, prefix, prefix, incremental_state=state, need_weights=False)

    def run():
        module(step, step, step, incremental_state={key: dict(value) for key, value in state.items()},
               need_weights=False)

    return run


def kv_cache_bytes_per_token_layer(model, device, bsz=4, steps=8):
    model.eval()
    src = torch.randint(4, 100, (bsz, 10), device=device)
    prev = torch.randint(4, 100, (bsz, steps), device=device)
    state = {}
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=torch.full((bsz,), 10, device=device))
        for t in range(steps):
            model.decoder(prev[:, : t + 1], encoder_out=enc, incremental_state=state)
    total = 0
    for layer in model.decoder.layers:
        buffer = layer.self_attn._get_input_buffer(state)
        total += sum(buffer[k].numel() * buffer[k].element_size() for k in ("prev_key", "prev_value"))
    return total / (bsz * steps * len(model.decoder.layers))


def synthetic_batch(model, bsz, src_len, tgt_len, device):
    g = torch.Generator().manual_seed(0)
    vocab = len(model.decoder.dictionary)
    src = torch.randint(4, vocab, (bsz, src_len), generator=g).to(device)
    target = torch.randint(4, vocab, (bsz, tgt_len), generator=g).to(device)
    prev = torch.roll(target, 1, dims=1)
    prev[:, 0] = model.decoder.dictionary.eos()
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((bsz,), src_len, device=device),
                          "prev_output_tokens": prev}, "target": target, "ntokens": bsz * tgt_len,
            "nsentences": bsz}


def criterion_for(model, arch):
    from fairseq.criterions import CRITERION_REGISTRY

    task = type("Task", (), {"target_dictionary": model.decoder.dictionary})()
    name = "moa_label_smoothed_cross_entropy" if arch.startswith(("moa", "moh")) else "label_smoothed_cross_entropy"
    return CRITERION_REGISTRY[name](task, sentence_avg=False, label_smoothing=0.1)


SHAPES = {  # section -> archs (the first is the reference), extra flags, dictionary size, batch, length, beam sentences
    "small": (("transformer", "moa_small", "moh_small", "moh_small/query-norm"),
              ["--encoder-layers", "3", "--decoder-layers", "3", "--encoder-embed-dim", "256",
               "--decoder-embed-dim", "256", "--encoder-ffn-embed-dim", "1024", "--decoder-ffn-embed-dim", "1024",
               "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
               "--dropout", "0.3", "--attention-dropout", "0.1"],  # the Multi30k benchmark's shape and dropouts
              8000, 128, 16, 32),
    "models": (("transformer_wmt_en_de", "moa_base", "moh_base"), [], 32768, 64, 32, 16),
}


VARIANTS = {  # model name -> (arch, its flags)
    # what moa-convert-moh makes of the Transformer at 75% of the heads with the parameter-free router
    "moh_small/query-norm": ("moh_small", ["--moh-router", "query-norm"]),
}


def shape_model(section, name, device):
    """The model ``name`` (an arch or one of :data:`VARIANTS`) at the shape of ``section`` (see
    :data:`SHAPES`), on a joined dictionary."""
    _, flags, dictionary_size, *_ = SHAPES[section]
    arch, extra = VARIANTS.get(name, (name, []))
    torch.manual_seed(0)
    return build_translation_model(arch, dictionary_of_size(dictionary_size), flags + extra).to(device)


def train_step(model, arch, sample):
    """One update as fairseq-train makes it: criterion forward, backward, Adam step."""
    criterion = criterion_for(model, arch)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step():
        model.train()
        optimizer.zero_grad(set_to_none=True)
        loss, _, _ = criterion(model, sample)
        loss.backward()
        optimizer.step()

    return step


def beam_decode(model, sample, sentences, length, beam=4):
    """Beam-``beam`` decoding of the first ``sentences`` sources, every hypothesis forced to ``length`` tokens."""
    from fairseq.sequence_generator import SequenceGenerator

    generator = SequenceGenerator([model], model.decoder.dictionary, beam_size=beam, max_len_a=0,
                                  max_len_b=length, min_len=length)
    src = sample["net_input"]["src_tokens"][:sentences]
    batch = {"net_input": {"src_tokens": src, "src_lengths": torch.full((sentences,), src.size(1), device=src.device)}}

    def decode():
        model.eval()
        with torch.no_grad():
            generator.generate([model], batch)

    return decode


def side_by_side(section, device, rounds, profile_dir=None):
    """Whole models of one shape (:data:`SHAPES`) side by side: a training step on a batch x length
    batch and beam-4 decoding of the first sentences forced to ``length`` tokens, each model timed in
    turn, round after round (the first round warms up); every ratio is the median over rounds of the
    per-round ratio to the first arch. Peak training memory comes from a fresh process per model.
    With ``profile_dir``, one more step and decode of each model run under torch.profiler and their
    tables are written there."""
    archs, _, _, bsz, length, sentences = SHAPES[section]
    jobs, facts = {}, {}
    for arch in archs:
        model = shape_model(section, arch, device)
        sample = synthetic_batch(model, bsz, length, length, device)
        jobs[arch] = {"train": train_step(model, arch, sample), "decode": beam_decode(model, sample, sentences, length)}
        facts[arch] = {"parameters": sum(p.numel() for p in model.parameters()),
                       "kv_cache_bytes_per_token_per_layer": kv_cache_bytes_per_token_layer(model, device)}
    times = {(arch, job): [] for arch in archs for job in ("train", "decode")}
    for _ in range(rounds + 1):
        for arch in archs:
            for job in ("train", "decode"):
                times[(arch, job)].append(median_time(jobs[arch][job], device, 1, warmup=0))
    rows = []
    for arch in archs:
        row = {"arch": arch, "batch": f"{bsz}x{length}", "beam4_sentences": sentences, "rounds": rounds, **facts[arch]}
        for job in ("train", "decode"):
            own, base = times[(arch, job)][1:], times[(archs[0], job)][1:]
            row[f"{job}_ms"] = 1e3 * statistics.median(own)
            row[f"{job}_ratio"] = statistics.median(a / b for a, b in zip(own, base))
        row["train_words_per_s"] = bsz * length / (row["train_ms"] / 1e3)
        row["beam4_sentences_per_s"] = sentences / (row["decode_ms"] / 1e3)
        row.update(peak_train_memory(section, arch, device))
        rows.append(row)
        print(json.dumps(row), flush=True)
    reference = rows[0]
    for row in rows:
        row["peak_memory_ratio"] = row["peak_mb"] / reference["peak_mb"]
        row["saved_activations_ratio"] = row["saved_activations_mb"] / reference["saved_activations_mb"]
    if profile_dir:
        for arch in archs:
            for job in ("train", "decode"):
                profile_table(jobs[arch][job], os.path.join(profile_dir, f"{section}-{arch.replace('/', '-')}-{job}.txt"),
                              f"{arch}, {job}: {bsz}x{length} training batch, beam-4 decoding of {sentences} "
                              f"sentences forced to {length} tokens")
    return rows


def profile_table(fn, path, title, row_limit=40):
    """Run ``fn`` once under torch.profiler, with the routed modules' stages labelled, and write the
    operator table (self CPU time first) and the stage table to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with labelled_stages(), profile(activities=activities) as prof:
        fn()
    events = prof.key_averages()
    stages = [e for e in events if e.key.startswith("moa:")]
    total = sum(e.self_cpu_time_total for e in events)
    lines = [f"# {title}", f"# {provenance_line(provenance('moa_speed'))}", "",
             "## stages (inclusive CPU time of the labelled code, summed over calls)", ""]
    for e in sorted(stages, key=lambda e: -e.cpu_time_total):
        lines.append(f"{e.key:40s} {e.cpu_time_total / 1e3:9.2f} ms  {e.count:6d} calls  "
                     f"{100 * e.cpu_time_total / max(total, 1):5.1f}% of the run")
    lines += ["", f"total self CPU time: {total / 1e3:.2f} ms", "", "## operators", "",
              events.table(sort_by="self_cpu_time_total", row_limit=row_limit)]
    write_atomically(path, "\n".join(lines) + "\n")


STAGES = {  # the code whose time the profile tables label, as "moa:<label>"
    "moa.routing.TopKRouter.forward": "router (MoA)",
    "moa.routing.TwoStageHeadRouter.forward": "router (MoH)",
    "moa.routing.QueryNormHeadRouter.forward": "router (query-norm)",
    "moa.dispatch.ExpertDispatch.__init__": "dispatch plan (MoA)",
    "moa.dispatch.HeadPacking.__init__": "dispatch plan (MoH)",
    "moa.experts.ExpertLinear.forward": "expert projections (MoA)",
    "moa.experts.grouped_mm": "grouped GEMM (MoA/MoH)",
    "moa.routed_attention.RoutedAttention.attention_core": "attention core (MoA/MoH)",
    "moa.routed_attention.RoutedAttention.cached_key_value": "keys and values (MoA/MoH)",
    "moa.routed_attention.RoutedAttention.forward": "routed attention module",
    "fairseq.modules.multihead_attention.MultiheadAttention.forward": "multi-head attention module",
    "fairseq.sequence_generator.SequenceGenerator._generate": "beam search",
}


class labelled_stages:
    """Within the context, the methods of :data:`STAGES` run inside ``torch.profiler.record_function``."""

    def __enter__(self):
        import functools
        import importlib

        self.saved = []
        for dotted, label in STAGES.items():
            module_name, owner_name, attr = dotted.rsplit(".", 2)
            owner = getattr(importlib.import_module(module_name), owner_name)
            original = owner.__dict__[attr]
            function = original.__func__ if isinstance(original, staticmethod) else original

            def wrapper(*args, __f=function, __label=f"moa:{label}", **kwargs):
                with torch.profiler.record_function(__label):
                    return __f(*args, **kwargs)

            wrapped = functools.wraps(function)(wrapper)
            setattr(owner, attr, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
            self.saved.append((owner, attr, original))
        return self

    def __exit__(self, *exc):
        for owner, attr, original in reversed(self.saved):
            setattr(owner, attr, original)


def peak_train_memory(section, arch, device):
    """Memory of training steps of ``arch`` at ``section``'s shape, measured in a fresh process: the peak
    (CPU: resident set; CUDA: allocated) over two steps after a first, its rise above the memory held
    before them (activations, gradients, workspace), and the bytes one forward saves for backward."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.moa_speed", "--memory-child", section, arch,
                          "--device", device.type], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_child(section, arch, device):
    _, _, _, bsz, length, _ = SHAPES[section]
    model = shape_model(section, arch, device)
    sample = synthetic_batch(model, bsz, length, length, device)
    step = train_step(model, arch, sample)
    step()  # the optimizer's state now exists
    before = current_memory_mb(device)
    reset_peak_memory(device)
    for _ in range(2):
        step()
    peak = peak_memory_mb(device)
    print(json.dumps({"peak_mb": peak, "step_rise_mb": peak - before,
                      "saved_activations_mb": saved_activation_mb(model, arch, sample)}))


def current_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.memory_allocated() / 2 ** 20
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def reset_peak_memory(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    else:  # Linux: writing 5 to clear_refs resets the peak resident set size
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2 ** 20
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def saved_activation_mb(model, arch, sample):
    """MB of the distinct tensors the autograd graph of one training forward saves for backward
    (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _, _ = criterion_for(model, arch)(model, sample)
    del loss
    return sum(storages.values()) / 2 ** 20


def markdown(report):
    dates = ", ".join(f"{name} {date}" for name, date in report["dates"].items())
    lines = [f"MoA and MoH benchmark, {report['machine']}, torch {report['torch']}, {report['threads']} threads "
             f"(measured: {dates})."
             + (f" Matmul peak (float32 2048^3): {report['peak_gflops']:.0f} GFLOP/s." if "peak_gflops" in report else "")]
    if report["modules"]:
        lines += ["", "| module | tokens | seq | fwd ms | fwd+bwd ms | fwd+bwd % of peak | vs MHA (fwd+bwd) | overhead | "
                  "authors-style fwd+bwd ms | speed-up |", "|---|---|---|---|---|---|---|---|---|---|"]
    mha = {(r["tokens"], r["seq_len"]): r for r in report["modules"] if r["module"] == "MHA 8x64"}
    for r in report["modules"]:
        base = mha[(r["tokens"], r["seq_len"])]["fwd_bwd_ms"]
        overhead = f"{100 * r['fwd_bwd_overhead_fraction']:.0f}%" if "fwd_bwd_overhead_fraction" in r else ""
        authors = r.get("authors_style_fwd_bwd_ms")
        lines.append(f"| {r['module']} | {r['tokens']} | {r['seq_len']} | {r['fwd_ms']:.1f} | {r['fwd_bwd_ms']:.1f} | "
                     f"{100 * r['fwd_bwd_peak_fraction']:.0f}% | {r['fwd_bwd_ms'] / base:.2f}x | {overhead} | "
                     + (f"{authors:.1f} | {authors / r['fwd_bwd_ms']:.2f}x |" if authors else " | |"))
    if report.get("crossover"):
        lines += ["", "Routed paths against the dense ones (MoA: every expert in one matmul; MoH: every head computed "
                  "and gated), medians of interleaved rounds; decode_step: one incremental step, one query per "
                  "sentence, tokens = sentences.", "",
                  "| module | mode | tokens | rows per expert | dense ms | routed ms | routed / dense |",
                  "|---|---|---|---|---|---|---|"]
        for r in report["crossover"]:
            per_expert = f"{r['rows_per_expert']:.0f}" if "rows_per_expert" in r else ""
            lines.append(f"| {r['module']} | {r['mode']} | {r['tokens']} | {per_expert} | {r['dense_ms']:.2f} | "
                         f"{r['sparse_ms']:.2f} | {r['sparse_over_dense']:.2f} |")
    for section, title in (("small", "Multi30k shape (d_model 256, 3+3 layers, 4 heads of 64, 8,000 symbols)"),
                           ("models", "base shapes (d_model 512, 6+6 layers, 32,768 symbols)")):
        if not report.get(section):
            continue
        r0 = report[section][0]
        lines += ["", f"{title}: a training step on {r0['batch']} tokens, beam-4 decoding of {r0['beam4_sentences']} "
                  f"sentences; medians of {r0['rounds']} interleaved rounds, ratios to {r0['arch']} per round.", "",
                  "| arch | parameters | train step ms | ratio | train words/s | beam-4 decode ms | ratio | "
                  "sentences/s | K/V cache bytes/token/layer | peak train memory MB | ratio | "
                  "saved activations MB | ratio |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in report[section]:
            lines.append(f"| {r['arch']} | {r['parameters']:,} | {r['train_ms']:.0f} | {r['train_ratio']:.2f}x | "
                         f"{r['train_words_per_s']:.0f} | {r['decode_ms']:.0f} | {r['decode_ratio']:.2f}x | "
                         f"{r['beam4_sentences_per_s']:.1f} | {r['kv_cache_bytes_per_token_per_layer']:.0f} | "
                         f"{r['peak_mb']:.0f} | {r['peak_memory_ratio']:.2f} | {r['saved_activations_mb']:.0f} | "
                         f"{r['saved_activations_ratio']:.2f} |")
    if report.get("moh"):
        lines += ["", "| MoH module (d_model 1024, 16x64) | seq x batch | active heads | MACs ratio | fwd ms | fwd ratio | "
                  "fwd+bwd ms | fwd+bwd ratio | fwd+bwd ratio / MACs ratio |", "|---|---|---|---|---|---|---|---|---|"]
        for r in report["moh"]:
            lines.append(f"| {r['module']} | {r['seq_len']}x{r['batch']} | {100 * r['active_fraction']:.0f}% | "
                         f"{r['macs_ratio']:.2f} | {r['fwd_ms']:.1f} | {r['fwd_ratio']:.2f} | {r['fwd_bwd_ms']:.1f} | "
                         f"{r['fwd_bwd_ratio']:.2f} | {r['fwd_bwd_ratio'] / r['macs_ratio']:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moa_speed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="a few shapes, 2 repeats and rounds, no base models")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the whole-model sections")
    parser.add_argument("--profile", metavar="DIR",
                        help="also profile one training step and one decoding of each whole model with "
                             "torch.profiler and write the tables to DIR (e.g. benchmarks/results/speed/profile)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="which sections to run (default: all); a partial run replaces those sections of an "
                             "existing --out file and keeps the others, each section with its date")
    parser.add_argument("--out", help="JSON path (a .md beside it); default benchmarks/results/speed/<device>.json")
    parser.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.memory_child:
        return memory_child(*args.memory_child, device)

    repeats = 2 if args.quick else args.repeats
    tokens = [256, 1024] if args.quick else [256, 1024, 4096, 8192]
    seqs = [64] if args.quick else [64, 256]
    out = args.out or os.path.join(RESULTS, "speed", f"{device.type}{'-quick' if args.quick else ''}.json")
    report = {"modules": [], "moh": [], "crossover": [], "small": [], "models": [], "dates": {}, "runs": {}}
    if set(args.sections) != set(SECTIONS) and os.path.exists(out):  # a partial run updates its sections only
        with open(out) as f:
            report.update(json.load(f))
    report.update({"device": device.type, "torch": torch.__version__, "threads": torch.get_num_threads(),
                   "machine": (torch.cuda.get_device_name() if device.type == "cuda"
                               else f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")})
    today = time.strftime("%Y-%m-%d")
    run = provenance("moa_speed")
    report["runs"].update({section: run for section in args.sections if section != "models" or not args.quick})
    if "modules" in args.sections:
        peak_before = matmul_peak(device, repeats)
        modules = module_grid(device, repeats, tokens, seqs, peak_before)
        peak = max(peak_before, matmul_peak(device, repeats))
        for r in modules:  # fractions against the higher of the two peak measurements
            for key in ("fwd_peak_fraction", "fwd_bwd_peak_fraction"):
                r[key] *= peak_before / peak
        report.update(modules=modules, peak_gflops=peak / 1e9)
        report["dates"]["modules"] = today
    if "moh" in args.sections:
        report["moh"] = moh_grid(device, repeats, [(512, 1)] if args.quick else [(512, 4), (2048, 1)])
        report["dates"]["moh"] = today
    if "crossover" in args.sections:
        report["crossover"] = crossover(device, repeats, (32, 512) if args.quick else (32, 128, 512, 2048, 8192))
        report["dates"]["crossover"] = today
    for section in ("small", "models"):
        if section in args.sections and not (args.quick and section == "models"):
            report[section] = side_by_side(section, device, 2 if args.quick else args.rounds, args.profile)
            report["dates"][section] = today
    text = markdown(report) + "\n\n" + "\n".join(
        f"- {section}: {provenance_line(section_run)}" for section, section_run in report["runs"].items())
    print("\n" + text)
    write_atomically(out, json.dumps(report, indent=1))
    write_atomically(os.path.splitext(out)[0] + ".md", text + "\n")


if __name__ == "__main__":
    main()
