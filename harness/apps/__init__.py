"""The applications: the convergence comparison (``converge``, judged against ``reference`` and the goldens),
the main job (``main_job``) and the nightly dashboard (``nightly``). They run jobs (``harness.jobs``) of the
training runtime (``harness.train``) and hand results to the reports (``harness.report``).
"""
