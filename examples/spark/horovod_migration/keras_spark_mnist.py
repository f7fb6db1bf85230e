# Mirrors Horovod 0.28.1's examples/spark/keras/keras_spark_mnist.py, ported to spark_dl:
# the same flow (Store, SparkBackend, KerasEstimator, fit, transform, accuracy) with
# `spark_dl` imports instead of `horovod` ones and no other change to the training code.
# The differences from Horovod's script, and why each is there, are listed in
# docs/keras.md ("Porting Horovod's keras_spark_mnist"). One addition: MNIST is read from
# --data-dir when it is there (or downloaded with --download, as Horovod does), and
# otherwise replaced by generated MNIST-shaped data (28x28 images, 10 classes) so that the
# script runs without a network:
#
#   .venv/bin/python examples/spark/horovod_migration/keras_spark_mnist.py \
#       --num-proc 2 --epochs 1 --synthetic-rows 1000
"""Keras Spark MNIST, as Horovod's example, on spark_dl."""

import argparse
import os
import subprocess
import sys
import tempfile
from packaging import version

import numpy as np

import pyspark
import pyspark.sql.types as T
from pyspark import SparkConf
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
if version.parse(pyspark.__version__) < version.parse('3.0.0'):
    from pyspark.ml.feature import OneHotEncoderEstimator as OneHotEncoder
else:
    from pyspark.ml.feature import OneHotEncoder
from pyspark.sql import SparkSession
from pyspark.sql.functions import udf

import tensorflow as tf
from tensorflow import keras
from tensorflow.keras.models import Sequential
from tensorflow.keras.layers import Dense, Dropout, Flatten
from tensorflow.keras.layers import Conv2D, MaxPooling2D

import spark_dl.spark.keras as hvd                      # was: horovod.spark.keras
from spark_dl.spark.common.backend import SparkBackend  # was: horovod.spark.common.backend
from spark_dl.spark.common.store import Store           # was: horovod.spark.common.store

parser = argparse.ArgumentParser(description='Keras Spark MNIST Example',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--master',
                    help='spark master to connect to')
parser.add_argument('--num-proc', type=int,
                    help='number of worker processes for training, default: `spark.default.parallelism`')
parser.add_argument('--batch-size', type=int, default=128,
                    help='input batch size for training')
parser.add_argument('--epochs', type=int, default=12,
                    help='number of epochs to train')
parser.add_argument('--work-dir', default='/tmp',
                    help='temporary working directory to write intermediate files (prefix with hdfs:// to use HDFS)')
parser.add_argument('--data-dir', default='/tmp',
                    help='location of the training dataset (mnist.bz2, LIBSVM format) in the local filesystem')
parser.add_argument('--download', action='store_true',
                    help='download mnist.bz2 into --data-dir when it is not there (as Horovod does)')
parser.add_argument('--synthetic-rows', type=int, default=2000,
                    help='without mnist.bz2 in --data-dir: rows of generated MNIST-shaped data')


def synthetic_mnist_libsvm(path, rows, seed=0):
    """Writes ``rows`` generated 28x28 images of ten classes in the layout of MNIST's
    LIBSVM file (label, then 1-based pixel index:value, values in 0..255, zeros left out).

    Class k is a thick stroke: a horizontal bar for k < 5, a vertical one for k >= 5,
    at a position set by k, shifted by up to a pixel either way, plus sparse noise. The
    strokes are faint (value 32, not MNIST's 255), so that the example's own optimizer
    settings, made for 60,000 rows, learn them in one epoch on a thousand: the models
    do not rescale their input.
    """
    rng = np.random.default_rng(seed)
    with open(path, 'w') as f:
        for label in rng.integers(0, 10, rows):
            img = np.zeros((28, 28))
            at = 3 + 5 * (label % 5) + rng.integers(-1, 2)
            span = slice(4 + rng.integers(0, 3), 24 - rng.integers(0, 3))
            if label < 5:
                img[at:at + 3, span] = 32
            else:
                img[span, at:at + 3] = 32
            noise = rng.random((28, 28)) < 0.03
            img[noise] = rng.integers(8, 33, noise.sum())
            nz = np.flatnonzero(img)
            f.write(f'{label} ' + ' '.join(f'{i + 1}:{int(img.flat[i])}' for i in nz) + '\n')


