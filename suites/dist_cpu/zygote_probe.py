"""A module the zygote tests run as a rank (``python -m suites.dist_cpu.zygote_probe MODE``): it prints what it was
given as one JSON line, then exits with code 7 (``exit``), sleeps until signalled (``sleep``: SIGTERM makes it say
so and exit with code 5; ``idle``: sleeps with every signal's default action), raises (``raise``) or is interrupted (``interrupt``: an unhandled KeyboardInterrupt)."""

import json
import os
import signal
import sys
import time


def stop(signum, frame):
    print(f"probe got {signal.Signals(signum).name}", flush=True)
    sys.exit(5)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "sleep":
        signal.signal(signal.SIGTERM, stop)
    with open("/proc/self/comm") as f:
        comm = f.read().strip()
    print(json.dumps({"argv": sys.argv[1:], "probe": os.environ.get("PROBE"), "cwd": os.getcwd(), "comm": comm,
                      "pid": os.getpid(), "torch": "torch" in sys.modules}), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if mode == "raise":
        raise RuntimeError("probe failure")
    if mode == "interrupt":
        raise KeyboardInterrupt
    if mode in ("sleep", "idle"):
        time.sleep(120)
    sys.exit(7)
