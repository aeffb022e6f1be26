"""Imports every built-in policy so that each registers itself."""
from . import fifo, ms_jbj, ms_kbk, paella, rr, sjf  # noqa: F401
