"""Prometheus metrics of the daemon (``paella serve --metrics-port N``).

Two halves, so the loop pays next to nothing and nothing at all for a scrape:

* :class:`MetricsInstrument`, an :mod:`~paella.dispatcher.instruments` instrument, counts
  in plain Python ints and floats (one dict lookup and an add per hook call; no lock, no
  prometheus-client object on the hot path). Trick, labelled: the loop thread is the
  only writer, and a scrape reads ints the GIL keeps whole, so no lock is needed.
* :class:`DaemonCollector` turns those numbers, and what the loop's objects already hold
  (the tracker's per-SM usage, the notifQ, the policy), into metric families when
  Prometheus scrapes, in prometheus-client's HTTP thread.

Names follow Triton's where they mean the same thing (``nv_inference_request_success``,
``_failure``, ``_count``, ``_exec_count``, ``nv_inference_request_duration_us``,
``_queue_duration_us``, ``_compute_infer_duration_us``, labelled ``model`` and
``version``); what only this daemon knows is ``paella_*``. The cost on the loop is
measured in docs/service.md ("Metrics").
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from paella.dispatcher.devices.base import KERNEL
from paella.dispatcher.instruments import Instrument

log = logging.getLogger("paella.daemon")




class ModelCounts:
    """What one model's requests did, in plain numbers (microseconds for durations)."""
    __slots__ = ("success", "failure", "count", "exec_count", "request_us", "queue_us",
                 "compute_us", "kernels", "copies")

    def __init__(self) -> None:
        self.success = self.failure = self.count = self.exec_count = 0
        self.request_us = self.queue_us = self.compute_us = 0.0
        self.kernels = self.copies = 0


class MetricsInstrument(Instrument):
    """Counts per model id. Durations are wall-clock (``time.monotonic``), the same clock
    for host models and the dispatcher: request = admitted -> completion delivered,
    queue = admitted -> job started, compute = job started -> completion delivered."""

    def __init__(self) -> None:
        self.models: dict[int, ModelCounts] = {}
        self._admitted: dict[Any, float] = {}     # request -> admission time
        self._started: dict[Any, float] = {}      # request -> start time
        self._last_exec: tuple[int, float] = (-1, 0.0)

    def _model(self, model_id: int) -> ModelCounts:
        m = self.models.get(model_id)
        if m is None:
            m = self.models[model_id] = ModelCounts()
        return m

    def request_admitted(self, req: Any) -> None:
        self._admitted[req] = time.monotonic()

    def request_started(self, req: Any) -> None:
        self._started[req] = time.monotonic()
        # One execution per job: a batcher's group shares its submission time.
        key = (req.model_id, req.t_submit)
        if key != self._last_exec:
            self._last_exec = key
            self._model(req.model_id).exec_count += 1

    def request_finished(self, req: Any) -> None:
        now = time.monotonic()
        m = self._model(req.model_id)
        m.count += 1
        if req.status == 0:
            m.success += 1
        else:
            m.failure += 1
        t0 = self._admitted.pop(req, None)
        t1 = self._started.pop(req, None)
        if t0 is not None:
            m.request_us += (now - t0) * 1e6
        if t1 is None:                       # a host model: no job, computed at once
            return
        if t0 is not None:
            m.queue_us += (t1 - t0) * 1e6
        m.compute_us += (now - t1) * 1e6

    def op_released(self, op: Any, t: float) -> None:
        m = self._model(op.job.model.model_id)
        if op.kind == KERNEL:
            m.kernels += 1
        else:
            m.copies += 1


