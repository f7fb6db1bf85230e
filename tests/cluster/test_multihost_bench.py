"""benchmarks/multihost.py --quick on namespace hosts: every peer measured, the ratios and
issue 31's targets printed, spark_dl's step split (its calls, the core's counters), settings
passed to spark_dl's ranks with --env, nothing left behind (conftest.py checks the
namespaces)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "multihost.py")
TIMEOUT_S = 90
LABELS = ("spark_dl flat", "spark_dl hierarchical", "torch gloo", "Open MPI")


def test_quick_run_prints_every_peer_and_the_ratios(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "multihost.json"
    # About 30 s on a quiet 2-core machine, 50 s at load average 8. Each job is bounded
    # by the script too, so a hang shows up as a failed peer first; past the bound the
    # script gets SIGTERM, on which netns.py removes the hosts (conftest.py checks it).
    # Fusion off through --env: every tensor of the step is then a collective of its own,
    # which the counters must show (so the setting reached the ranks, and they count).
    proc = subprocess.Popen([sys.executable, SCRIPT, "--quick", "--json", str(out),
                             "--env", "SDL_FUSION_THRESHOLD=0"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        text, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            text, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, err = proc.communicate()
        raise AssertionError(f"--quick ran over {TIMEOUT_S} s\n{text}\n{err[-4000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{text}\n{err[-4000:]}"
    assert "no netem" in text
    rows = {label: line for line in text.splitlines() for label in LABELS
            if line.startswith(f"| {label} (")}
    assert sorted(rows) == sorted(LABELS), text
    for label, line in rows.items():
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert "FAILED" not in line and cells[1].endswith(("ms", "s")), line
        assert cells[3].replace(".", "").isdigit() and cells[4].endswith("%"), line
    for needle in ("x torch gloo", "x Open MPI", "target spark_dl's best >= every peer",
                   "target >= 85%", "hierarchical / flat", "target >= 1.3x"):
        assert needle in text, f"{needle!r} missing:\n{text}"
    import json

    saved = json.loads(out.read_text())
    (config,) = saved["summary"]
    assert set(config["peers"]) == {"flat", "hier", "torch", "mpi"}
    assert config["peers"]["hier"]["transport"] == "hierarchical"
    for peer in ("flat", "hier"):
        mine = config["peers"][peer]
        assert mine["step_counters"]["collectives"] == 200, mine
        assert 0 < mine["step_enqueue_s"] < mine["step_s"]["median"], mine
    assert text.count("`allreduce_async_` calls take") == 2, text
    assert set(config["targets"]) == {"best_allreduce_vs_peers", "best_step_vs_peers",
                                      "busbw_85pct", "hier_1_3x_flat"}
