"""Beyond one GPU: one daemon per GPU, and a router in front of them (issue 41).

``paella.cluster`` sits after the front end in the data flow: it may use the client
library and the ``paella`` core, never the dispatcher (a replica's daemon is reached
through its client). What is here has no distributed engine in it:

* :mod:`~paella.cluster.router`: which replica serves a request, by one of four rules
  (``random``, ``round-robin``, ``p2c-queue``, ``p2c-work``), model-aware;
* :mod:`~paella.cluster.placement`: which models each replica serves.

The Ray Serve deployment (``paella cluster``, the ``ray_*`` modules, extra ``[ray]``)
runs these on Ray's request-router interface: :mod:`~paella.cluster.ray_replica` (a
replica per GPU and its daemon), :mod:`~paella.cluster.ray_router`,
:mod:`~paella.cluster.ray_ingress` (the KServe front end: REST, and gRPC), :mod:`~paella.cluster.ray_app`.
``paella experiment cluster`` runs the same routers over N simulated GPUs in virtual time
(docs/cluster.md). Only the ``ray_*`` modules import Ray.
"""
