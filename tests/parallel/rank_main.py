"""Entry point of one spawned test rank: rank_main.py module:function outdir [args...]."""

import importlib
import os
import pickle
import sys
import traceback


def main():
    if os.environ.get("SDL_TEST_FAULTHANDLER"):  # debugging aid: dump stacks of a hung rank
        import faulthandler
        faulthandler.dump_traceback_later(10)
    target, outdir = sys.argv[1], sys.argv[2]
    module, func = target.split(":")
    rank = os.environ.get("SDL_RANK") or os.environ["OMPI_COMM_WORLD_RANK"]
    # Simulated hosts: SDL_TEST_HOSTS="a,a,b" gives rank i the host identity hosts[i].
    if os.environ.get("SDL_TEST_HOSTS"):
        os.environ["SDL_HOST_ID"] = os.environ["SDL_TEST_HOSTS"].split(",")[int(rank)]
    try:
        value = getattr(importlib.import_module(module), func)(*sys.argv[3:])
        payload = {"ok": True, "value": value}
    except BaseException:  # noqa: B902 - carried back to the test
        payload = {"ok": False, "traceback": traceback.format_exc()}
    tmp = os.path.join(outdir, f".rank.{rank}")
    with open(tmp, "wb") as f:
        pickle.dump(payload, f)
    os.replace(tmp, os.path.join(outdir, f"rank.{rank}"))
    sys.stdout.flush()
    # Skip interpreter teardown races with the core's thread: shut down explicitly.
    try:
        import spark_dl.common as c

        c.shutdown()
    except Exception:  # noqa: BLE001
        pass


if __name__ == "__main__":
    main()
