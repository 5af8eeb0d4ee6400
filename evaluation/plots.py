"""PNG plots of a report: tau and speedup against draft length, quality against speedup (matplotlib, Agg)."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from .common import warn

#: Quality figures that can be plotted against speedup: (row key, axis label).
QUALITY_AXES = (("gsm8k_accuracy", "GSM8K accuracy"), ("mt_bench_score", "MT-Bench score"),
                ("win_rate", "win rate vs standard decoding"), ("sbert_cosine", "SBERT cosine vs lossless"))


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warn("matplotlib is not installed (pip install matplotlib); plots skipped")
        return None
    return plt


def run_label(row: dict) -> str:
    """The label of a row's points in every plot: its ``--run`` name, else its method label."""
    return row.get("name") or row["family"]


def _annotate(ax, rows: list[dict], x: str, y: str) -> None:
    for r in rows:
        ax.annotate(run_label(r), (r[x], r[y]), fontsize=7, xytext=(3, 3), textcoords="offset points")


def plot_depth(rows: list[dict], path: Path) -> Path | None:
    """tau and speedup against draft length (tree depth): one line per method family, each point labelled by
    :func:`run_label`.

    Args:
        rows: Report rows with ``name`` (or ``family``), ``family``, ``depth``, ``tau`` and ``speedup``.
        path: Output PNG.

    Returns:
        The path written, or None when there is nothing to plot or matplotlib is missing.
    """
    pts = [r for r in rows if r.get("depth") is not None and r.get("tau") is not None]
    if not pts:
        warn("no run records a draft length (meta 'depth'); tau/speedup plot skipped")
        return None
    plt = _pyplot()
    if plt is None:
        return None
    fam: OrderedDict[str, list] = OrderedDict()
    for r in sorted(pts, key=lambda r: r["depth"]):
        fam.setdefault(r["family"], []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for rs in fam.values():
        for ax, key in zip(axes, ("tau", "speedup")):
            line = [r for r in rs if r.get(key) is not None]
            ax.plot([r["depth"] for r in line], [r[key] for r in line], marker="o")
            _annotate(ax, line, "depth", key)
    axes[0].set(xlabel="draft length (tree depth)", ylabel="tau (tokens per round)", title="Acceptance length")
    axes[1].set(xlabel="draft length (tree depth)", ylabel="speedup over standard decoding", title="Speedup")
    axes[1].axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_quality(rows: list[dict], path: Path) -> Path | None:
    """Each available quality figure against speedup, one point per row, labelled by :func:`run_label`.

    Returns:
        The path written, or None when no row has both a speedup and a quality figure.
    """
    axes_used = [(k, lab) for k, lab in QUALITY_AXES
                 if any(r.get(k) is not None and r.get("speedup") is not None for r in rows)]
    if not axes_used:
        warn("no quality figures (--gsm8k/--judge/--quality) with a speedup; quality plot skipped")
        return None
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(axes_used), figsize=(4.5 * len(axes_used), 4), squeeze=False)
    for ax, (key, label) in zip(axes[0], axes_used):
        rs = [r for r in rows if r.get(key) is not None and r.get("speedup") is not None]
        ax.scatter([r["speedup"] for r in rs], [r[key] for r in rs])
        _annotate(ax, rs, "speedup", key)
        ax.set(xlabel="speedup over standard decoding", ylabel=label, title=label)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
