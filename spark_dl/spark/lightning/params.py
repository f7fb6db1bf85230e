"""The Lightning estimator's and model's own params (the shared rows are in
:mod:`spark_dl.spark.common.params`). Their typed accessors are generated into
:mod:`spark_dl.spark.lightning.params_accessors` (``python -m
spark_dl.spark.common.params_codegen``).

Names follow Horovod's Lightning estimator, ``horovod.spark.lightning.TorchEstimator``
(0.28.1): every one of its params is accepted; those that mean nothing here carry an
``ignored`` note, printed once per fit when set. The shared ``model`` is a
``LightningModule`` (or a plain ``torch.nn.Module`` with ``optimizer`` and ``loss``, which
the estimator wraps); ``optimizer`` and ``loss`` are optional otherwise (see
docs/lightning.md).
"""

from spark_dl.spark.common.params import ParamSpec, _bool, _dict, _int, _shapes

__all__ = ["LIGHTNING_PARAMS", "LIGHTNING_MODEL_PARAMS", "RESERVED_TRAINER_ARGS"]

#: Trainer arguments the estimator sets itself (key -> what to use instead). A value that
#: agrees with what the estimator sets is accepted (``LightningEstimator`` knows which);
#: only a conflicting one is refused, with this advice.
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
              "gradient_clip_val, precision); one the estimator sets is accepted when its "
              "value agrees (num_sanity_val_steps=0, max_epochs=epochs ...), else refused", None,
              _dict("trainer_args")),
    ParamSpec("logger", "a Lightning logger (TensorBoardLogger, CSVLogger ...); its files "
              "go to the run's logs directory in the store (default: a TensorBoardLogger "
              "there, as Horovod; False: no logger)", None, pickled=True),
    ParamSpec("checkpoint_callback", "a ModelCheckpoint callback; its files go to the run's "
              "checkpoints directory in the store", None, pickled=True),
    ParamSpec("profiler", "Trainer's profiler: 'simple', 'advanced' or a Profiler object",
              None, pickled=True),
    ParamSpec("log_every_n_steps", "how often (in steps) Lightning writes logged values to "
              "the logger", 50, _int("log_every_n_steps", 1)),
    # Lightning computes metrics in the module's steps (self.log), not from these.
    ParamSpec("metrics", "Horovod's metric functions", None, pickled=True,
              ignored="log metrics from the module's steps with self.log('acc', value); "
              "they become the history's metrics"),
    # Horovod's rows that mean nothing with spark_dl's loader and Trainer (0.28.1 names).
    ParamSpec("num_gpus", "Horovod's GPUs per process", None, _int("num_gpus"),
              aliases=("NumGPUs",), ignored="each process trains on one GPU when use_gpu "
              "is True and CUDA is there, else on the CPU (use_gpu=False for the CPU)"),
    ParamSpec("loader_num_epochs", "Horovod's Petastorm reader epochs", None,
              _int("loader_num_epochs", 1), ignored="the Arrow loader reads the data "
              "once per epoch, for epochs epochs"),
    ParamSpec("debug_data_loader", "Horovod's data loader debug flag", None,
              _bool("debug_data_loader"), ignored="the Arrow loader has no debug mode "
              "(verbose=2 shows data preparation and launch details)"),
    ParamSpec("train_async_data_loader_queue_size", "Horovod's async loader queue size",
              None, _int("train_async_data_loader_queue_size"),
              ignored="the Arrow loader's reader threads prefetch "
              "(train_reader_num_workers)"),
    ParamSpec("val_async_data_loader_queue_size", "Horovod's async loader queue size", None,
              _int("val_async_data_loader_queue_size"),
              ignored="the Arrow loader's reader threads prefetch (val_reader_num_workers)"),
    ParamSpec("loss_constructors", "Horovod's loss factories", None, pickled=True,
              ignored="Horovod's Lightning estimator does not use them either: pass loss= "
              "or compute the loss in training_step"),
    ParamSpec("train_minibatch_fn", "Horovod's custom torch training step", None,
              pickled=True, ignored="Horovod's Lightning estimator does not use it either: "
              "define training_step in a LightningModule"),
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
