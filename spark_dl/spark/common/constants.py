"""Names shared by the Store, ``prepare_data`` and the data loaders.

They define the on-store layout of a prepared dataset, so changing one is a format change:
bump :data:`METADATA_FORMAT_VERSION` with it.
"""

#: Version of the dataset metadata document written by ``prepare_data``. 2: dense array and
#: vector columns are stored raw (:mod:`.raw_columns`); 1: as Parquet lists.
METADATA_FORMAT_VERSION = 2
#: Versions this code reads (a format-1 dataset stays readable: the loaders decode lists).
METADATA_FORMAT_VERSIONS_READ = (1, 2)

# Store layout (relative to the store prefix); a dataset index is appended as ".<idx>".
TRAIN_DATA_DIR = "intermediate_train_data"
VAL_DATA_DIR = "intermediate_val_data"
TEST_DATA_DIR = "intermediate_test_data"
METADATA_FILE = "intermediate_metadata"  # "<METADATA_FILE>.<idx>.json"
RUNS_DIR = "runs"
LOGS_SUBDIR = "logs"
DEFAULT_CHECKPOINT_FILENAME = "checkpoint"

# Kinds of column a dataset can hold (metadata "kind").
KIND_SCALAR = "scalar"   # one number per row
KIND_ARRAY = "array"     # Spark ArrayType of numbers, fixed length within the column
KIND_VECTOR = "vector"   # Spark ML DenseVector / SparseVector, fixed size within the column

# Sparse vector columns are stored as a Parquet struct with these two list fields.
SPARSE_INDICES_FIELD = "indices"
SPARSE_VALUES_FIELD = "values"

# Names of the Parquet data files written by prepare_data (one per Spark partition).
PART_FILE_TEMPLATE = "part-{partition:05d}.parquet"
