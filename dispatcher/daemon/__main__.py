"""``python -m paella.dispatcher.daemon [serve options]``: the daemon alone."""
import sys

from .command import main

sys.exit(main())
