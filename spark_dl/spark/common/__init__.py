"""The estimator layer every framework shares (the launch layer below it is
:mod:`spark_dl.spark.launch`).

- :mod:`.estimator` -- :class:`~.estimator.EstimatorBase`: ``fit`` from params to a Model.
  :mod:`.worker` -- the training loop on every worker; :mod:`.model` --
  :class:`~.model.ModelBase`: ``transform`` in Arrow batches; :mod:`.adapter` -- the contract
  a framework implements (:class:`~.adapter.WorkerAdapter`, :class:`~.adapter.Predictor`).
- :mod:`.params` -- the params tables (typed accessors generated into
  :mod:`.params_accessors` by :mod:`.params_codegen`); :mod:`.persistence` -- ML
  persistence; :mod:`.backend` -- what runs the workers; :mod:`.progress`,
  :mod:`.tensorboard`, :mod:`.callbacks` -- reporting and the user's hooks.
- :mod:`.store` -- :class:`~.store.Store` and its implementations: where prepared data,
  metadata, checkpoints and logs live.
- :mod:`.util` -- :func:`~.util.prepare_data` (DataFrame -> Parquet + metadata, cached) and
  helpers to read a prepared dataset's properties.
- :mod:`.data_loader_base` -- the loader contract, :class:`~.data_loader_base.DataSource` and
  the loader registry; :mod:`.data_loader` -- the Arrow-native loader;
  :mod:`.petastorm_loader` -- the optional petastorm adapter.
- :mod:`.sharding` -- which rows each rank reads and how they are cut into batches.
- :mod:`.schema`, :mod:`.parquet_writer`, :mod:`.cache`, :mod:`.metadata`, :mod:`.constants`
  -- the parts of ``prepare_data``; :mod:`.raw_columns` -- the raw encoding of array and
  vector columns that the writer and the loaders share.

The data modules import nothing native, so drivers can use them without the core.
"""
