# Mirrors Horovod 0.28.1's examples/spark/pytorch/pytorch_lightning_spark_mnist.py, ported
# to spark_dl and Lightning 2: the same flow (Store, SparkBackend, TorchEstimator, fit,
# transform, accuracy) with `spark_dl` imports instead of `horovod` ones; the module and
# callback hooks that Lightning 2 removed are replaced by their Lightning 2 forms (marked
# "Lightning 2" below). The full list of changes is in docs/lightning.md ("Porting
# Horovod's pytorch_lightning_spark_mnist"). One addition: MNIST is read from --data-dir
# when it is there (or downloaded with --download, as Horovod does), and otherwise replaced
# by generated MNIST-shaped data (28x28 images, 10 classes) so that the script runs
# without a network:
#
#   .venv/bin/python examples/spark/horovod_migration/pytorch_lightning_spark_mnist.py \
#       --num-proc 2 --epochs 1 --synthetic-rows 1500
"""PyTorch Lightning Spark MNIST, as Horovod's example, on spark_dl."""

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

# (Horovod's guard against TensorFlow 2.5/2.6 is gone: that conflict was Horovod's own
# build's, and the guard's `import tensorflow` costs seconds.)

from pytorch_lightning import LightningModule

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import spark_dl.spark.lightning as hvd                                # was: horovod.spark.lightning
from spark_dl.spark.lightning.estimator import MIN_PL_VERSION        # was: horovod.spark.lightning.estimator
from spark_dl.spark.common.backend import SparkBackend               # was: horovod.spark.common.backend
from spark_dl.spark.common.store import Store                        # was: horovod.spark.common.store

parser = argparse.ArgumentParser(description='PyTorch Spark MNIST Example',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--master',
                    help='spark master to connect to')
parser.add_argument('--num-proc', type=int, default=2,
                    help='number of worker processes for training, default: `spark.default.parallelism`')
