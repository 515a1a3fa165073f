"""Plots of metrics.jsonl: the series each figure carries, the PNG files, and ``trainer plot``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.cli.main import main
from trainer.observe.metrics import read_metrics
from trainer.observe.plots import build_figures, plot_runs, series

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(path, loss_offset=0.0, steps=12, with_memory=True):
    path.mkdir(parents=True, exist_ok=True)
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "epoch": step / steps, "loss": 3.0 - 0.1 * step + loss_offset,
               "learning_rate": 1e-3 * min(1.0, step / 4), "grad_norm": 1.0, "tokens_per_second": 1000.0 + step}  # fmt: skip
        if with_memory:
            row.update(peak_memory_allocated_bytes=2e9 + step * 1e6, host_peak_rss_bytes=1.5e9)
        rows.append(row)
        if step % 4 == 0:
            rows.append({"step": step, "epoch": step / steps, "eval_loss": 3.1 - 0.1 * step + loss_offset})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def lines_of(fig):
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in fig.axes[0].get_lines()
    }


def test_figures_carry_the_expected_series(tmp_path):
    rows = write_run(tmp_path / "run")
    figures = build_figures({"run": rows})
    assert sorted(figures) == ["learning_rate", "loss", "memory", "throughput"]
    loss = lines_of(figures["loss"])
    assert sorted(loss) == ["eval", "train"]
    assert loss["train"] == ([float(s) for s in range(1, 13)], [3.0 - 0.1 * s for s in range(1, 13)])
    assert loss["eval"] == ([4.0, 8.0, 12.0], [3.1 - 0.1 * s for s in (4, 8, 12)])
    (lr,) = lines_of(figures["learning_rate"]).values()
    assert lr[1] == [1e-3 * min(1.0, s / 4) for s in range(1, 13)]
    (tps,) = lines_of(figures["throughput"]).values()
    assert tps[1] == [1000.0 + s for s in range(1, 13)]
    memory = lines_of(figures["memory"])
    assert memory["device peak"][1] == pytest.approx([2.0 + s * 1e-3 for s in range(1, 13)])  # in GB
    assert memory["host peak RSS"][1] == [1.5] * 12


def test_a_mixture_of_experts_plots_its_router_loss_and_each_layers_imbalance():
    rows = [{"step": s, "loss": 1.0, "aux_loss": 2.0 + s / 10, "expert_imbalance/0": 1.5,
             "expert_imbalance/1": 1.0 + s / 4} for s in (1, 2, 3)]  # fmt: skip
    figures = build_figures({"run": rows})
    assert lines_of(figures["router_loss"]) == {"run": ([1, 2, 3], [2.1, 2.2, 2.3])}
    layers = lines_of(figures["expert_imbalance"])
    assert layers == {"layer 0": ([1, 2, 3], [1.5] * 3), "layer 1": ([1, 2, 3], [1.25, 1.5, 1.75])}
    assert "expert_imbalance" not in build_figures({"run": [{"step": 1, "loss": 1.0}]})


def test_a_mixture_plots_each_source_share():
    """Every ``source_share/<name>`` key is a series of the source-share plot, named by its source."""
    rows = [{"step": s, "loss": 1.0, "source_share/code": c, "source_share/prose": 1 - c}
            for s, c in ((1, 0.75), (2, 0.6875))]  # fmt: skip
    shares = lines_of(build_figures({"run": rows})["source_share"])
    assert shares == {"code": ([1.0, 2.0], [0.75, 0.6875]), "prose": ([1.0, 2.0], [0.25, 0.3125])}
    assert "source_share" not in build_figures({"run": [{"step": 1, "loss": 1.0}]})


def test_several_runs_are_overlaid_with_run_labels(tmp_path):
    runs = {"a": write_run(tmp_path / "a"), "b": write_run(tmp_path / "b", loss_offset=0.5)}
    figures = build_figures(runs)
    loss = lines_of(figures["loss"])
    assert sorted(loss) == ["a eval", "a train", "b eval", "b train"]
    assert loss["b train"][1][0] == pytest.approx(3.4)
    colours = {
        label: line.get_color() for label, line in zip(loss, figures["loss"].axes[0].get_lines(), strict=True)
    }
    assert colours["a train"] == colours["a eval"] != colours["b train"]
    legend = [t.get_text() for t in figures["loss"].axes[0].get_legend().get_texts()]
    assert legend == ["a train", "a eval", "b train", "b eval"]


def test_a_resumed_run_keeps_the_later_row_of_a_step():
    rows = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.9},
        {"step": 2, "loss": 2.8},
        {"step": 3, "loss": 2.7},
    ]
    assert series(rows, "loss") == ([1, 2, 3], [3.0, 2.8, 2.7])


def test_plots_without_a_series_are_skipped(tmp_path):
    write_run(tmp_path / "run", with_memory=False)
    written = plot_runs([str(tmp_path / "run")])
    assert [p.rsplit("/", 1)[1] for p in written] == ["loss.png", "learning_rate.png", "throughput.png"]


def assert_png(path):
    data = Path(path).read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 10_000  # axes, lines and text, not an empty canvas


def test_plot_one_run_writes_pngs_into_the_run(tmp_path):
    write_run(tmp_path / "run")
    written = plot_runs([str(tmp_path / "run")])
    assert written == [
        str(tmp_path / "run" / "plots" / f"{n}.png")
        for n in ("loss", "learning_rate", "throughput", "memory")
    ]
    for path in written:
        assert_png(path)


def test_plot_cli_two_runs(tmp_path, capsys):
    write_run(tmp_path / "a")
    write_run(tmp_path / "b", loss_offset=0.3)
    out_dir = tmp_path / "compare"
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out_dir)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out_dir / f"{n}.png") for n in ("loss", "learning_rate", "throughput", "memory")]
    for path in printed:
        assert_png(path)
    assert len(read_metrics(tmp_path / "a")) == 15  # the runs are only read


def test_plot_cli_errors(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == (
        f"trainer plot: {tmp_path / 'missing'}: no metrics.jsonl (is {tmp_path / 'missing'} a run's output_dir?)\n"
    )
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path / "empty")]) == 1
    assert (
        capsys.readouterr().err
        == "trainer plot: no metrics to plot (metrics.jsonl has no rows with a step)\n"
    )
