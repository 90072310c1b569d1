"""quantspec evals package."""
