"""Two checkouts' per-call and training-step figures on one GPU machine, alternating.

    python benchmarks/gpu_pair.py --base .base [--rounds 3] [--jobs 14] [--json FILE]

A host-path change shows in ``bench_gpu.py``'s per-call and training-step rows, and those
move between machines and within minutes on one (runs 9-12 in docs/benchmarks.md#gpu): a
before/after claim needs both trees measured alike, in turn, on the same machine. This
script precompiles the other tree's CUDA kernels into Numba's disk cache (each tree's
kernels are cached under its own source paths), then runs ``bench_gpu.py --calls --rounds
1`` with ``TREE`` set to this tree and to the other, alternating for ``--rounds`` rounds
(each run is a numbafuse process and a PyTorch process: PyTorch's own figures show how much
the machine moved), and prints each row's figures per round and the ratio of the bests.
``benchmarks/gpu_check.sh`` runs it as its ``pair`` section when ``GPU_CHECK_BASE`` names a
checkout carried in the tree (e.g. ``git archive <rev> | tar -x -C .base``).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_bench(tree, timeout):
    """One ``bench_gpu.py --calls --rounds 1`` with ``tree``'s numbafuse: its json."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        done = subprocess.run([sys.executable, os.path.join(HERE, "bench_gpu.py"), "--calls",
                               "--rounds", "1", "--worker-timeout", str(timeout), "--json",
                               path], env=dict(os.environ, TREE=tree), check=False,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            print(f"gpu_pair: bench_gpu.py with TREE={tree} exited {done.returncode}: "
                  f"{done.stderr[-800:]}", flush=True)
        with open(path) as f:
            text = f.read()
        return json.loads(text) if text.strip() else {}
    finally:
        os.unlink(path)


def rows(result):
    """{row name: seconds} of one run: numbafuse's calls and steps, PyTorch's as 'PyTorch:'."""
    out = {}
    for who, prefix in (("numbafuse", ""), ("torch", "PyTorch: ")):
        for table in ("calls", "steps"):
            for key, value in result.get(who, {}).get(table, {}).items():
                out[prefix + key] = value
    return out


def table(names, runs):
    """Markdown: each row's figures per round for both trees, and this tree's best over the
    other's."""
    head, base = runs
    lines = ["| row (us) | this tree, each round | other tree, each round | "
             "this / other (bests) |", "|---|---|---|---:|"]
    keys = []
    for run in head + base:
        keys += [k for k in rows(run) if k not in keys]
    for key in keys:
        a = [rows(r).get(key) for r in head]
        b = [rows(r).get(key) for r in base]

        def fmt(vals):
            return ", ".join(f"{v * 1e6:.1f}" if v is not None else "-" for v in vals)
        ok_a, ok_b = [v for v in a if v is not None], [v for v in b if v is not None]
        ratio = f"{min(ok_a) / min(ok_b):.2f}x" if ok_a and ok_b else ""
        lines.append(f"| {key} | {fmt(a)} | {fmt(b)} | {ratio} |")
    return [f"this tree: {names[0]}; other tree: {names[1]}", ""] + lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the other checkout (its root)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    p.add_argument("--timeout", type=float, default=120, help="per worker process, seconds")
    p.add_argument("--no-precompile", action="store_true")
    p.add_argument("--json", metavar="FILE", help="every run's results")
    args = p.parse_args(argv)
    base = os.path.abspath(args.base)
    if not args.no_precompile:
        done = subprocess.run([sys.executable, "-m", "numbafuse.precompile", "--cuda", "-j",
                               str(args.jobs)], cwd=base, check=False, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                                  [base] + [q for q in os.environ.get("PYTHONPATH", "")
                                            .split(os.pathsep) if q and
                                            os.path.abspath(q) != ROOT])))
        print(f"gpu_pair: the other tree's precompile: {done.stdout.strip().splitlines()[-1:]}",
              flush=True)
    runs = ([], [])
    for r in range(args.rounds):
        for i, tree in enumerate((ROOT, base)):
            runs[i].append(run_bench(tree, args.timeout))
            print(f"gpu_pair: round {r + 1}, {'this' if i == 0 else 'other'} tree done",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(this=runs[0], other=runs[1]), f, indent=1)
    print("\n".join(table((ROOT, base), runs)))


if __name__ == "__main__":
    main()
