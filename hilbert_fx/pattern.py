"""`plot_pattern`: a picture of which keys each query sees, with and without the Hilbert order."""
from __future__ import annotations

import importlib

import torch

from .lowering import check_branches


def optional_import(name: str, what: str):
    """Import an optional dependency, or say which extra brings it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"{what} needs {name.split('.')[0]}, which hilbert_fx does not install "
                          f"by default: pip install 'hilbert-fx[bench]' (from a checkout: "
                          f"pip install -e '.[bench]')") from e


def pyplot(what: str):
    """matplotlib.pyplot on the Agg backend (files, no screen)."""
    optional_import("matplotlib", what).use("Agg")
    return optional_import("matplotlib.pyplot", what)
from .lowering.plans import branch_plans


def key_counts(seq_len: int, segment_lengths, dilation_rates, *, hilbert: bool, head: int = 0,
               is_causal: bool = False) -> torch.Tensor:
    """[N, N] int tensor: how many branches let query p (row) see key p' (column), for one head."""
    segment_lengths, dilation_rates = check_branches(segment_lengths, dilation_rates)
    counts = torch.zeros(seq_len, seq_len, dtype=torch.int64)
    for plan in branch_plans(seq_len, segment_lengths, dilation_rates, hilbert):
        for positions in plan.for_heads(head + 1)[head]:  # one selected set per segment
            sel = positions[positions < seq_len]
            counts[sel.unsqueeze(1), sel.unsqueeze(0)] += 1
    if is_causal:
        counts = counts.tril()
    return counts


def plot_pattern(segment_lengths, dilation_rates, seq_len: int, path: str = "pattern.png", *,
                 head: int = 0, is_causal: bool = False, query: int | None = None,
                 image_width: int | None = None) -> str:
    """Write a PNG of the key sets of one head, without (left) and with (right) Hilbert order.

    Top row: the N x N pattern (colour = number of branches that select the pair). With
    `image_width` (tokens that are a 2-D image of that width, row-major), a bottom row shows the
    keys that query `query` sees, laid out on the image. Returns the path written.
    """
    plt = pyplot("plot_pattern")
    rows = 2 if image_width else 1
    fig, axes = plt.subplots(rows, 2, figsize=(10, 5 * rows), squeeze=False)
    for col, hilbert in enumerate((False, True)):
        counts = key_counts(seq_len, segment_lengths, dilation_rates, hilbert=hilbert, head=head,
                            is_causal=is_causal)
        # by default, the middle query among those that see the most keys
        busiest = (counts.sum(1) == counts.sum(1).max()).nonzero().flatten()
        q = int(busiest[len(busiest) // 2]) if query is None else query
        ax = axes[0][col]
        ax.imshow(counts.numpy(), cmap="viridis", interpolation="nearest")
        ax.set_title(f"hilbert={hilbert}: keys (columns) of each query (rows), head {head}", fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        if image_width:
            h = -(-seq_len // image_width)
            grid = torch.full((h * image_width,), -1, dtype=torch.int64)
            grid[:seq_len] = counts[q]
            grid[q] = -2
            ax = axes[1][col]
            shown = ax.imshow(grid.view(h, image_width).numpy(), cmap="viridis", vmin=-2,
                              interpolation="nearest")
            fig.colorbar(shown, ax=ax, fraction=0.046, label="branches selecting the key "
                         "(-2: the query, -1: no token)")
            ax.set_title(f"hilbert={hilbert}: keys of query {q}, {image_width} wide",
                         fontsize=9)
    branches = ", ".join(f"({w},{r})" for w, r in zip(segment_lengths, dilation_rates))
    fig.suptitle(f"dilated attention, N={seq_len}, branches {branches}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
