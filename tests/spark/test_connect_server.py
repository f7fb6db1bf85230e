"""Through a separate Spark Connect server process, as a notebook on Databricks works.

The server (``SparkConnectServer`` from the pyspark install, on loopback) runs a
``local-cluster[2,1,1024]`` application (two executor JVMs, each announcing one fake GPU
through a discovery script) in its own process; this process is only its client, and the
job may not connect back to it (``SDL_SPARK_CALLER_LINK=off``, as when the cluster cannot
reach a notebook): task 0's address travels by ``allGather``, the progress lines and
metrics come through the run's folder in the Store while the fit runs, and the results
and the fitted model come back through the job's rows.
"""

import io
import os
import socket
import subprocess
import sys
import time
from contextlib import redirect_stdout

import pytest

from spark_support import require_connect_server

require_connect_server()  # the server jar ships with pyspark 4.x only
torch = pytest.importorskip("torch")

from test_run_cases import _FAKE_GPU_DISCOVERY, topology  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_START_S = 120.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, log_path) -> None:
    deadline = time.monotonic() + _START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the Connect server exited ({proc.returncode}):\n"
                        + log_path.read_text()[-3000:])
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the Connect server did not listen within {_START_S:g} s:\n"
                + log_path.read_text()[-3000:])


@pytest.fixture(scope="module")
def remote_spark(tmp_path_factory, connect_client):
    import pyspark

    home = os.path.dirname(pyspark.__file__)
    port = _free_port()
    folder = tmp_path_factory.mktemp("connect")
    log_path = folder / "server.log"
    script = folder / "discover_gpus.sh"
    script.write_text(_FAKE_GPU_DISCOVERY)
    script.chmod(0o755)
    env = dict(os.environ, SPARK_HOME=home, PYSPARK_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get(
                   "PYTHONPATH", "").split(os.pathsep) if p]))
    command = [os.path.join(home, "bin", "spark-submit"), "--master", "local-cluster[2,1,1024]",
               "--class", "org.apache.spark.sql.connect.service.SparkConnectServer",
               "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
               "--conf", f"spark.connect.grpc.binding.port={port}",
               "--conf", "spark.ui.enabled=false",
               "--conf", "spark.ui.showConsoleProgress=false",
               "--conf", "spark.default.parallelism=2",
               "--conf", "spark.sql.shuffle.partitions=2",
               "--conf", "spark.driver.memory=1g",
               "--conf", "spark.executor.memory=512m",
               "--conf", "spark.worker.resource.gpu.amount=1",
               "--conf", f"spark.worker.resource.gpu.discoveryScript={script}",
               "--conf", "spark.executor.resource.gpu.amount=1",
               "--conf", "spark.task.resource.gpu.amount=1",
               "--conf", f"spark.pyspark.python={sys.executable}"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait_for_port(port, proc, log_path)
        with connect_client(f"sc://127.0.0.1:{port}") as session:
            yield session
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)


def test_run_across_executors_with_their_gpus(remote_spark, monkeypatch):
    from spark_dl.spark import run

    monkeypatch.setenv("SDL_SPARK_CALLER_LINK", "off")
    out = io.StringIO()
    results = run(topology, args=("r",), num_proc=2, stdout=out, stderr=io.StringIO())
    assert [r["rank"] for r in results] == [0, 1]
    for rank, r in enumerate(results):
        assert (r["size"], r["local_rank"], r["local_size"]) == (2, rank, 2)
        assert r["sum"] == 3.0 and r["devices"] == ["0"] and r["cuda"] == "0"
        assert r["secret_visible"] is False
    assert results[0]["task_parent"] != results[1]["task_parent"]  # two executor JVMs
    assert "[1]<stdout>:hello from rank 1\n" in out.getvalue()


def test_fit_through_a_separate_server_with_no_way_back(remote_spark, tmp_path, monkeypatch):
    import numpy as np

    from spark_dl.spark.common.store import Store
    from spark_dl.spark.torch import TorchEstimator

    monkeypatch.setenv("SDL_SPARK_CALLER_LINK", "off")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 3)).astype("float32")
    df = remote_spark.createDataFrame(
        [(row.tolist(), float(row.sum())) for row in x], "features array<float>, label double")
    net = torch.nn.Linear(3, 1)
    store = Store.create(str(tmp_path / "store"))
    est = TorchEstimator(num_proc=2, store=store, model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                         loss=torch.nn.functional.mse_loss, feature_cols=["features"],
                         label_cols=["label"], batch_size=32, epochs=3, verbose=1,
                         use_gpu=False)
    out = io.StringIO()
    with redirect_stdout(out):
        model = est.fit(df)
    text = out.getvalue()
    for epoch in (1, 2, 3):
        assert f"Epoch {epoch}/3" in text, text
    history = model.getHistory()
    assert len(history["loss"]) == 3 and history["loss"][-1] < history["loss"][0]
    # The progress came through the run's folder in the Store.
    run_path = store.get_run_path(model.getRunId())
    spools = store.listdir(os.path.join(run_path, "output"))
    pieces = [p for d in spools for p in store.listdir(d)]
    assert any(p.endswith(".started") for p in pieces)
    assert any(p.endswith(".stdout") for p in pieces), pieces
