"""The MPI launcher's pieces without running mpirun: launcher choice, the mpirun command
line, environment, failure explanations, and demultiplexing of Open MPI's tagged output."""

import io
import os

import pytest

from spark_dl.runner import launch
from spark_dl.runner.hosts import SlotInfo
from spark_dl.runner.mpi_run import (OPEN_MPI_TAG, explain_failure, exported_names,
                                     mpi_environment, mpirun_command, split_mpi_args)
from spark_dl.runner.options import LaunchOptions
from spark_dl.runner.output import OutputForwarder, TagDemux


# --- choosing the launcher --------------------------------------------------------------

@pytest.fixture
def build(monkeypatch):
    """Sets what the core reports as built, and whether mpirun is on PATH."""
    state = {"build": {"gloo": True, "mpi": True}, "mpirun": "/usr/bin/mpirun"}
    monkeypatch.setattr(launch, "_core_build", lambda: state["build"])
    monkeypatch.setattr(launch.shutil, "which", lambda name: state["mpirun"])
    monkeypatch.delenv("SDL_CONTROLLER", raising=False)
    return state


def test_flags_win(build):
    assert launch.choose_controller("mpi")[0] == "mpi"
    assert launch.choose_controller("gloo", {"SDL_CONTROLLER": "mpi"})[0] == "gloo"
    assert launch.choose_controller("auto", mpi_args="-x A") == ("mpi", "--mpi-args given")
    with pytest.raises(ValueError, match="--mpi-args needs --mpi"):
        launch.choose_controller("gloo", mpi_args=["-x", "A"])


def test_controller_knob_picks_the_launcher(build, monkeypatch):
    assert launch.choose_controller("auto", {"SDL_CONTROLLER": "MPI"}) == (
        "mpi", "SDL_CONTROLLER=mpi")
    monkeypatch.setenv("SDL_CONTROLLER", "mpi")
    assert launch.choose_controller("auto")[0] == "mpi"
    assert launch.choose_controller("auto", {"SDL_CONTROLLER": "gloo"})[0] == "gloo"


def test_gloo_is_the_default_even_with_mpi_available(build):
    assert launch.choose_controller("auto")[0] == "gloo"
    build["build"] = None  # core not built: the runner still launches
    assert launch.choose_controller("auto")[0] == "gloo"


def test_mpi_when_the_core_has_no_gloo(build):
    build["build"] = {"gloo": False, "mpi": True}
    assert launch.choose_controller("auto")[0] == "mpi"
    build["mpirun"] = None
    assert launch.choose_controller("auto")[0] == "gloo"


# --- the mpirun command line and environment ---------------------------------------------

def slots(*hosts):
    return [SlotInfo(h, r, 0, 0, len(hosts), 1, 1) for r, h in enumerate(hosts)]


def test_mpirun_command():
    argv = mpirun_command("/bin/mpirun", ["python", "t.py", "-np", "9"],
                          slots("localhost", "localhost", "b"), {"PATH": "/bin", "HOME": "/h"},
                          LaunchOptions(ssh_port=2222, ssh_identity_file="/k",
                                        mpi_args="--report-bindings -x FOO=1"))
    assert argv[:6] == ["/bin/mpirun", "--tag-output", "-np", "3", "-H", "localhost:2,b:1"]
    assert argv[6:10] == ["--map-by", "slot", "--bind-to", "none"]
    assert argv[10:13] == ["--mca", "plm_rsh_args", "-p 2222 -i /k"]
    assert argv[13:] == ["-x", "PATH", "--report-bindings", "-x", "FOO=1",
                         "python", "t.py", "-np", "9"]


def test_user_mapping_and_binding_replace_the_defaults():
    argv = mpirun_command("mpirun", ["x"], slots("localhost"), {},
                          LaunchOptions(mpi_args=["--bind-to", "core", "--map-by=node"]))
    assert "none" not in argv and "slot" not in argv
    assert argv[-4:] == ["--bind-to", "core", "--map-by=node", "x"]


@pytest.mark.parametrize("arg", ["-np", "-n", "--host", "-H", "--hostfile", "--tag-output",
                                 "--timestamp-output", "--output-filename=d", "--xml"])
def test_flags_sdlrun_owns_are_refused(arg):
    with pytest.raises(ValueError, match="--mpi-args"):
        split_mpi_args([arg, "1"])


