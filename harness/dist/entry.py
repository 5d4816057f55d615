"""torchrun entry point: ``torchrun --nproc-per-node N -m harness.dist.entry JOB --out FILE [--cfg JSON]``.

Jobs: ``checks`` (``harness.dist.checks.all_checks``: groups, reroute, CP attention vs full attention),
``bench-attention`` (``harness.bench.attention.measure``), ``bench-step`` (``harness.bench.step.measure``),
``converge`` (``harness.dist.train.train``) and ``replay`` (``harness.dist.replay.replay_check``).
Every rank runs the job; rank 0 gathers the ranks' results and writes them as JSON (atomically).
NCCL on CUDA machines, gloo otherwise; ``--cfg '{"device": "cpu"}'`` keeps a job on gloo there too.
``launch(job, nproc, out, cfg)`` runs it from Python (used by the GPU suite and the benchmark CLI).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

JOBS = {"checks": "harness.dist.checks:all_checks", "bench-attention": "harness.bench.attention:measure",
        "bench-step": "harness.bench.step:measure", "converge": "harness.dist.train:train",
        "replay": "harness.dist.replay:replay_check"}


def _job(name: str):
    module, fn = JOBS[name].split(":")
    return getattr(__import__(module, fromlist=[fn]), fn)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.dist.entry")
    p.add_argument("job", choices=sorted(JOBS))
    p.add_argument("--out", required=True)
    p.add_argument("--cfg", default="{}", help="JSON config for the job")
    a = p.parse_args(argv)
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    job_cfg = json.loads(a.cfg)
    # a job config may pin the device ("cpu": gloo even where GPUs are present)
    cuda = torch.cuda.is_available() and job_cfg.get("device", "cuda") == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=dt.timedelta(seconds=600))
    cfg = {**job_cfg, "device": "cuda" if cuda else "cpu"}
    result = _job(a.job)(rank, world, cfg)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        from harness.io import atomic_write_json

        atomic_write_json(a.out, {"job": a.job, "world": world, "cfg": cfg, "ranks": gathered})
    dist.barrier()
    dist.destroy_process_group()
    return 0


def launch(job: str, nproc: int, out: Path, cfg: dict | None = None, timeout_s: float = 1800,
           stream=None) -> dict:
    """Run ``job`` under torchrun on ``nproc`` local processes and return rank 0's JSON. ``stream``:
    called with each stdout line as it arrives (progress); otherwise output is captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
           "--rdzv-endpoint=localhost:0", "-m", "harness.dist.entry", job, "--out", str(out),
           "--cfg", json.dumps(cfg or {})]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
    tail: list[str] = []
    try:
        for line in proc.stdout:
            tail = (tail + [line])[-200:]
            if stream:
                stream(line.rstrip("\n"))
        proc.wait(timeout=timeout_s)
    except BaseException:
        proc.kill()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun {job} on {nproc} processes failed (exit {proc.returncode}); last output:\n"
                           + "".join(tail[-80:]))
    return json.loads(Path(out).read_text())


if __name__ == "__main__":
    raise SystemExit(main())
