"""Serving: engines behind one Backend interface (serving.backends), load generation, workloads, serving metrics
and the benchmark API; built on evals (Config, the one builder, run records)."""
