"""Framework-neutral pieces of the Spark integration.

- :mod:`.store` -- :class:`~.store.Store` and its implementations: where prepared data,
  metadata, checkpoints and logs live.
- :mod:`.util` -- :func:`~.util.prepare_data` (DataFrame -> Parquet + metadata, cached) and
  helpers to read a prepared dataset's properties.
- :mod:`.data_loader_base` -- the loader contract, :class:`~.data_loader_base.DataSource` and
  the loader registry; :mod:`.data_loader` -- the Arrow-native loader;
  :mod:`.petastorm_loader` -- the optional petastorm adapter.
- :mod:`.sharding` -- which rows each rank reads and how they are cut into batches.
- :mod:`.schema`, :mod:`.parquet_writer`, :mod:`.cache`, :mod:`.metadata`, :mod:`.constants`
  -- the parts of ``prepare_data``.

Nothing here imports the native core, so workers and drivers can use it without it.
"""