def test_environment_drops_gloo_job_variables_and_the_secret():
    env = mpi_environment({"SDL_SECRET_KEY": "s", "SDL_RANK": "1", "HOROVOD_SIZE": "2",
                           "SDL_RENDEZVOUS_PORT": "5", "SDL_FUSION_THRESHOLD": "0",
                           "HOME": "/h", "OMPI_MCA_x": "1"}, {"USER_VAR": "u"}, "job1")
    assert env == {"SDL_FUSION_THRESHOLD": "0", "HOME": "/h", "OMPI_MCA_x": "1",
                   "USER_VAR": "u", "SDL_CONTROLLER": "mpi", "SDL_JOB_ID": "job1"}
    # HOME describes this session; OMPI_* is mpirun's own business.
    assert exported_names({**env, "BAD-NAME": "1"}) == [
        "SDL_CONTROLLER", "SDL_FUSION_THRESHOLD", "SDL_JOB_ID", "USER_VAR"]


def test_failure_explanations():
    killed = ("mpirun noticed that process rank 2 with PID 0 on node h1 exited on signal 9 "
              "(Killed).")
    assert explain_failure(137, killed) == (
        "rank 2 on h1 failed with signal 9; mpirun stopped the job")
    exited = "The first process to do so was:\n\n  Process name: [[5,1],1]\n  Exit code:    3\n"
    assert explain_failure(3, exited) == "rank 1 failed with exit code 3; mpirun stopped the job"
    assert "OMPI_ALLOW_RUN_AS_ROOT=1" in explain_failure(
        1, "mpirun has detected an attempt to run as root.")
    assert "--oversubscribe" in explain_failure(1, "There are not enough slots available in")
    assert explain_failure(5, "") == "mpirun failed with exit code 5 (see its messages above)"


# --- demultiplexing tagged output --------------------------------------------------------

def demux_all(chunks):
    demux = TagDemux(OPEN_MPI_TAG)
    pieces = []
    for chunk in chunks:
        pieces += demux.feed(chunk)
    pieces += demux.feed(b"", final=True)
    merged = {}
    for rank, stream, data in pieces:
        merged[(rank, stream)] = merged.get((rank, stream), b"") + data
    return merged, demux


def test_demux_interleaved_pieces_and_launcher_text():
    # As Open MPI 4.1 writes it: a tag per piece and after each inner newline; pieces
    # end mid-line; mpirun's own messages carry no tag.
    data = (b"[1,1]<stdout>:a[1,0]<stdout>:x\n[1,0]<stdout>:y[1,1]<stdout>:b\n"
            b"-----\nmpirun noticed\n[1,0]<stdout>:\n[1,2]<stddiag>:d\n")
    merged, demux = demux_all([data])
    assert merged == {(1, "stdout"): b"ab\n", (0, "stdout"): b"x\ny\n",
                      (None, None): b"-----\nmpirun noticed\n", (2, "stderr"): b"d\n"}
    assert bytes(demux.untagged_tail) == b"-----\nmpirun noticed\n"


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 13])
def test_demux_any_read_boundaries(size):
    data = (b"[1,0]<stdout>:hello [1,1]<stdout>:other\n[1,0]<stdout>:world\n"
            b"plain [text]\n[1,1]<stderr>:e\n[1,0]<stdout>:[not a tag\n")
    merged, _ = demux_all([data[i:i + size] for i in range(0, len(data), size)])
    assert merged == {(0, "stdout"): b"hello world\n[not a tag\n", (1, "stdout"): b"other\n",
                      (None, None): b"plain [text]\n", (1, "stderr"): b"e\n"}


def test_forwarder_rewrites_tagged_pipes_with_prefixes_and_files(tmp_path):
    out, err = io.BytesIO(), io.BytesIO()
    forwarder = OutputForwarder(out, err, output_dir=str(tmp_path))
    pipes = {}
    for name in ("stdout", "stderr"):
        read_fd, write_fd = os.pipe()
        pipes[name] = write_fd
        forwarder.add_tagged(name, os.fdopen(read_fd, "rb"), TagDemux(OPEN_MPI_TAG),
                             ranks=[0, 1, 2])
    forwarder.start()
    os.write(pipes["stdout"], b"[1,0]<stdout>:a[1,1]<stdout>:b\n[1,0]<stdout>:c\n")
    os.write(pipes["stderr"], b"[1,1]<stderr>:oops\nmpirun: done\n[1,0]<stderr>:tail")
    for fd in pipes.values():
        os.close(fd)
    assert forwarder.join(5)
    forwarder.close()
    assert out.getvalue() == b"[1]<stdout>:b\n[0]<stdout>:ac\n"
    assert err.getvalue() == b"[1]<stderr>:oops\nmpirun: done\n[0]<stderr>:tail\n"
    assert (tmp_path / "rank.0" / "stdout").read_bytes() == b"ac\n"
    assert (tmp_path / "rank.0" / "stderr").read_bytes() == b"tail"
    assert (tmp_path / "rank.2" / "stdout").read_bytes() == b""  # created up front
