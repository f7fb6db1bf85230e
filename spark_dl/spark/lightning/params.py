"""The Lightning estimator's and model's own params (the shared rows are in
:mod:`spark_dl.spark.common.params`). Their typed accessors are generated into
:mod:`spark_dl.spark.lightning.params_accessors` (``python -m
spark_dl.spark.common.params_codegen``).

Names follow ``horovod.spark.lightning.LightningEstimator``. The shared ``model`` is a
``LightningModule``; ``optimizer`` and ``loss`` are optional (see docs/lightning.md).
"""

from spark_dl.spark.common.params import ParamSpec, _bool, _dict, _int, _shapes

__all__ = ["LIGHTNING_PARAMS", "LIGHTNING_MODEL_PARAMS", "RESERVED_TRAINER_ARGS"]

#: Trainer arguments the estimator sets itself (key -> what to use instead).
RESERVED_TRAINER_ARGS = {
    "strategy": "spark_dl's SparkDLStrategy is always used",
    "accelerator": "use use_gpu", "devices": "use num_proc (one device per process)",
    "num_nodes": "use num_proc", "max_epochs": "use epochs", "min_epochs": "use epochs",
    "max_steps": "use epochs and train_steps_per_epoch",
    "min_steps": "use epochs and train_steps_per_epoch",
    "limit_train_batches": "use train_steps_per_epoch",
    "limit_val_batches": "use validation_steps_per_epoch",
    "val_check_interval": "validation runs once per epoch",
    "check_val_every_n_epoch": "validation runs once per epoch",
    "num_sanity_val_steps": "the driver's dry run checks the steps before training",
    "fast_dev_run": "use epochs=1 and train_steps_per_epoch",
    "overfit_batches": "use train_steps_per_epoch",
    "reload_dataloaders_every_n_epochs": "the estimator's loader is used every epoch",
    "use_distributed_sampler": "the estimator's loader shards the data",
    "callbacks": "use callbacks", "logger": "use logger", "profiler": "use profiler",
    "accumulate_grad_batches": "use backward_passes_per_step",
    "enable_checkpointing": "use checkpoint_callback (the run's checkpoint is always written)",
    "log_every_n_steps": "use log_every_n_steps",
}

#: ``LightningEstimator``'s rows beyond ``ESTIMATOR_PARAMS``.
LIGHTNING_PARAMS = (
    ParamSpec("input_shapes", "shape each feature column's tensor gets in the batch, e.g. "
              "[[-1, 1, 28, 28]] (default: as loaded, [rows, n] for vectors)", None,
              _shapes("input_shapes")),
    ParamSpec("trainer_args", "more keyword arguments of lightning's Trainer (e.g. "
              "gradient_clip_val, precision); the ones the estimator sets are refused", None,
              _dict("trainer_args")),
    ParamSpec("logger", "a Lightning logger (TensorBoardLogger, CSVLogger ...); its files "
              "go to the run's logs directory in the store", None, pickled=True),
    ParamSpec("checkpoint_callback", "a ModelCheckpoint callback; its files go to the run's "
              "checkpoints directory in the store", None, pickled=True),
    ParamSpec("profiler", "Trainer's profiler: 'simple', 'advanced' or a Profiler object",
              None, pickled=True),
    ParamSpec("log_every_n_steps", "how often (in steps) Lightning writes logged values to "
              "the logger", 50, _int("log_every_n_steps", 1)),
    ParamSpec("data_module", "Horovod's data module class; not supported: the estimator "
              "feeds the steps from its Arrow loader (use transformation_fn)", None,
              pickled=True),
)

#: ``LightningModel``'s rows beyond ``MODEL_PARAMS``.
LIGHTNING_MODEL_PARAMS = (
    ParamSpec("input_shapes", "shape each feature column's tensor gets before forward()",
              None, _shapes("input_shapes")),
    ParamSpec("use_gpu", "transform() predicts on a GPU of each executor when CUDA is "
              "available there (the GPU Spark assigned to the task, else the partition "
              "index modulo the executor's GPUs); on the CPU otherwise", True,
              _bool("use_gpu")),
)