class DaemonCollector:
    """A prometheus-client collector reading a running daemon at scrape time.
    ``snapshot()`` is :meth:`Daemon.status`'s dict; ``counts`` the instrument's."""

    def __init__(self, counts: MetricsInstrument, snapshot: Callable[[], dict]):
        self.counts = counts
        self.snapshot = snapshot

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        st = self.snapshot()
        names = {m["id"]: m["name"] for m in st["models"]}
        labels = ["model", "version"]

        def family(cls, name: str, doc: str, attr: str, scale: float = 1.0):
            f = cls(name, doc, labels=labels)
            for mid, c in list(self.counts.models.items()):
                if mid in names:
                    f.add_metric([names[mid], "1"], getattr(c, attr) * scale)
            return f

        yield family(CounterMetricFamily, "nv_inference_request_success",
                     "Number of successful inference requests", "success")
        yield family(CounterMetricFamily, "nv_inference_request_failure",
                     "Number of failed inference requests", "failure")
        yield family(CounterMetricFamily, "nv_inference_count",
                     "Number of inferences performed (one per request: batch size 1)", "count")
        yield family(CounterMetricFamily, "nv_inference_exec_count",
                     "Number of model executions (jobs) performed", "exec_count")
        yield family(CounterMetricFamily, "nv_inference_request_duration_us",
                     "Cumulative request duration, admission to completion, in microseconds",
                     "request_us")
        yield family(CounterMetricFamily, "nv_inference_queue_duration_us",
                     "Cumulative time requests waited before their job started, in "
                     "microseconds", "queue_us")
        yield family(CounterMetricFamily, "nv_inference_compute_infer_duration_us",
                     "Cumulative time from job start to completion, in microseconds",
                     "compute_us")
        yield family(CounterMetricFamily, "paella_kernel_releases",
                     "Kernels the dispatcher released to the GPU, per model", "kernels")
        yield family(CounterMetricFamily, "paella_copy_releases",
                     "Copies the dispatcher released to the GPU, per model", "copies")
        inflight = GaugeMetricFamily("paella_requests_in_flight",
                                     "Requests accepted and not yet completed")
        inflight.add_metric([], st["in_flight"])
        yield inflight
        clients = GaugeMetricFamily("paella_clients", "Connected clients (handshake done)")
        clients.add_metric([], len(st["clients"]))
        yield clients
        disp = st.get("dispatcher")
        if disp is None:
            return
        occ = GaugeMetricFamily("paella_sm_occupancy",
                                "Resident warps over the SM's maximum, per SM (from the "
                                "notifQ)", labels=["sm"])
        for sm, frac in enumerate(disp["sm_occupancy"]):
            occ.add_metric([str(sm)], frac)
        yield occ
        for name, doc, key in (
                ("paella_notifq_depth", "notifQ entries reserved and not yet consumed",
                 "notifq_depth"),
                ("paella_resident_blocks", "Blocks resident on the GPU", "resident_blocks")):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], disp[key])
            yield g
        for name, doc, key in (
                ("paella_notifications", "notifQ entries consumed", "notifications"),
                ("paella_policy_decisions", "Kernels the policy picked and the dispatcher "
                                            "released", "decisions"),
                ("paella_policy_fallbacks", "Times a failing policy was replaced by fifo",
                 "policy_fallbacks")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], disp[key])
            yield c
        policy = GaugeMetricFamily("paella_policy", "The scheduling policy in use (1)",
                                   labels=["policy"])
        policy.add_metric([disp["policy"]], 1)
        yield policy


def start_metrics_server(port: int, addr: str, counts: MetricsInstrument,
                         snapshot: Callable[[], dict]) -> Any:
    """Serve /metrics on ``addr:port`` from a thread of prometheus-client's; returns the
    server (``shutdown()`` stops it)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        from .config import ConfigError
        raise ConfigError("--metrics-port needs prometheus-client: pip install "
                          "'paella-py[serve]'") from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(counts, snapshot))
    try:
        server, _thread = start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        from .config import ConfigError
        raise ConfigError(f"cannot serve metrics on {addr}:{port}: {e.strerror}; choose "
                          f"another --metrics-port") from None
    log.info("metrics on http://%s:%d/metrics", addr, server.server_port)
    return server
