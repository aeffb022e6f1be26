"""WindTunnel tests: one torch thread (the machine is shared; two threads under load
were 3x slower here), and the first optimizer's one-off import of torch._dynamo
(a few seconds) is paid once per session."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")  # a safety net: `make install` installs the windtunnel extra
torch.set_num_threads(1)