parser.add_argument('--batch-size', type=int, default=64,
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
parser.add_argument('--enable-profiler', action='store_true',
                    help='Enable profiler')


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


def train_model(args):
    # do not run this test for pytorch lightning below min supported verson
    import pytorch_lightning as pl
    if version.parse(pl.__version__) < version.parse(MIN_PL_VERSION):
        print("Skip test for pytorch_ligthning=={}, min support version is {}".format(pl.__version__, MIN_PL_VERSION))
        return

    # Initialize SparkSession
    conf = SparkConf().setAppName('pytorch_spark_mnist').set('spark.sql.shuffle.partitions', '16')
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
        libsvm_path = os.path.join(tempfile.mkdtemp(prefix='lightning_spark_mnist_'), 'mnist.libsvm')
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

    # Define the PyTorch model without any Horovod-specific parameters
    class Net(LightningModule):
        def __init__(self, kernel_size):
            super(Net, self).__init__()
            # The Lightning checkpoint also saves the arguments passed into the LightningModule init
            # under the "hyper_parameters" key in the checkpoint.
            self.save_hyperparameters()
            self.conv1 = nn.Conv2d(1, 10, kernel_size=kernel_size)
            self.conv2 = nn.Conv2d(10, 20, kernel_size=kernel_size)
            self.conv2_drop = nn.Dropout2d()
            self.fc1 = nn.Linear(320, 50)
            self.fc2 = nn.Linear(50, 10)
            # Lightning 2: validation_epoch_end(outputs) is gone; the steps keep their outputs
            self.validation_step_outputs = []

        def forward(self, x):
            x = x.float().reshape((-1, 1, 28, 28))
            x = F.relu(F.max_pool2d(self.conv1(x), 2))
            x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
            x = x.view(-1, 320)
            x = F.relu(self.fc1(x))
            x = F.dropout(x, training=self.training)
            x = self.fc2(x)
            return F.log_softmax(x, -1)

        def configure_optimizers(self):
            return optim.SGD(self.parameters(), lr=0.01, momentum=0.5)

        def training_step(self, batch, batch_idx):
            if batch_idx == 0:
                print(f"training data batch size: {batch['label'].shape}")
            x, y = batch['features'], batch['label']
            y_hat = self(x)
            loss = F.nll_loss(y_hat, y.long())
            self.log('train_loss', loss)
            return loss

        def validation_step(self, batch, batch_idx):
            if batch_idx == 0:
                print(f"validation data batch size: {batch['label'].shape}")
            x, y = batch['features'], batch['label']
            y_hat = self(x)
            loss = F.nll_loss(y_hat, y.long())
            self.log('val_loss', loss)
            self.validation_step_outputs.append({'val_loss': loss})  # Lightning 2

        def on_validation_epoch_end(self):  # Lightning 2: was validation_epoch_end(self, outputs)
            outputs = self.validation_step_outputs
            avg_loss = torch.stack([x['val_loss'] for x in outputs]).mean() if len(outputs) > 0 else float('inf')
            self.log('avg_val_loss', avg_loss)
            outputs.clear()

    model = Net(5)

    # Train a Horovod Spark Estimator on the DataFrame
    backend = SparkBackend(num_proc=args.num_proc,
                           stdout=sys.stdout, stderr=sys.stderr,
                           prefix_output_with_timestamp=True)

    from pytorch_lightning.callbacks import Callback

    epochs = args.epochs

    class MyDummyCallback(Callback):
        def __init__(self):
            self.epcoh_end_counter = 0
            self.train_epcoh_end_counter = 0
            self.validation_epoch_end_counter = 0

        # Lightning 2 no longer calls on_init_start, on_init_end or on_epoch_end (it
        # ignores them silently), so they are gone here; the two epoch-end hooks below
        # count for on_epoch_end, which the check in on_train_end needs.

        def on_train_epoch_end(self, trainer, model, unused=None):
            print('A train epoch ended.')
            self.epcoh_end_counter += 1
            self.train_epcoh_end_counter += 1

        def on_validation_epoch_end(self, trainer, model, unused=None):
            print('A val epoch ended.')
            self.epcoh_end_counter += 1
            self.validation_epoch_end_counter += 1

        def on_train_end(self, trainer, model):
            print("Training ends:"
                  f"epcoh_end_counter={self.epcoh_end_counter}, "
                  f"train_epcoh_end_counter={self.train_epcoh_end_counter}, "
                  f"validation_epoch_end_counter={self.validation_epoch_end_counter} \n")
            assert self.train_epcoh_end_counter <= epochs
            assert self.epcoh_end_counter == self.train_epcoh_end_counter + self.validation_epoch_end_counter

    callbacks = [MyDummyCallback()]

    if version.parse(torch.__version__) < version.parse('1.13'):
        # Horovod adds these two only for torch < 1.13: on newer torch, Lightning's Horovod
        # strategy fails to reduce their values. With spark_dl they work on any torch
        # (this guard may go; see docs/lightning.md).
        # ModelCheckpoint
        from pytorch_lightning.callbacks.model_checkpoint import ModelCheckpoint
        callbacks.append(ModelCheckpoint(monitor='val_loss', mode="min",
                                         save_top_k=1, verbose=True))
        # EarlyStopping
        from pytorch_lightning.callbacks.early_stopping import EarlyStopping
        callbacks.append(EarlyStopping(monitor='val_loss',
                                       min_delta=0.001,
                                       patience=3,
                                       verbose=True,
                                       mode='min'))

    torch_estimator = hvd.TorchEstimator(backend=backend,
                                         store=store,
                                         model=model,
                                         input_shapes=[[-1, 1, 28, 28]],
                                         feature_cols=['features'],
                                         label_cols=['label'],
                                         batch_size=args.batch_size,
                                         epochs=args.epochs,
                                         validation=0.1,
                                         verbose=1,
                                         callbacks=callbacks,
                                         profiler="simple" if args.enable_profiler else None)

    torch_model = torch_estimator.fit(train_df).setOutputCols(['label_prob'])

    # Evaluate the model on the held-out test DataFrame
    pred_df = torch_model.transform(test_df)

    argmax = udf(lambda v: float(np.argmax(v)), returnType=T.DoubleType())
    pred_df = pred_df.withColumn('label_pred', argmax(pred_df.label_prob))
    evaluator = MulticlassClassificationEvaluator(predictionCol='label_pred', labelCol='label', metricName='accuracy')
    print('Test accuracy:', evaluator.evaluate(pred_df))

    spark.stop()


if __name__ == '__main__':
    args = parser.parse_args()
    train_model(args)
