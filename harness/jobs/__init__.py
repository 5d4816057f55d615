"""Bounded multi-process jobs: torchrun jobs (``entry`` on every rank, ``launcher`` + ``watchdog`` in the
caller, ``launch`` for spawned test worlds) and the launcher's self-test (``selftest``). A job is named by a
registered entry point (``entry.JOBS``): the runtime registers its own, callers above it register theirs,
so nothing here names a benchmark or an app.
"""
