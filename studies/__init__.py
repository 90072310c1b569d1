"""quantspec studies package."""
