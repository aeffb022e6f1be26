"""The Ray Serve replica: one GPU, its own ``paella serve``, and the rings to it.

A replica (:class:`PaellaReplica`) is placed by Ray on a node with a free GPU
(``num_gpus=1``) or a free simulated one (the custom resource ``paella_sim_gpu``). Its
constructor:

1. learns its rank among the deployment's replicas and serves the models the placement
   rule gives that rank (``ClusterConfig.placed``); a replica that replaces a dead one
   takes its rank, so it serves the same models;
2. starts that GPU's daemon (:mod:`.ray_daemon`) with ``CUDA_VISIBLE_DEVICES`` set to
   the GPU Ray gave it (cuda), on a socket of its own under ``run_dir``; if the daemon
   cannot start, the constructor raises with the daemon's own error, which Ray shows
   in the replica's log and the deployment's status;
3. talks to it through :class:`paella.kserve.service.InferenceService`, the front end's
   client of the daemon (the shared-memory rings, many requests on one connection).

``check_health`` fails once the daemon is gone: Ray then replaces the replica, and the
new one starts a new daemon. ``record_routing_stats`` is Ray's hook for what the
request router (:mod:`.ray_router`) reads: the daemon's ``queued_work_us`` from
STATUS, the models served, whether the daemon lives.

A request whose daemon died under it, or could not be reached, raises
:class:`ReplicaFailure` with ``daemon_lost``: the ingress retries it once elsewhere
(:mod:`.ray_ingress`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any, Mapping

import numpy as np

from paella.client.aio import AsyncClient
from paella.kserve.service import InferenceService, ModelSpec
from paella.kserve.tensors import InferError

from . import ray_daemon
from .ray_config import BUILTIN_MODELS, ClusterConfig

log = logging.getLogger("paella.cluster")


class ReplicaFailure(Exception):
    """A request a replica could not answer: ``status`` as the front end's (HTTP),
    ``replica`` the replica's id, ``daemon_lost``: its daemon died meanwhile, so the
    request was not answered and may run elsewhere."""

    def __init__(self, status: int, message: str, replica: str = "",
                 daemon_lost: bool = False):
        super().__init__(status, message, replica, daemon_lost)
        self.status, self.message = status, message
        self.replica, self.daemon_lost = replica, daemon_lost

    def __str__(self) -> str:
        return self.message


class PaellaReplica:
    """One GPU's daemon behind Ray Serve (see the module docstring). Deployed by
    :func:`paella.cluster.ray_app.build_app`, which sets its resources."""

    def __init__(self, config: ClusterConfig, n_replicas: int):
        from ray import serve
        ctx = serve.get_replica_context()
        self.id = ctx.replica_id.unique_id
        self.config, self.n_replicas = config, n_replicas
        self.served = 0
        self._stats: AsyncClient | None = None        # (STATUS, for the router)
        os.makedirs(config.run_dir, exist_ok=True)
        self._start(ctx.rank.rank if ctx.rank is not None else 0)

    def _start(self, rank: int) -> None:
        """This rank's models on a new daemon (the constructor; a new rank's models)."""
        c = self.config
        self.rank = rank
        # A replacement may get a rank past the others' while its predecessor stops; it
        # serves that rank's slot modulo N until Ray gives it its rank back.
        self.models = sorted(c.placed(self.n_replicas)[rank % self.n_replicas])
        base = os.path.join(c.run_dir, f"{c.app_name}-{rank}-{os.getpid()}")
        self.daemon = ray_daemon.start(base + ".sock", self._daemon_args(base),
                                       env=self._daemon_env())
        self.service = InferenceService(self.daemon.socket, clients=2, timeout=c.timeout_s)
        self._check_models()
        self._write_record()
        log.warning("replica %s (rank %d): daemon pid %d on %s serves %s", self.id, rank,
                    self.daemon.proc.pid, self.daemon.socket, ", ".join(self.models))

    def reconfigure(self, user_config: Any, rank: Any = None) -> None:
        """Ray gives this replica another rank (ranks are kept contiguous): if that
        rank's models differ, the daemon is replaced by one serving them."""
        new = getattr(rank, "rank", rank)
        if new is None or new == self.rank:
            return
        models = sorted(self.config.placed(self.n_replicas)[new % self.n_replicas])
        if models == self.models:
            self._forget_record()
            self.rank = new
            self._write_record()
            return
        self._forget_record()
        self._stop()
        self._start(new)

    # -- the daemon ------------------------------------------------------------------
    def _daemon_args(self, base: str) -> list[str]:
        c = self.config
        args = ["--backend", c.backend, "--log-level", "warning",
                "--echo" if "echo" in self.models else "--no-echo",
                "--noop" if "noop" in self.models else "--no-noop"]
        if c.backend == "sim":
            args += ["--gpu", c.preset]
        bundles = [m for m in self.models if m not in BUILTIN_MODELS]
        if bundles:
            assert c.model_repository is not None        # (checked with the config)
            args += ["--models", _repository_of(base + "-models", c.model_repository, bundles)]
        return args + list(c.daemon_args)

    def _check_models(self) -> None:
        """The daemon serves every model this replica was given, or the replica fails
        (a bundle the daemon skipped: its reason is in the daemon's log, quoted)."""
        from paella.client import Client
        try:
            c = Client(self.daemon.socket)
            try:
                served = set(c.list_models())
            finally:
                c.close()
        except Exception as e:  # noqa: BLE001 - any failure to ask is a failed start
            self.daemon.stop()
            raise ray_daemon.DaemonStartError(f"the paella daemon does not answer: {e}"
                                              f"{self.daemon.last_words()}") from None
        missing = sorted(set(self.models) - served)
        if missing:
            self.daemon.stop()
            raise ray_daemon.DaemonStartError(
                f"the paella daemon started without the model(s) {', '.join(missing)} "
                f"(it serves {', '.join(sorted(served)) or 'nothing'}): a bad bundle? Its "
                f"log{self.daemon.last_words()}")

    def _daemon_env(self) -> dict[str, str]:
        """The GPU Ray gave this replica, the only one its daemon sees (cuda)."""
        env = dict(os.environ)
        if self.config.backend == "cuda":
            import ray
            ids = ray.get_gpu_ids()
            if not ids:
                raise ray_daemon.DaemonStartError("Ray gave this replica no GPU (num_gpus=1 "
                                                  "and ray.get_gpu_ids() is empty)")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in ids)
        return env

    def _record_path(self) -> str:
        return os.path.join(self.config.run_dir, f"{self.config.app_name}-{self.rank}.json")

    def _forget_record(self) -> None:
        try:
            os.unlink(self._record_path())
        except FileNotFoundError:
            pass

    def _write_record(self) -> None:
        """``run_dir/APP-RANK.json``: where this rank's daemon is (``paella status
        --socket``), for operators and tests."""
        path = self._record_path()
        with open(path + ".tmp", "w") as f:
            json.dump({"replica": self.id, "rank": self.rank, "pid": os.getpid(),
                       "daemon_pid": self.daemon.proc.pid, "socket": self.daemon.socket,
                       "models": self.models, "started": time.time()}, f)
        os.replace(path + ".tmp", path)

    # -- Ray's hooks -----------------------------------------------------------------
    def check_health(self) -> None:
        """Fails once the daemon is gone, so that Ray replaces this replica."""
        if not self.daemon.alive:
            raise RuntimeError(self.daemon.why_dead())

    def record_replica_metadata(self) -> dict[str, Any]:
        """What the router knows of this replica from the moment Ray routes to it (Ray
        reads it once, when the replica is initialized): its models and rank. The first
        routing stats come a poll later; until then this says where a model is served,
        so a fresh replica is routable at once."""
        return {"models": self.models, "rank": self.rank}

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the request router reads (Ray polls it): queued work, models, health."""
        stats: dict[str, Any] = {"models": self.models, "alive": self.daemon.alive,
                                 "rank": self.rank, "served": self.served}
        if self.daemon.alive:
            try:
                if self._stats is None or not self._stats.alive:
                    self._stats = await AsyncClient.connect(self.daemon.socket, timeout=1.0)
                status = await self._stats.status_async(timeout=1.0)
                stats["queued_work_us"] = float(status.get("queued_work_us", 0) or 0)
            except Exception as e:  # noqa: BLE001 - a stat missed; the health check decides
                log.warning("STATUS of the daemon failed: %s", e)
        return stats

    def _stop(self) -> None:
        self.service.close()
        if self._stats is not None:
            self._stats.close()
            self._stats = None
        self.daemon.stop()

    def __del__(self) -> None:
        if getattr(self, "daemon", None) is not None:
            self._stop()

    # -- requests (the ingress calls these with keyword arguments: the router reads
    #    ``model`` and ``avoid``) -------------------------------------------------------
    async def spec(self, model: str, avoid: str | None = None) -> ModelSpec:
        """The model's tensors as KServe describes them."""
        return await self._call(self.service.model(model))

    async def infer(self, model: str, inputs: Mapping[str, np.ndarray], priority: int = 0,
                    timeout: float | None = None, avoid: str | None = None
                    ) -> dict[str, np.ndarray]:
        """One inference on this GPU's daemon."""
        m = await self._call(self.service.model(model))
        out = await self._call(self.service.infer(m, inputs, priority, timeout))
        self.served += 1
        return out

    async def _call(self, what):
        try:
            return await what
        except InferError as e:
            if e.status != 503:
                raise ReplicaFailure(e.status, str(e), self.id) from None
            # the daemon is unreachable: the request did not run to its answer here, and
            # inference is idempotent, so the ingress may send it elsewhere. A daemon
            # killed this instant may still look alive: its process is exiting.
            for _ in range(25):
                if not self.daemon.alive:
                    break
                await asyncio.sleep(0.02)
            msg = (f"replica {self.rank} lost its daemon: {self.daemon.why_dead()}"
                   if not self.daemon.alive else f"replica {self.rank}: {e}")
            raise ReplicaFailure(503, msg, self.id, daemon_lost=True) from None


def _repository_of(folder: str, repository: str, models: list[str]) -> str:
    """A folder of links to ``models``' folders in ``repository``: the daemon serves what
    it finds, and this replica serves only its share."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))
    for m in models:
        os.symlink(os.path.join(repository, m), os.path.join(folder, m))
    return folder
