"""Allreduce time and bandwidth by message size: spark_dl against torch.distributed (gloo)
and mpi4py on Open MPI, all measured in the same run.

    PYTHONPATH=. .venv/bin/python benchmarks/allreduce.py                # 4 KiB .. 256 MiB
    PYTHONPATH=. .venv/bin/python benchmarks/allreduce.py --quick        # 4 KiB .. 16 MiB, 1 round
    PYTHONPATH=. .venv/bin/python benchmarks/allreduce.py --max-size 64M --iters 20

Every peer reduces a float32 buffer in place with a sum (spark_dl ``allreduce_``,
``dist.all_reduce``, ``Allreduce(MPI.IN_PLACE, ...)``), sizes growing by 4x. Each size is
timed per call on rank 0 after warm-up; the tables show the median over all calls of all
rounds. ``algbw = bytes / time`` and ``busbw = algbw * 2(n-1)/n`` (the nccl-tests
definition, comparable across rank counts), both in GB/s (1e9 bytes). Ratios are spark_dl's
time over the peer's: below 1 means spark_dl is faster.
"""

import _harness as H

DEFAULT_PEERS = ("spark_dl", "spark_dl_gloo", "spark_dl_mpi", "torch", "mpi")
# Large sizes run fewer calls, so that each size moves about this many bytes per job.
BYTES_PER_SIZE = 1 << 30


def sizes(args):
    out, s = [], args.min_size
    while s <= args.max_size:
        out.append(s)
        s *= args.step
    return out


def worker(args):
    backend = H.Backend(args.worker)
    times = {}
    for nbytes in sizes(args):
        iters = max(args.min_iters, min(args.iters, BYTES_PER_SIZE // nbytes))
        times[str(nbytes)] = H.time_allreduce(backend, nbytes, iters, args.warmup,
                                              name=f"allreduce.{nbytes}")
    backend.report({"times": times})
    backend.close()


def time_table(med, peers):
    """Markdown table of the time per call of every size and peer, with spark_dl's ratios."""
    keys = list(med[peers[0]])
    others = [p for p in peers if not p.startswith("spark_dl")] if "spark_dl" in peers else []
    head = ["size"] + [H.PEER_LABELS[p] for p in peers]
    head += [f"spark_dl / {H.PEER_LABELS[p]}" for p in others]
    rows = [[H.fmt_size(int(k))] + [H.fmt_time(med[p][k]) for p in peers]
            + [H.fmt_ratio(med["spark_dl"][k], med[p][k]) for p in others] for k in keys]
    return H.markdown_table(head, rows)


def bandwidth_table(med, peers, np_):
    head = ["size"]
    for p in peers:
        head += [f"{H.PEER_LABELS[p]} algbw", "busbw"]
    factor = 2 * (np_ - 1) / np_
    rows = []
    for k in med[peers[0]]:
        row = [H.fmt_size(int(k))]
        for p in peers:
            algbw = int(k) / med[p][k] / 1e9
            row += [f"{algbw:.2f}", f"{algbw * factor:.2f}"]
        rows.append(row)
    return H.markdown_table(head, rows)


def driver(args):
    wargs = ["--min-size", args.min_size, "--max-size", args.max_size, "--step", args.step,
             "--iters", args.iters, "--min-iters", args.min_iters, "--warmup", args.warmup]
    peers, results = H.launch(args, __file__, wargs, "allreduce benchmark")
    keys = list(results[peers[0]][0]["times"])
    # Pooled: the median of every call of every round. Best round: the lowest of the
    # per-round medians, i.e. each peer in its quietest launch.
    pooled = {p: {k: H.median(H.pooled(r["times"][k] for r in results[p])) for k in keys}
              for p in peers}
    best = {p: {k: min(H.median(r["times"][k]) for r in results[p]) for k in keys}
            for p in peers}
    H.print_header(f"allreduce, {args.np} ranks, in-place float32 sum ({args.rounds} round(s))",
                   args, results)
    print("Median time per call over all calls of all rounds:\n")
    print(time_table(pooled, peers) + "\n")
    print("Bandwidth in GB/s from those medians (busbw = algbw * 2(n-1)/n):\n")
    print(bandwidth_table(pooled, peers, args.np) + "\n")
    print("Best round (lowest per-round median; each peer in its quietest launch):\n")
    print(time_table(best, peers))
    k = str(64 << 20)
    if "spark_dl" in peers and "mpi" in peers and k in keys:
        for label, med in (("all rounds", pooled), ("best round", best)):
            ok = med["spark_dl"][k] <= med["mpi"][k]
            print(f"\ntarget 64 MiB at least as fast as Open MPI ({label}): "
                  f"{H.fmt_time(med['spark_dl'][k])} vs {H.fmt_time(med['mpi'][k])} -> "
                  f"{'met' if ok else 'NOT met'}", end="")
        print()


def add_args(parser):
    parser.add_argument("--min-size", type=H.parse_size, default=4 << 10,
                        help="smallest message (default 4K)")
    parser.add_argument("--max-size", type=H.parse_size, default=256 << 20,
                        help="largest message (default 256M)")
    parser.add_argument("--step", type=int, default=4, help="size multiplier (default 4)")
    parser.add_argument("--iters", type=int, default=50,
                        help="timed calls per size and job, at most (default 50; sizes above "
                             "16 MiB run fewer: about 1 GiB per size)")
    parser.add_argument("--min-iters", type=int, default=5,
                        help="timed calls per size and job, at least (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per size (default 2)")


def quick(args):
    args.max_size = min(args.max_size, 16 << 20)
    args.iters = min(args.iters, 20)


if __name__ == "__main__":
    H.bench_main(__doc__, DEFAULT_PEERS, 3, add_args, quick, worker, driver)
