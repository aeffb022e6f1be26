"""The KServe v2 front end: REST (``rest.py``) and gRPC (``rpc.py``) over one
:class:`~paella.kserve.service.InferenceService`, a local client of the daemon;
``paella kserve`` (``command.py``) runs it. Tensors and their checks: ``tensors.py``.
Needs the ``kserve`` extra (grpcio, protobuf)."""
