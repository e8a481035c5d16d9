"""The LM demo's learning-curve plot (issue #37 item 7): the samples panel's ticks read ``50k``, not
``175000200000`` run together; the target line is labelled; the supervised warm start is marked with its accuracy."""
from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from advantage_server.demo.lm import TrainResult, plot_curves, thousands  # noqa: E402


def test_counts_are_short_tick_labels():
    assert [thousands(x) for x in (0, 500, 50_000, 175_000, 200_000, 1_250_000)] == \
        ["0", "500", "50k", "175k", "200k", "1.25M"]


def test_the_plot_labels_the_target_and_the_warm_start(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    seen = {}
    save = Figure.savefig

    def record(fig, *args, **kwargs):
        seen["texts"] = [t.get_text() for ax in fig.axes for t in ax.texts]
        fig.canvas.draw()
        seen["ticks"] = [t.get_text() for t in fig.axes[1].get_xticklabels()]
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    curve = [(i, 2048 * i, 1.5 * i, 800.0, min(0.95, 0.228 + 0.007 * i), 0.5, 0.1, 0.01) for i in range(1, 110)]
    result = TrainResult(estimator="grpo", warm_accuracy=0.228, final_accuracy=0.95, steps=109, samples=2048 * 109,
                         wall_seconds=163.5, rpc_seconds=1.0, wait_seconds=0.1, seconds_to_90=150.0, curve=curve,
                         interrupted=False)
    plot_curves([result], str(tmp_path / "lm.png"), target=0.9)
    assert (tmp_path / "lm.png").stat().st_size > 10_000
    assert seen["texts"].count("target 90%") == 2 and seen["texts"].count("supervised warm start (23%)") == 2
    labels = [t for t in seen["ticks"] if t]
    assert labels and all(t == "0" or t.endswith("k") for t in labels), labels
