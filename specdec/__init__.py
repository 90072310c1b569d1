"""quantspec specdec package."""
