"""The one exception of the WindTunnel component.

Every refusal (an estimator the translator does not know, an option of a known one that
the network cannot reproduce, a missing optional dependency) raises
:class:`WindTunnelError` with a message that names the estimator or option and says what
to do instead; ``paella`` front ends print it as ``paella: error: ...``.
"""
from __future__ import annotations


class WindTunnelError(Exception):
    """A pipeline, estimator or option that WindTunnel cannot translate, or a missing extra."""


#: What to install when torch (or a booster library) is missing.
EXTRA_HINT = "install the optional extra: pip install 'paella-py[windtunnel]'"
