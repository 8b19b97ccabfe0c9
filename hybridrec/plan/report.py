"""The planner's output: a text table, a PNG and JSON of predictions."""

from __future__ import annotations

from pathlib import Path

from hybridrec.plan.model import PARTS, Prediction

COLUMNS = (*PARTS, "shared_cores")
SHORT = {
    "compute": "compute", "pull": "pull", "push": "push", "server_queueing": "queue",
    "allreduce": "allred", "alltoallv": "a2av", "pipelined": "hidden", "shared_cores": "cores",
}  # fmt: skip


def table(predictions: list[Prediction]) -> str:
    """One line per prediction: W, S, network, step (ms), samples/s, the parts (ms) and
    the bottleneck."""
    head = f"{'W':>5} {'S':>4} {'network':>13} {'step ms':>9} {'samples/s':>11}"
    head += "".join(f" {SHORT[c]:>8}" for c in COLUMNS) + "  bottleneck"
    lines = [head, "-" * len(head)]
    for p in predictions:
        line = f"{p.workers:>5} {p.servers:>4} {p.network:>13} {p.step_s * 1e3:>9.2f} "
        line += f"{p.samples_per_s:>11.0f}"
        line += "".join(f" {p.parts[c] * 1e3:>8.2f}" for c in COLUMNS)
        lines.append(line + f"  {p.bottleneck}")
    return "\n".join(lines)


def _coinciding(predictions: list[Prediction], networks: list[str]) -> list[str]:
    """The networks whose samples/s curve another network's lies on (within 5 % at every
    W: hardly a gap on the log axis), so the plot can say why one of them hides."""
    curve = {
        n: {p.workers: p.samples_per_s for p in predictions if p.network == n} for n in networks
    }

    def close(a: str, b: str) -> bool:
        shared = curve[a].keys() & curve[b].keys()
        return bool(shared) and all(
            abs(curve[a][w] - curve[b][w]) <= 0.05 * max(curve[a][w], curve[b][w]) for w in shared
        )

    return [a for a in networks if any(close(a, b) for b in networks if b != a)]


def plot(predictions: list[Prediction], path: str | Path, title: str = "") -> Path:
    """Samples/s against W (one line per network, log-log) and the step's breakdown
    against W (each part's share; the first network's), side by side. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError(
            "the planner's PNG needs matplotlib (pip install matplotlib); the table and "
            "JSON need nothing"
        ) from e
    networks = list(dict.fromkeys(p.network for p in predictions))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for net in networks:
        rows = sorted((p for p in predictions if p.network == net), key=lambda p: p.workers)
        left.plot([p.workers for p in rows], [p.samples_per_s for p in rows], marker="o",
                  label=net)  # fmt: skip
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("workers W")
    left.set_ylabel("samples/s (predicted)")
    left.grid(True, which="both", alpha=0.3)
    left.legend(title="network")
    same = _coinciding(predictions, networks)
    if same:
        note = (
            f"{' and '.join(same)}: one curve (within 5 %):\nthe network hardly limits these steps"
        )
        left.text(0.98, 0.02, note, transform=left.transAxes, ha="right", va="bottom", fontsize=8)
    rows = sorted((p for p in predictions if p.network == networks[0]), key=lambda p: p.workers)
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for c in COLUMNS:  # each part's share of the step, so small and large W read alike
        if c == "pipelined":  # hidden time (<= 0): the parts then add up to more than 100 %
            continue
        ys = [100 * p.parts[c] / p.step_s for p in rows]
        right.bar(xs, ys, bottom=bottom, label=SHORT[c])
        bottom = [a + b for a, b in zip(bottom, ys, strict=True)]
    if any(p.parts["pipelined"] < 0 for p in rows):
        right.axhline(100, color="black", linewidth=0.8, label="the step (pipelined)")
    labels = [f"{p.workers}\n{p.step_s * 1e3:.3g} ms" for p in rows]
    right.set_xticks(xs, labels, fontsize=7, rotation=45 if len(rows) > 6 else 0)
    right.set_xlabel(f"workers W and step time ({networks[0]})")
    right.set_ylabel("share of the step (%)")
    right.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
