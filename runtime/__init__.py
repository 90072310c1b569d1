"""quantspec's runtime: inductor's cache set under ``$QUANTSPEC_HOME`` before any module here imports it."""
from runtime.hardware import use_inductor_cache

use_inductor_cache()
