"""The tables and ratios benchmarks/gpu_train.py prints from its parts' results (the
results' shapes are gpu_train.py's), and the peers and checks they name."""

FRAMEWORKS = ("torch", "lightning")
STEP_PEERS = ("spark_dl", "ddp", "local")
SHARED_PEERS = ("spark_dl", "spark_dl_batch", "spark_dl_group", "gloo_each", "gloo_flat")
LOSS_RTOL = 0.02            # (a): first-epoch loss, CUDA against CPU


def _cell(p, scale=1e3, digits=2):
    if p is None:
        return "-"
    return (f"{p['median'] * scale:.{digits}f} [{p['p10'] * scale:.{digits}f}, "
            f"{p['p90'] * scale:.{digits}f}]")


def report_estimator(res, failures):
    print("\n## (a) estimator worker loop (spark_dl.spark.common.worker.train, no Spark)\n")
    print("| framework | device | ranks | step ms (median [p10, p90]) | rows/s per epoch "
          "(median) | train() to first step s | first-epoch loss |")
    print("|---|---|---|---|---|---|---|")
    for fw in FRAMEWORKS:
        r = res.get(fw)
        if r is None:
            continue
        for d, x in r["devices"].items():
            rows = x["rows_per_s"]["median"] if x["rows_per_s"] else float("nan")
            print(f"| {fw} | {x['device']} | {r['size']} | {_cell(x['step_s'])} | {rows:.0f} | "
                  f"{x['first_step_s']['median']:.2f} | "
                  f"{', '.join(f'{v:.4f}' for v in x['first_epoch_loss'])} |")
    for fw in FRAMEWORKS:
        r = res.get(fw)
        if r is None or not {"cuda", "cpu"} <= set(r["devices"]):
            continue
        g, c = r["devices"]["cuda"], r["devices"]["cpu"]
        print(f"\n{fw}: cuda step {c['step_s']['median'] / g['step_s']['median']:.2f}x faster "
              "than cpu (time ratio cpu/cuda)")
        lg, lc = g["first_epoch_loss"][0], c["first_epoch_loss"][0]
        agree = abs(lg - lc) <= LOSS_RTOL * max(1.0, abs(lc))
        print(f"{fw}: first-epoch loss cuda {lg:.4f}, cpu {lc:.4f} -> "
              f"{'agree' if agree else 'DIFFER'} (within {LOSS_RTOL:.0%})")
        if not agree:
            failures.append(f"(a) {fw}: the first-epoch loss differs between cuda and cpu")


def report_step(r):
    print(f"\n## (b) one training step, SmallCNN ({r['parameters'] / 1e6:.2f} M parameters), "
          f"{r['size']} rank(s) on {r['device']}, torch.distributed {r['backend']}\n")
    print("| peer | ms per step (median [p10, p90]) |")
    print("|---|---|")
    for p in STEP_PEERS:
        print(f"| {p} | {_cell(r['step_s'][p])} |")
    s, d, l_ = (r["step_s"][p]["median"] for p in STEP_PEERS)
    print(f"\nspark_dl {d / s:.2f}x ddp (time ratio ddp/spark_dl; >= 1.0: spark_dl at least as "
          f"fast); spark_dl {l_ / s:.2f}x local (the no-communication ceiling); one-step "
          f"parameter difference spark_dl vs ddp: {r['one_step_max_diff']:.2e}")
    print("spark_dl's responses by backend in the timed steps: " + (", ".join(
        f"{k} {v}" for k, v in sorted(r["spark_dl_backends"].items())) or "none"))


def report_shared(r):
    what = ("two ranks on one GPU (host staging)" if r["device"].startswith("cuda") else
            "CPU tensors: a run of the code, not the staging path")
    print(f"\n## (c) allreduce, {r['size']} ranks on {r['device']}: {what}; spark_dl against "
          f"torch.distributed gloo, ms (median [p10, p90]); small = {r['small_count']} x 16 KiB, "
          f"large = {r['large_bytes'] / 2**20:.0f} MiB\n")
    peers = [p for p in SHARED_PEERS if p not in r["not_measured"]]
    print("| workload | " + " | ".join(peers) + " |")
    print("|---|" + "---|" * len(peers))
    for w, rows in r["allreduce_s"].items():
        print(f"| {w} | " + " | ".join(_cell(rows[p], digits=3) for p in peers) + " |")
    for peer, why in r["not_measured"].items():
        print(f"\nNOT MEASURED {peer}: {why}")
    for w, rows in r["allreduce_s"].items():
        ours = {p: v["median"] for p, v in rows.items() if p.startswith("spark_dl")}
        theirs = {p: v["median"] for p, v in rows.items() if p.startswith("gloo")}
        if ours and theirs:
            a, b = min(ours, key=ours.get), min(theirs, key=theirs.get)
            print(f"{w}: {a} {theirs[b] / ours[a]:.2f}x {b} (time ratio {b}/{a})")
    if r["staging"]:
        staged = sum(v["staged"] for v in r["staging"].values())
        print(f"staged allreduce responses in the checks: {staged}"
              + ("" if r["device"].startswith("cuda") else " (CPU tensors: none expected)"))
