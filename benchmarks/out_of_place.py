"""Out-of-place against in-place allreduce in the same job: spark_dl's torch front end.

    PYTHONPATH=. .venv/bin/python benchmarks/out_of_place.py                 # 1 MiB .. 64 MiB
    PYTHONPATH=. .venv/bin/python benchmarks/out_of_place.py --quick         # 64 MiB, 1 round
    PYTHONPATH=. .venv/bin/python benchmarks/out_of_place.py --peers spark_dl,spark_dl_gloo

Each rank alternates, call by call, ``hvd.allreduce_(x)`` (in place), ``y = hvd.allreduce(x)``
(out of place; the previous ``y`` is released when the new one replaces it, as in a training
loop), the same allreduce into a fresh ``torch.empty_like(x)`` output (how ``allreduce`` worked
before the core allocated its outputs) and a plain ``x.clone()`` of the same tensor (what one
fresh tensor of that size costs here, page faults included). Sum of float32 tensors; the first calls check the results. Times
are rank 0's per call; the tables show the median over all calls of all rounds with the 10th
and 90th percentiles, and the ratio out-of-place / in-place (the target at 64 MiB: at most
1.5). Both forms run in the same job, interleaved, so a noisy machine slows them alike.
"""

import time

import _harness as H

DEFAULT_PEERS = ("spark_dl",)
BYTES_PER_SIZE = 1 << 30
FORMS = ("in_place", "out_of_place", "torch_output", "clone")
LABELS = {"in_place": "in place", "out_of_place": "out of place",
          "torch_output": "out of place, torch.empty_like output", "clone": "x.clone()"}


def sizes(args):
    out, s = [], args.min_size
    while s <= args.max_size:
        out.append(s)
        s *= args.step
    return out


def time_size(hvd, torch, ops, nbytes, iters, warmup):
    n = nbytes // 4
    x = torch.ones(n, dtype=torch.float32)
    y = hvd.allreduce(x, op=hvd.Sum, name=f"oop.check.{nbytes}")
    if not bool((y == hvd.size()).all()) or not bool((x == 1).all()):
        raise AssertionError(f"out-of-place allreduce of ones gave {y[:4]} (input {x[:4]})")
    hvd.allreduce_(x, op=hvd.Sum, name=f"oop.check_.{nbytes}")
    if not bool((x == hvd.size()).all()):
        raise AssertionError(f"in-place allreduce of ones gave {x[:4]}")
    x.zero_()  # zeros from here on: the values stay finite however many calls run
    samples = {f: [] for f in FORMS}
    clock = time.perf_counter
    y = z = None
    for i in range(warmup + iters):
        # Rotate the order so that neither form always runs right after the other.
        for form in FORMS[i % len(FORMS):] + FORMS[:i % len(FORMS)]:
            t0 = clock()
            if form == "in_place":
                hvd.allreduce_(x, op=hvd.Sum, name=f"oop.in.{nbytes}")
            elif form == "out_of_place":
                y = hvd.allreduce(x, op=hvd.Sum, name=f"oop.out.{nbytes}")
            elif form == "torch_output":
                # Into a fresh torch tensor (how allreduce worked before the core's output
                # pool): shows what first-touch page faults on the output cost.
                z = torch.empty_like(x)
                ops.submit("allreduce", f"oop.torch.{nbytes}", x, z, op=hvd.Sum).wait()
            else:
                c = x.clone()
                del c
            dt = clock() - t0
            if i >= warmup:
                samples[form].append(dt)
    del y, z
    return samples


def worker(args):
    import torch

    import spark_dl.torch as hvd

    torch.set_num_threads(1)
    from spark_dl.common import ops
    from spark_dl.common.basics import transport

    hvd.init()

    info = {"transport": transport()}
    times = {}
    for nbytes in sizes(args):
        iters = max(args.min_iters, min(args.iters, BYTES_PER_SIZE // nbytes))
        times[str(nbytes)] = time_size(hvd, torch, ops, nbytes, iters, args.warmup)
    if hvd.rank() == 0:
        H.print_result(dict(info, times=times))
    hvd.shutdown()


def driver(args):
    wargs = ["--min-size", args.min_size, "--max-size", args.max_size, "--step", args.step,
             "--iters", args.iters, "--min-iters", args.min_iters, "--warmup", args.warmup]
    allowed = ("spark_dl", "spark_dl_gloo", "spark_dl_mpi")
    peers, results = H.launch(args, __file__, wargs, "out-of-place allreduce benchmark", allowed)
    H.print_header(f"allreduce, {args.np} ranks, out of place against in place, float32 sum "
                   f"({args.rounds} round(s))", args, results)
    target_key = str(64 << 20)
    for p in peers:
        keys = list(results[p][0]["times"])
        print(f"### {H.PEER_LABELS[p]}\n")
        print("Median per call over all calls of all rounds [10th-90th percentile]:\n")
        head = ["size"] + [LABELS[f] for f in FORMS] + [
            "out-of-place / in-place", "per-round ratios"]
        rows = []
        for k in keys:
            pooled = {f: H.pooled(r["times"][k][f] for r in results[p]) for f in FORMS}
            cells = [f"{H.fmt_time(H.median(pooled[f]))} "
                     f"[{H.fmt_time(H.percentile(pooled[f], 10))}-"
                     f"{H.fmt_time(H.percentile(pooled[f], 90))}]" for f in FORMS]
            per_round = [H.median(r["times"][k]["out_of_place"]) / H.median(r["times"][k]["in_place"])
                         for r in results[p]]
            rows.append([H.fmt_size(int(k))] + cells + [
                H.fmt_ratio(H.median(pooled["out_of_place"]), H.median(pooled["in_place"])),
                ", ".join(f"{x:.2f}" for x in per_round)])
        print(H.markdown_table(head, rows) + "\n")
        if target_key in keys:
            pooled = {f: H.pooled(r["times"][target_key][f] for r in results[p]) for f in FORMS}
            ratio = H.median(pooled["out_of_place"]) / H.median(pooled["in_place"])
            print(f"target 64 MiB out-of-place within 1.5x of in-place ({H.PEER_LABELS[p]}): "
                  f"{ratio:.2f}x -> {'met' if ratio <= 1.5 else 'NOT met'}\n")


def add_args(parser):
    parser.add_argument("--min-size", type=H.parse_size, default=1 << 20,
                        help="smallest tensor (default 1M)")
    parser.add_argument("--max-size", type=H.parse_size, default=64 << 20,
                        help="largest tensor (default 64M)")
    parser.add_argument("--step", type=int, default=4, help="size multiplier (default 4)")
    parser.add_argument("--iters", type=int, default=30,
                        help="timed calls of each form per size and job, at most (default 30; "
                             "large sizes run fewer: about 1 GiB per size)")
    parser.add_argument("--min-iters", type=int, default=10,
                        help="timed calls of each form per size and job, at least (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per size (default 2)")


def quick(args):
    args.min_size = args.max_size


if __name__ == "__main__":
    H.bench_main(__doc__, DEFAULT_PEERS, 3, add_args, quick, worker, driver)
