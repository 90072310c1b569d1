"""quantspec quant package."""
