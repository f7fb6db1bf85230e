"""Small-message latency: one 4 KiB allreduce repeated under one name, back to back.

    PYTHONPATH=. .venv/bin/python benchmarks/latency.py
    PYTHONPATH=. .venv/bin/python benchmarks/latency.py --quick
    PYTHONPATH=. .venv/bin/python benchmarks/latency.py --size 64K --iters 5000

Each peer reduces the same float32 buffer in place with a sum; rank 0 times every call.
The table gives the median, 90th percentile and minimum over all calls of all rounds. With
a fixed name, spark_dl's response cache lets every call after the first skip the full
negotiation (the core's counters are printed to show it). Target: spark_dl median under
100 us.
"""

import _harness as H

DEFAULT_PEERS = ("spark_dl", "spark_dl_gloo", "torch", "mpi")
TARGET_US = 100.0
COUNTERS = ("tensors", "collectives", "cache_hits", "full_negotiations")


def worker(args):
    backend = H.Backend(args.worker)
    before = backend.counters()
    samples = H.time_allreduce(backend, args.size, args.iters, args.warmup, name="latency")
    backend.report({"samples": samples,
                    "counters": H.counter_delta(before, backend.counters(), COUNTERS)})
    backend.close()


def driver(args):
    wargs = ["--size", args.size, "--iters", args.iters, "--warmup", args.warmup]
    peers, results = H.launch(args, __file__, wargs,
                              f"latency benchmark, {H.fmt_size(args.size)}")
    stats, rounds = {}, {}
    for p in peers:
        xs = H.pooled(r["samples"] for r in results[p])
        stats[p] = (H.median(xs), H.percentile(xs, 90), min(xs))
        rounds[p] = " / ".join(f"{H.median(r['samples']) * 1e6:.1f}" for r in results[p])
    rows = [[H.PEER_LABELS[p]] + [f"{x * 1e6:.1f}" for x in stats[p]]
            + [H.fmt_ratio(stats["spark_dl"][0], stats[p][0]) if "spark_dl" in stats else "-",
               rounds[p]]
            for p in peers]
    H.print_header(f"latency: {H.fmt_size(args.size)} allreduce under one name, {args.np} "
                   f"ranks ({args.rounds} round(s) x {args.iters} calls)", args, results)
    print(H.markdown_table(["peer", "median us", "p90 us", "min us", "spark_dl / peer",
                            "per-round medians us"], rows))
    for p in peers:
        if p.startswith("spark_dl"):
            c = results[p][-1]["counters"]
            print(f"\n{H.PEER_LABELS[p]} counters over the last job's calls (warm-up and "
                  "check included): " + ", ".join(f"{k} {v:g}" for k, v in c.items()))
    if "spark_dl" in stats:
        us = stats["spark_dl"][0] * 1e6
        print(f"\ntarget spark_dl median < {TARGET_US:g} us: {us:.1f} us -> "
              f"{'met' if us < TARGET_US else 'NOT met'}")


def add_args(parser):
    parser.add_argument("--size", type=H.parse_size, default=4 << 10,
                        help="message size (default 4K)")
    parser.add_argument("--iters", type=int, default=2000,
                        help="timed calls per job (default 2000)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed calls per job")


def quick(args):
    args.iters = min(args.iters, 500)


if __name__ == "__main__":
    H.bench_main(__doc__, DEFAULT_PEERS, 3, add_args, quick, worker, driver)
