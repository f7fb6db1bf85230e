"""KerasEstimator takes every horovod.spark.keras.KerasEstimator param (issue 33)."""

import pytest

pytest.importorskip("keras")
pytest.importorskip("pyspark")

from spark_dl.spark.keras import KerasEstimator, KerasModel  # noqa: E402

# horovod.spark.keras.KerasEstimator's constructor arguments (0.28.1, plus
# tensorflow_dataset_prefetch_buffer_size from Horovod's master).
HOROVOD_KERAS_ARGS = (
    "num_proc", "data_module", "model", "backend", "store", "custom_objects", "optimizer",
    "loss", "loss_weights", "sample_weight_col", "gradient_compression", "metrics",
    "feature_cols", "label_cols", "continuous_cols", "categorical_cols", "validation",
    "callbacks", "batch_size", "val_batch_size", "epochs", "verbose", "random_seed",
    "shuffle_buffer_size", "shuffle", "partitions_per_process", "run_id",
    "train_steps_per_epoch", "validation_steps_per_epoch", "transformation_fn",
    "train_reader_num_workers", "val_reader_num_workers", "reader_pool_type", "label_shapes",
    "checkpoint_callback", "inmemory_cache_all", "backend_env", "use_gpu", "mp_start_method",
    "tensorflow_dataset_prefetch_buffer_size")


def test_every_horovod_argument_is_a_param():
    missing = [name for name in HOROVOD_KERAS_ARGS if name not in KerasEstimator._param_specs]
    assert missing == []


def test_horovod_only_accessors_exist():
    est = KerasEstimator()
    # Horovod's EstimatorParams setters (Petastorm TransformSpec fields) and its ModelParams
    # spelling of setLabelColumns.
    assert est.setTransformationEditFields([("x", None, (), False)]) is est
    assert est.setTransformationRemovedFields(["y"]).getTransformationRemovedFields() == ["y"]
    assert est.setTensorflowDatasetPrefetchBufferSize(8).getTensorflowDatasetPrefetchBufferSize() \
        == 8
    assert KerasModel().setLabelColoumns(["y"]).getLabelColumns() == ["y"]


def test_prefetch_buffer_is_accepted_with_a_one_line_note(capsys):
    est = KerasEstimator(tensorflow_dataset_prefetch_buffer_size=4)
    est._note_ignored_params()
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    assert out[0].startswith("KerasEstimator: tensorflow_dataset_prefetch_buffer_size is "
                             "ignored: ")
    with pytest.raises(TypeError, match="tensorflow_dataset_prefetch_buffer_size"):
        KerasEstimator(tensorflow_dataset_prefetch_buffer_size="big")
