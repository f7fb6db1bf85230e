"""Elastic Keras on sdlrun end to end (docs/elastic.md): a worker dies inside ``model.fit``
and the others finish the requested epochs.

The job runs tests/parallel/elastic_keras_workers.py: a small Keras model trains through
``model.fit`` with spark_dl.keras.elastic's callbacks inside ``@hvd.elastic.run``.
"""

import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_keras_workers.py")
PY = sys.executable
EPOCHS = 4


def sdlrun(sdlrun_args, worker_args, out, timeout=240):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    cmd = [PY, "-m", "spark_dl.runner", *sdlrun_args, PY, WORKER, "--out", str(out),
           "--epochs", str(EPOCHS), *worker_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(out))
    return proc.returncode, proc.stdout + proc.stderr


def test_a_worker_killed_inside_fit_leaves_the_others_training(tmp_path):
    # Worker 2 dies right before batch 3 of epoch 1 (of 8 at 3 workers): the survivors
    # fail inside the compiled train step, roll back to the commit after batch 2, re-form
    # as 2 and run epoch 1 again, then the rest.
    rc, log = sdlrun(["-np", "3", "--min-np", "2"], ["--die", "2:1:3"], tmp_path)
    assert rc == 0, log
    assert "worker 2 on localhost failed with signal 9; the others go on" in log, log
    with open(tmp_path / "result.json") as f:
        res = json.load(f)
    assert res["resets"] == [2] and res["size"] == 2, res
    # The requested epochs ran, each once in the committed history: the first at 3
    # workers, the rest (the interrupted one again) at 2.
    assert res["epoch"] == EPOCHS, res
    assert [e for e, _, _ in res["losses"]] == list(range(EPOCHS)), res["losses"]
    assert [s for _, _, s in res["losses"]] == [3] + [2] * (EPOCHS - 1), res["losses"]
    losses = [loss for _, loss, _ in res["losses"]]
    assert losses[-1] < 0.5 * losses[0], losses
    # Both survivors end with the same, finite weights.
    first, second = res["weights"]
    assert all(math.isfinite(w) for w in first)
    assert first == second


def test_a_discovered_worker_joins_fit_and_training_goes_on_with_it(tmp_path):
    # 2 workers; at batch 2 of epoch 1 the discovery script reports a third slot and the
    # workers wait at their commits until the newcomer is there: all re-form as 3, the
    # newcomer (optimizer never applied) gets rank 0's state, and the epoch runs again on
    # 3. Horovod's BroadcastGlobalVariablesCallback is in the list too: the survivors
    # broadcast with the newcomer in the re-formed job's first fit.
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    rc, log = sdlrun(["--min-np", "2", "--max-np", "3", "--host-discovery-script",
                      f"cat {hosts}"],
                     ["--grow-at", "1:2", "--grow-to", "localhost:3", "--grow-size", "3",
                      "--hosts-file", str(hosts), "--broadcast-callback"], tmp_path)
    assert rc == 0, log
    with open(tmp_path / "result.json") as f:
        res = json.load(f)
    assert res["resets"] == [3] and res["size"] == 3, res
    assert res["epoch"] == EPOCHS, res
    assert [e for e, _, _ in res["losses"]] == list(range(EPOCHS)), res["losses"]
    assert [s for _, _, s in res["losses"]] == [2] + [3] * (EPOCHS - 1), res["losses"]
    losses = [loss for _, loss, _ in res["losses"]]
    assert losses[-1] < 0.5 * losses[0], losses
    assert len(res["weights"]) == 3 and all(math.isfinite(w) for w in res["weights"][0])
    assert res["weights"][1] == res["weights"][0] == res["weights"][2]
