"""A non-finite loss stops the fit on every rank by default; NaN data is refused by default."""

import pytest

torch = pytest.importorskip("torch")


def test_terminate_on_nan_is_on_and_nonfinite_data_refused_by_default():
    from spark_dl.spark.torch import TorchEstimator

    est = TorchEstimator()
    assert est.getTerminateOnNan() is True
    assert est.getAllowNonfinite() is False
    assert TorchEstimator(allow_nonfinite=True).getAllowNonfinite() is True