if __name__ == '__main__':
    args = parser.parse_args()

    # Initialize SparkSession
    conf = SparkConf().setAppName('keras_spark_mnist').set('spark.sql.shuffle.partitions', '16')
    if args.master:
        conf.setMaster(args.master)
    elif args.num_proc:
        conf.setMaster('local[{}]'.format(args.num_proc))
    spark = SparkSession.builder.config(conf=conf).getOrCreate()

    # Setup our store for intermediate data
    store = Store.create(args.work_dir)

    # MNIST from --data-dir (downloaded with --download), else generated MNIST-shaped data
    libsvm_path = os.path.join(args.data_dir, 'mnist.bz2')
    if not os.path.exists(libsvm_path) and args.download:
        data_url = 'https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass/mnist.bz2'
        subprocess.check_output(['wget', data_url, '-O', libsvm_path])
    if not os.path.exists(libsvm_path):
        libsvm_path = os.path.join(tempfile.mkdtemp(prefix='keras_spark_mnist_'), 'mnist.libsvm')
        synthetic_mnist_libsvm(libsvm_path, args.synthetic_rows)
        print(f'{args.data_dir}/mnist.bz2 not found: using {args.synthetic_rows} rows of '
              f'generated MNIST-shaped data', file=sys.stderr)

    # Load dataset into a Spark DataFrame
    df = spark.read.format('libsvm') \
        .option('numFeatures', '784') \
        .load(libsvm_path)

    # One-hot encode labels into SparseVectors
    encoder = OneHotEncoder(inputCols=['label'],
                            outputCols=['label_vec'],
                            dropLast=False)
    model = encoder.fit(df)
    train_df = model.transform(df)

    # Train/test split
    train_df, test_df = train_df.randomSplit([0.9, 0.1])

    # Disable GPUs when building the model to prevent memory leaks
    if version.parse(tf.__version__) >= version.parse('2.0.0'):
        # See https://github.com/tensorflow/tensorflow/issues/33168
        os.environ['CUDA_VISIBLE_DEVICES'] = '-1'
    else:
        keras.backend.set_session(tf.Session(config=tf.ConfigProto(device_count={'GPU': 0})))

    # Define the Keras model without any Horovod-specific parameters
    model = Sequential()
    model.add(Conv2D(32, kernel_size=(3, 3),
                     activation='relu',
                     input_shape=(28, 28, 1)))
    model.add(Conv2D(64, (3, 3), activation='relu'))
    model.add(MaxPooling2D(pool_size=(2, 2)))
    model.add(Dropout(0.25))
    model.add(Flatten())
    model.add(Dense(128, activation='relu'))
    model.add(Dropout(0.5))
    model.add(Dense(10, activation='softmax'))

    optimizer = keras.optimizers.Adadelta(1.0)
    loss = keras.losses.categorical_crossentropy

    # Train a Horovod Spark Estimator on the DataFrame
    backend = SparkBackend(num_proc=args.num_proc,
                           stdout=sys.stdout, stderr=sys.stderr,
                           prefix_output_with_timestamp=True)
    keras_estimator = hvd.KerasEstimator(backend=backend,
                                         store=store,
                                         model=model,
                                         optimizer=optimizer,
                                         loss=loss,
                                         metrics=['accuracy'],
                                         feature_cols=['features'],
                                         label_cols=['label_vec'],
                                         batch_size=args.batch_size,
                                         epochs=args.epochs,
                                         random_seed=1,
                                         inmemory_cache_all=True,
                                         verbose=1,
                                         callbacks=[keras.callbacks.TensorBoard(profile_batch=5)])

    keras_model = keras_estimator.fit(train_df).setOutputCols(['label_prob'])

    # Evaluate the model on the held-out test DataFrame
    pred_df = keras_model.transform(test_df)
    argmax = udf(lambda v: float(np.argmax(v)), returnType=T.DoubleType())
    pred_df = pred_df.withColumn('label_pred', argmax(pred_df.label_prob))
    evaluator = MulticlassClassificationEvaluator(predictionCol='label_pred', labelCol='label', metricName='accuracy')
    print('Test accuracy:', evaluator.evaluate(pred_df))

    spark.stop()
