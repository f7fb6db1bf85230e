"""The training history as a pandas DataFrame and as matplotlib curves
(spark_dl.spark.common.history, and the models' history_df() / plot_history())."""

import math

import pytest

pd = pytest.importorskip("pandas")

from spark_dl.spark.common.history import history_frame, plot_history  # noqa: E402

HISTORY = {"epoch": [1, 2, 3], "rows_per_s": [900.0, 1000.0, 1100.0], "mae": [0.9, 0.5, 0.3],
           "val_loss": [1.5, 1.0, 0.8], "loss": [2.0, 1.2, 0.7], "val_mae": [1.0, 0.6, 0.4]}


def test_one_row_per_epoch_loss_first():
    frame = history_frame(HISTORY)
    assert frame.index.name == "epoch" and list(frame.index) == [1, 2, 3]
    assert list(frame.columns) == ["loss", "val_loss", "rows_per_s", "mae", "val_mae"]
    assert frame.loc[2, "val_loss"] == 1.0 and frame.loc[3, "mae"] == 0.3
    assert all(str(t) == "float64" for t in frame.dtypes)


def test_resumed_epochs_keep_their_numbers_and_missing_epochs_count_from_one():
    assert list(history_frame(dict(HISTORY, epoch=[4, 5, 6])).index) == [4, 5, 6]
    frame = history_frame({"loss": [3, 2]})
    assert list(frame.index) == [1, 2] and frame["loss"].dtype == "float64"


def test_short_lists_are_padded_with_nan_and_empty_histories_give_empty_frames():
    frame = history_frame({"loss": [1.0, 0.5, 0.25], "acc": [0.7], "lr": 0.01})
    assert math.isnan(frame.loc[3, "acc"]) and frame.loc[1, "acc"] == 0.7
    assert list(frame["lr"]) == [0.01] * 3
    for empty in (None, {}, {"loss": []}):
        assert history_frame(empty).empty


def test_plot_draws_a_panel_per_quantity_with_its_validation_twin():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    fig = plot_history(HISTORY, title="run 1")
    assert isinstance(fig, Figure)
    loss, mae = fig.axes
    assert loss.get_title() == "loss" and mae.get_title() == "mae"
    assert [line.get_label() for line in loss.get_lines()] == ["loss", "val_loss"]
    assert list(loss.get_lines()[1].get_ydata()) == [1.5, 1.0, 0.8]
    assert loss.get_lines()[1].get_linestyle() == "--"
    assert list(loss.get_lines()[0].get_xdata()) == [1, 2, 3]
    assert fig.get_suptitle() == "run 1"


def test_plot_picks_metrics_and_refuses_unknown_ones():
    pytest.importorskip("matplotlib")
    fig = plot_history(HISTORY, ["rows_per_s"])
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["rows_per_s"]
    with pytest.raises(KeyError, match="accuracy"):
        plot_history(HISTORY, ["accuracy"])
    with pytest.raises(ValueError, match="no epochs"):
        plot_history({})


def test_plot_leaves_pyplot_alone():
    """pyplot lets go of the figure: a notebook shows it once (as the cell's value), and a
    driver that plots after every fit keeps no figures alive."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    plot_history(HISTORY)
    assert plt.get_fignums() == before


def test_model_methods_read_the_models_history():
    pytest.importorskip("pyspark")
    pytest.importorskip("matplotlib")
    from spark_dl.spark.common.model import ModelBase

    model = ModelBase(history=HISTORY)
    assert model.history_df().equals(history_frame(HISTORY))
    assert [ax.get_title() for ax in model.plot_history(["mae"]).axes] == ["mae"]
    assert ModelBase().history_df().empty
