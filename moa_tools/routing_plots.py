"""The PNG figures of ``moa-analyze`` (matplotlib, no display needed), from its ``routing.json`` report."""

from typing import List


def _pyplot():
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # fairseq's logging shows DEBUG otherwise
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _site(module: dict) -> str:
    return f"{module['type']} {module['layer']}"


def load_heatmap(reports: List[dict], path: str) -> None:
    """Modules (type, layer) x experts, the share of assignments each expert receives, one panel
    per routed checkpoint; the colour scale is centred on the balanced share 1/E."""
    plt = _pyplot()
    routed = [r for r in reports if r["modules"]]
    fig, axes = plt.subplots(1, len(routed), figsize=(1.2 + 0.5 * max(len(r["modules"][0]["load"]) for r in routed)
                                                      * len(routed) + 2 * len(routed), 0.45 * max(
                                                          len(r["modules"]) for r in routed) + 1.8), squeeze=False)
    for ax, report in zip(axes[0], routed):
        loads = [m["load"] for m in report["modules"]]
        experts = len(loads[0])
        image = ax.imshow(loads, cmap="coolwarm", vmin=0, vmax=2 / experts, aspect="auto")
        ax.set_yticks(range(len(loads)), [_site(m) for m in report["modules"]])
        ax.set_xticks(range(experts))
        ax.set_xlabel("expert" if report["family"] == "MoA" else "routed head")
        ax.set_title(f"{report['label']}: load (1/{experts} = balanced)", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _by_layer(ax, reports, key, figures, ylabel, scale=None):
    for report in reports:
        for kind in dict.fromkeys(m["type"] for m in report[figures]):
            rows = [m for m in report[figures] if m["type"] == kind]
            ax.plot([m["layer"] for m in rows], [m[key] / (m[scale] if scale else 1) for m in rows], marker="o",
                    label=f"{report['label']}, {kind}")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)


def entropy_by_layer(reports: List[dict], path: str) -> None:
    """Mean router entropy over log E (1 = uniform routing), by layer, per checkpoint and type."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    _by_layer(ax, [r for r in reports if r["modules"]], "router_entropy", "modules", "router entropy / log E",
              scale="max_entropy")
    ax.set_ylim(0, 1.05)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def similarity_by_layer(reports: List[dict], path: str) -> None:
    """Head (MoA: expert) attention-pattern and output similarity by layer, checkpoints side by side."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    _by_layer(axes[0], reports, "attention_similarity", "similarity", "attention similarity 1 - 0.5 |A_i - A_j|_1")
    _by_layer(axes[1], reports, "output_cosine", "similarity", "output cosine similarity")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
