"""Several machines, played by two torchrun agents on this one (``--nnodes 2``, node 0 serving the rendezvous on
127.0.0.1): the same results as one agent of the same world, bit for bit in fp32; every bad input one line,
within its bound; a node that dies or stops is named by the other node."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist_cpu, pytest.mark.usefixtures("shared_zygote")]

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--world", "4", "--steps", "2", "--batch-size", "8", "--lengths", "lognormal:mean=96,sigma=0.8,min=16,max=400",
         "--max-seqlen-per-rank", "128"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(rank: int, port: int, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness", "converge", *SMALL, "--nnodes", "2", "--node-rank",
                             str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}", "--out", str(out), *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _results(out: Path) -> dict:
    (found,) = out.glob("converge-*/results.json")
    return json.loads(found.read_text())


def test_two_agents_give_what_one_agent_gives_bit_for_bit(tmp_path):
    """dcp (CP blocks of 1, 2 and 4 ranks, across the two nodes, and the gradient reduction over all four) on 2 x 2
    ranks equals the same run on 1 x 4, and so do the report's checks (the reference lines too). Without bshd and
    thd (the same launcher, and groups dcp's blocks already span): the killed / stopped node tests and the two-node
    step benchmark (slow suite) run whole jobs."""
    port = _free_port()
    lean = ("--layouts", "dcp")
    nodes = [_node(1, port, tmp_path / "n1", *lean), _node(0, port, tmp_path / "n0", *lean)]
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert "node 1 of 2: its 2 ranks finished; node 0 writes the report" in outs[0][0]
    assert not list((tmp_path / "n1").glob("converge-*")), "only node 0 writes a report"
    one = subprocess.run([sys.executable, "-m", "harness", "converge", *SMALL, *lean, "--out", str(tmp_path / "one")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    a, b = _results(tmp_path / "n0"), _results(tmp_path / "one")
    assert a["verdict"] == b["verdict"] == "PASS"
    for layout in b["layouts"]:
        assert [(r["loss"], r["grad_norm"]) for r in a["layouts"][layout]] == \
            [(r["loss"], r["grad_norm"]) for r in b["layouts"][layout]], layout
    assert set(b["layouts"]) == {"dcp"} and a["checks"]
    assert [c["value"] for c in a["checks"]] == [c["value"] for c in b["checks"]]  # the reference lines too


def _beat_pid(path: Path) -> int | None:
    try:
        return json.loads(_text(path)).get("pid")
    except ValueError:
        return None


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # rewritten atomically under us
        return ""


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "converge", *SMALL, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_bad_multinode_options_are_one_line_before_anything_starts(tmp_path, capsys):
    """Refused by the CLI itself (in this process: nothing is started, so no interpreter is needed per case)."""
    from harness import cli

    port = _free_port()
    cases = [(["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"],
              "--node-rank 2 is out of range for --nnodes 2"),
             (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
             (["--nnodes", "2", "--rdzv-endpoint", "node0"], "--rdzv-endpoint 'node0' is not HOST:PORT"),
             (["--nnodes", "3", "--rdzv-endpoint", f"127.0.0.1:{port}"], "--world 4 cannot be split evenly over --nnodes 3"),
             (["--numa-binding", "node", "--device", "cpu"], "--numa-binding node binds each rank to the CPUs near its GPU"),
             (["--numa-binding", "nodes", "--device", "cuda"], "--numa-binding 'nodes' is not one of torchrun's modes")]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cases.append((["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{busy.getsockname()[1]}"], "is in use"))
        for args, expect in cases:
            code = cli.main(["converge", *SMALL, *args, "--out", str(tmp_path)])
            lines = capsys.readouterr().err.strip().splitlines()
            assert code == 2 and len(lines) == 1 and expect in lines[0], (args, lines)
    assert not list(tmp_path.iterdir())  # nothing written


def test_numa_binding_reaches_torchrun_on_one_node_and_on_several():
    """``--numa-binding`` is torchrun's own option, passed to every node's torchrun as given; a torch whose torchrun
    lacks it (< 2.9) is refused by name before anything starts. (Binding itself needs GPUs: a CPU job is refused.)"""
    from harness.jobs.nodes import Nodes, NodesError, _check_numa_binding

    assert Nodes(numa_binding="exclusive").torchrun_args() == [
        "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--numa-binding=exclusive"]
    two = Nodes(2, 1, "127.0.0.1:29500", numa_binding="node")
    assert two.torchrun_args()[-1] == "--numa-binding=node" and "--node-rank=1" in two.torchrun_args()
    assert not any("numa" in x for x in Nodes().torchrun_args())
    Nodes(numa_binding="core-complex").check()  # this torch has it
    with pytest.raises(NodesError, match=r"needs torchrun's --numa-binding \(torch >= 2.9\); this torch is 2.8.1"):
        _check_numa_binding("node", "2.8.1")
    _check_numa_binding("socket", "2.11.0+cu130")


def test_a_rendezvous_that_never_completes_ends_within_its_bound(tmp_path):
    t = time.monotonic()
    r = _cli("--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-timeout", "5",
             "--out", str(tmp_path), timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 3 and len(lines) == 1 and "the 2 nodes did not meet at 127.0.0.1:" in lines[0], r.stderr
    assert time.monotonic() - t < 60


def test_nodes_that_run_different_numbers_of_processes_are_named(tmp_path):
    port = _free_port()
    other = subprocess.Popen([sys.executable, "-m", "harness", "converge", *SMALL[2:], "--world", "8", "--nnodes", "2",
                              "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--out", str(tmp_path / "n1")],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    r = _cli("--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}", "--out",
             str(tmp_path / "n0"), timeout=120)
    _, err = other.communicate(timeout=120)
    for code, text in ((r.returncode, r.stderr), (other.returncode, err)):
        assert code == 3 and "runs 4 processes, node 0" in text and "runs 2" in text, text


@pytest.mark.parametrize("how", [
    # a dead node also in the default suite under the user's torchrun (test_under_the_users_torchrun_a_node_that_dies...)
    pytest.param("killed", marks=pytest.mark.slow), "stopped"])
def test_a_node_that_dies_or_stops_is_named_by_the_other(how, tmp_path):
    port = _free_port()
    long = ["--steps", "60", "--stall-timeout", "10"]
    n1 = _node(1, port, tmp_path / "n1", *long)
    n0 = _node(0, port, tmp_path / "n0", *long)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until node 1's ranks are training
        beats = list((tmp_path / "n1").rglob("rank*.json"))
        if any('"step"' in _text(b) for b in beats):
            break
        time.sleep(0.5)
    # the processes that run node 1's ranks, as their heartbeats name them (forked by the zygote or fresh)
    pids = sorted({_beat_pid(b) for b in (tmp_path / "n1").rglob("rank*.json")} - {None})
    assert pids, "node 1's ranks did not start"
    for pid in pids:
        subprocess.run(["kill", "-9" if how == "killed" else "-STOP", str(pid)])
    try:
        _, err = n0.communicate(timeout=90)
    finally:
        for pid in pids:
            subprocess.run(["kill", "-9", str(pid)], capture_output=True)
        if n1.poll() is None:
            n1.send_signal(signal.SIGKILL)
        n1.communicate(timeout=30)
    lines = err.strip().splitlines()
    assert n0.returncode == 3 and len(lines) == 1, err
    assert "(node 0 of 2)" in lines[0] and "on node 1 " in lines[0], lines[0]


TWO = ["--world", "2", "--steps", "2", "--batch-size", "8", "--lengths", "lognormal:mean=200,sigma=0.8,min=16,max=500",
       "--max-seqlen-per-rank", "256", "--layouts", "dcp"]
"""The in-place launches' job: dcp (bshd and thd add no launch path of their own)."""


def _losses(out: Path) -> tuple[list, list]:
    """Every layout's per-step loss and gradient norm (compared bit for bit), and the check values derived from
    them and the probes (compared to 1e-12 relative: the probes reach rank 0 as JSON or as files, and numpy's
    norms of the two may round differently in the last bit)."""
    r = _results(out)
    return [(x["loss"], x["grad_norm"]) for lay in sorted(r["layouts"]) for x in r["layouts"][lay]], \
        [c["value"] for c in r["checks"]]


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] == pytest.approx(b[1], rel=1e-12)


