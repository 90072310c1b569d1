"""``python -m quantspec.cli``."""
from quantspec.cli import main

main()