@pytest.fixture(scope="module")
def own_launcher(tmp_path_factory):
    out = tmp_path_factory.mktemp("own")
    r = subprocess.run([sys.executable, "-m", "harness", "converge", *TWO, "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return _losses(out)


def test_torchrun_of_the_users_starting_the_harness_gives_the_same_report(own_launcher, tmp_path):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", "localhost:0", "-m", "harness", "converge", *TWO, "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("verdict: PASS") == 1  # rank 0 speaks; one report
    assert len(list(tmp_path.glob("converge-*"))) == 1 and _same(_losses(tmp_path), own_launcher)


def _srun_env(rank: int, port: int, **extra) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, "SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": str(rank),
            "SLURM_STEP_TASKS_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **extra}


def test_the_environment_srun_sets_is_read_as_each_tasks_rank(monkeypatch):
    """srun's variables give (rank, world, local rank, local world), torchrun's win when both are set, and one task
    is not a launched world. The ranks then run the in-place path the user's torchrun test runs end to end (the
    end-to-end srun run is in the slow suite)."""
    from harness.jobs.entry import launched_world

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in _srun_env(3, 29500, SLURM_STEP_NUM_TASKS="8", SLURM_LOCALID="1",
                          SLURM_STEP_TASKS_PER_NODE="2(x4)").items():
        monkeypatch.setenv(k, v)
    assert launched_world() == (3, 8, 1, 2)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    assert launched_world() is None
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert launched_world() == (5, 6, 5, 6)


@pytest.mark.slow  # the environment's mapping is in the default suite (above), the in-place ranks under torchrun
def test_srun_tasks_starting_the_harness_give_the_same_report(own_launcher, tmp_path):
    """What ``srun --ntasks 2 dcp-harness converge ...`` gives each task (the environment srun sets)."""
    port = _free_port()
    tasks = [subprocess.Popen([sys.executable, "-m", "harness", "converge", *TWO, "--out", str(tmp_path)], cwd=ROOT,
                              env=_srun_env(r, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    outs = [t.communicate(timeout=300) for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], [o[1][-1500:] for o in outs]
    assert "verdict: PASS" in outs[0][0] and outs[1][0].strip() == ""
    assert _same(_losses(tmp_path), own_launcher)


def test_a_launched_world_the_command_does_not_fit_is_one_line_per_rank(tmp_path):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", "localhost:0", "-m", "harness", "converge", *SMALL, "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    errors = [line for line in r.stderr.splitlines() if line.startswith("dcp-harness: error:")]
    # every rank that reports says it in one line; torchrun stops the others when the first exits (SIGTERM), so a
    # slower rank may be stopped before it reports: one or two lines, never a harness traceback
    assert r.returncode != 0 and 1 <= len(errors) <= 2 and all("give --world 2" in e for e in errors), r.stderr[-2000:]
    assert 'File "' + str(ROOT / "harness") not in r.stderr, r.stderr[-2000:]
    env = _srun_env(0, 1)
    del env["MASTER_ADDR"], env["MASTER_PORT"]
    r = subprocess.run([sys.executable, "-m", "harness", "converge", *TWO, "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "MASTER_ADDR and MASTER_PORT is not set" in lines[0], r.stderr


def test_the_slurm_example_is_valid_bash_naming_real_options():
    script = ROOT / "docs" / "slurm.sbatch"
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    text = script.read_text()
    assert "MASTER_ADDR" in text and "MASTER_PORT" in text and "srun" in text
    from harness.cli import parser

    for line in ("converge --device cuda --world 8 --steps 50 --out x",
                 "converge --device cuda --world 8 --nnodes 2 --node-rank 1 --rdzv-endpoint h:29500"):
        parser().parse_args(line.split())  # the options the script uses exist


@pytest.mark.slow  # the two agents' launch and report path is the default suite's converge on two nodes (above)
def test_the_step_benchmark_on_two_nodes_writes_one_report(tmp_path):
    port = _free_port()
    cmd = [sys.executable, "-m", "harness", "bench", "step", "--cpu", "--nproc", "1", "--nnodes", "2",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--arms", "thd:dp-balanced,dcp:balanced", "--warmup", "1",
           "--iters", "2", "--profile-iters", "1"]
    n1 = subprocess.Popen([*cmd, "--node-rank", "1", "--out", str(tmp_path / "n1" / "b.json")], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    n0 = subprocess.run([*cmd, "--node-rank", "0", "--out", str(tmp_path / "n0" / "b.json")], cwd=ROOT,
                        capture_output=True, text=True, timeout=300)
    out1, err1 = n1.communicate(timeout=120)
    assert n0.returncode == 0 and n1.returncode == 0, (n0.stderr[-1500:], err1[-1500:])
    assert "on node 0 of 2 (2 ranks)" in n0.stdout and "node 1 of 2: its ranks finished" in out1
    report = json.loads((tmp_path / "n0" / "b.json").read_text())
    assert report["config"]["gpus"] == 2 and report["config"]["nodes"] == 2 and report["config"]["numa_binding"] is None
    assert not (tmp_path / "n1" / "b.json").exists()


def test_under_the_users_torchrun_a_node_that_dies_is_named_by_the_other(tmp_path):
    port = _free_port()
    args = ["-m", "harness", "converge", *TWO, "--steps", "60", "--stall-timeout", "10"]

    def agent(rank: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                                 str(rank), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
                                 str(port), *args, "--out", str(tmp_path / f"n{rank}")], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    n1, n0 = agent(1), agent(0)
    deadline = time.monotonic() + 120
    pids: list[int] = []
    while not pids and time.monotonic() < deadline:  # node 1's rank, once node 0's rank 0 trains
        time.sleep(1)
        if list((tmp_path / "n0").rglob("metrics.jsonl")):
            found = subprocess.run(["pgrep", "-f", f"harness converge.*{tmp_path / 'n1'}"], capture_output=True,
                                   text=True)
            pids = [int(p) for p in found.stdout.split() if int(p) != n1.pid]
    for pid in pids:
        subprocess.run(["kill", "-9", str(pid)])
    try:
        _, err = n0.communicate(timeout=90)
    finally:
        for p in (n0, n1):
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)
    assert pids, "node 1's rank did not start"
    lines = [line for line in err.splitlines() if line.startswith("dcp-harness: error:")]
    assert len(lines) == 1 and "rank 1 on node 1 went away" in lines[0], err[-2000:]


@pytest.mark.slow  # the in-place ranks under torchrun: converge's run in the default suite (above)
def test_verify_under_the_users_torchrun_judges_once_with_reports_carried_in_the_results(tmp_path):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", "localhost:0", "-m", "harness", "verify", "harness", "--world", "2",
                        "--steps", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.count("verdict: PASS") == 1, (r.stdout[-1500:], r.stderr[-1500:])
    assert json.loads((tmp_path / "verify.json").read_text())["verdict"] == "PASS"
    assert not (tmp_path / "verify-work").exists()
