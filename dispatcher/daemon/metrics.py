"""Prometheus metrics of the daemon (``paella serve --metrics-port N``).

Two halves, so the loop pays next to nothing and nothing at all for a scrape:

* :class:`JobMetrics` and :class:`HostMetrics`, :mod:`~paella.dispatcher.instruments`
  instruments, count into :class:`MetricsCounts` in plain Python ints and floats: one
  hook call per job (no lock, no prometheus-client object on the hot path). Trick,
  labelled: the loop thread is the only writer, and a scrape reads numbers the GIL
  keeps whole, so no lock is needed.
* :class:`DaemonCollector` turns those numbers, and what the loop's objects already hold
  (the tracker's per-SM usage, the notifQ, the policy), into metric families when
  Prometheus scrapes, in prometheus-client's HTTP thread.

Names follow Triton's where they mean the same thing (``nv_inference_request_success``,
``_failure``, ``_count``, ``_exec_count``, ``nv_inference_request_duration_us``,
``_queue_duration_us``, ``_compute_infer_duration_us``, labelled ``model`` and
``version``; exact names, so untyped: prometheus-client would add ``_total``); what
only this daemon knows is ``paella_*`` (counters end in ``_total``). The cost on the loop is
measured in docs/service.md ("Metrics").
"""
from __future__ import annotations

import errno
import logging
import socket
import time
from typing import Any, Callable

from paella.dispatcher.instruments import Instrument

log = logging.getLogger("paella.daemon")




class ModelCounts:
    """What one model's requests did, in plain numbers (microseconds for durations)."""
    __slots__ = ("success", "failure", "count", "exec_count", "request_us", "queue_us",
                 "compute_us", "kernels")

    def __init__(self) -> None:
        self.success = self.failure = self.count = self.exec_count = 0
        self.request_us = self.queue_us = self.compute_us = 0.0
        self.kernels = 0


class MetricsCounts:
    """Counts per model id, written by the loop's instruments, read by the collector."""

    def __init__(self) -> None:
        self.models: dict[int, ModelCounts] = {}
        #: Kernels released by every job, the profiling runs' included (the policy's
        #: decisions; per model, ``kernels`` counts the clients' jobs only).
        self.kernels = 0

    def model(self, model_id: int) -> ModelCounts:
        m = self.models.get(model_id)
        if m is None:
            m = self.models[model_id] = ModelCounts()
        return m

    def instruments(self) -> tuple["JobMetrics", "HostMetrics", "StageMetrics"]:
        """The instruments of the dispatcher path, of host models and of the batching
        stage."""
        return JobMetrics(self), HostMetrics(self), StageMetrics(self)


class JobMetrics(Instrument):
    """The dispatcher path, from one hook per job (``job_finished``). Trick, labelled:
    the job already holds every figure (its requests' submission times, its start, its
    per-kernel release counts), so the loop pays one call per job, not one per request
    event or per kernel (per-request and per-kernel hooks cost the loop 10-20% in
    ``bench_metrics``). Durations on the device clock: request = submitted -> done,
    queue = submitted -> job started, compute = job started -> done.

    Counted under the requests' model id, the one their clients named (a job's requests
    share it: ``submit_group``), not the job's: a compiled model's jobs run as one
    dispatcher model per variant, under internal ids the clients never see. The
    dispatcher's profiling runs at registration (client id -1) are nobody's requests and
    are not counted."""

    def __init__(self, counts: MetricsCounts):
        self.counts = counts

    def job_finished(self, job: Any) -> None:
        counts = self.counts
        kernels = sum(job.kcount.values())
        counts.kernels += kernels
        reqs = [req for req in job.requests if req.client_id >= 0]
        if not reqs:
            return
        m = counts.model(reqs[0].model_id)
        m.exec_count += 1
        m.kernels += kernels
        now = job.host.now
        ok = job.error is None
        t_start = job.t_start
        if t_start != t_start:               # never started (cancelled or failed while it
            t_start = now                    # waited for memory): all of it was queueing
        for req in reqs:
            m.count += 1
            if ok and not req.cancelled:
                m.success += 1
            else:
                m.failure += 1
            m.request_us += (now - req.t_submit) * 1e6
            m.queue_us += (t_start - req.t_submit) * 1e6
            m.compute_us += (now - t_start) * 1e6


class HostMetrics(Instrument):
    """Host models (``echo``): computed in the loop at once, so no queue; wall clock."""

    def __init__(self, counts: MetricsCounts):
        self.counts = counts
        self._admitted: dict[Any, float] = {}

    def request_admitted(self, req: Any) -> None:
        self._admitted[req] = time.monotonic()

    def request_finished(self, req: Any) -> None:
        m = self.counts.model(req.model_id)
        m.count += 1
        m.exec_count += 1
        if req.status == 0:
            m.success += 1
        else:
            m.failure += 1
        t0 = self._admitted.pop(req, None)
        if t0 is not None:
            us = (time.monotonic() - t0) * 1e6
            m.request_us += us
            m.compute_us += us


class StageMetrics(Instrument):
    """Requests the batching stage answers itself, with no job of theirs: those a
    scheduler plug-in completes (``orca``'s generations; its iterations are jobs of
    internal requests, which no client sees) and those refused before any job. Counted
    when answered; with no job, they have no queue or compute time, and their duration
    is not measured."""

    def __init__(self, counts: MetricsCounts):
        self.counts = counts

    def request_finished(self, req: Any) -> None:
        m = self.counts.model(req.model_id)
        m.count += 1
        if req.status == 0:
            m.success += 1
        else:
            m.failure += 1

    def request_retried(self, req: Any) -> None:
        """Its batch's job failed and :class:`JobMetrics` counted it failed; it runs
        again and its next answer is its answer: the failed attempt's count goes (its
        time stays in the durations: it did pass)."""
        m = self.counts.model(req.model_id)
        m.count -= 1
        m.failure -= 1


class DaemonCollector:
    """A prometheus-client collector reading a running daemon at scrape time.
    ``snapshot()`` is :meth:`Daemon.status`'s dict; ``counts`` the instruments'."""

    def __init__(self, counts: MetricsCounts, snapshot: Callable[[], dict]):
        self.counts = counts
        self.snapshot = snapshot

    def collect(self):
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                             UnknownMetricFamily)
        st = self.snapshot()
        names = {m["id"]: m["name"] for m in st["models"]}
        # Triton's counters carry no _total suffix, which prometheus-client appends to
        # every counter: exposed untyped under Triton's exact names, so queries and
        # dashboards written for Triton work unchanged.
        TRITON = UnknownMetricFamily
        labels = ["model", "version"]

        def family(cls, name: str, doc: str, attr: str, scale: float = 1.0):
            f = cls(name, doc, labels=labels)
            for mid, c in list(self.counts.models.items()):
                if mid in names:
                    f.add_metric([names[mid], "1"], getattr(c, attr) * scale)
            return f

        yield family(TRITON, "nv_inference_request_success",
                     "Number of successful inference requests", "success")
        yield family(TRITON, "nv_inference_request_failure",
                     "Number of failed inference requests", "failure")
        yield family(TRITON, "nv_inference_count",
                     "Number of inferences performed (one per request: batch size 1)", "count")
        yield family(TRITON, "nv_inference_exec_count",
                     "Number of model executions (jobs) performed", "exec_count")
        yield family(TRITON, "nv_inference_request_duration_us",
                     "Cumulative request duration, admission to completion, in microseconds",
                     "request_us")
        yield family(TRITON, "nv_inference_queue_duration_us",
                     "Cumulative time requests waited before their job started, in "
                     "microseconds", "queue_us")
        yield family(TRITON, "nv_inference_compute_infer_duration_us",
                     "Cumulative time from job start to completion, in microseconds",
                     "compute_us")
        yield family(CounterMetricFamily, "paella_kernel_releases",
                     "Kernels the dispatcher released to the GPU, per model", "kernels")
        mem = GaugeMetricFamily("paella_model_device_memory_bytes",
                                "Device memory a model holds: its weights and its per-request "
                                "buffers, idle or in use", labels=labels)
        for m in st["models"]:
            if "device_memory_bytes" in m:
                mem.add_metric([m["name"], "1"], m["device_memory_bytes"])
        yield mem
        ops = CounterMetricFamily("paella_batcher_ops", "A scheduler batcher's own counters "
                                  "(dvabatch: requests, rows, exits, and the meta-operations "
                                  "new, stretch and split)", labels=[*labels, "batcher", "op"])
        for m in st["models"]:
            for key, val in m.get("batcher", {}).items():
                if key != "name" and isinstance(val, (int, float)) and not isinstance(val, bool):
                    ops.add_metric([m["name"], "1", m["batcher"]["name"], key], val)
        yield ops
        inflight = GaugeMetricFamily("paella_requests_in_flight",
                                     "Requests accepted and not yet completed")
        inflight.add_metric([], st["in_flight"])
        yield inflight
        clients = GaugeMetricFamily("paella_clients", "Connected clients (handshake done)")
        clients.add_metric([], len(st["clients"]))
        yield clients
        classes = st.get("classes")
        if classes is not None:
            by = CounterMetricFamily("paella_requests_by_class", "Requests accepted per "
                                     "priority class (1 the most urgent; 0: none)",
                                     labels=["class"])
            for k, v in classes["accepted"].items():
                by.add_metric([k], v)
            yield by
            now = GaugeMetricFamily("paella_requests_in_flight_by_class", "Requests accepted "
                                    "and not yet answered, per priority class",
                                    labels=["class"])
            for k, v in classes.get("in_flight", {}).items():
                now.add_metric([k], v)
            yield now
            clamped = CounterMetricFamily("paella_priority_clamped", "Requests that asked "
                                          "for a class above their tenant's highest, clamped")
            clamped.add_metric([], classes["clamped"])
            yield clamped
        disp = st.get("dispatcher")
        if disp is None:
            return
        disp["decisions"] = self.counts.kernels
        occ = GaugeMetricFamily("paella_sm_occupancy",
                                "Resident warps over the SM's maximum, per SM (from the "
                                "notifQ)", labels=["sm"])
        for sm, frac in enumerate(disp["sm_occupancy"]):
            occ.add_metric([str(sm)], frac)
        yield occ
        yield from _unlabelled(GaugeMetricFamily, disp, (
            ("paella_notifq_depth", "notifQ entries reserved and not yet consumed",
             "notifq_depth"),
            ("paella_resident_blocks", "Blocks resident on the GPU", "resident_blocks"),
            ("paella_device_memory_bytes", "Device memory the daemon holds (params, "
             "buffer sets, schedulers' allocations)", "device_memory_bytes"),
            ("paella_device_memory_total_bytes", "The GPU's memory (the driver's total; "
             "the simulator's preset)", "device_memory_total_bytes"),
            ("paella_dispatcher_models", "Models registered with the dispatcher "
             "(variants, internal and built-in models; retired ones until their last "
             "job ends)", "models")))
        yield from _unlabelled(CounterMetricFamily, disp, (
            ("paella_notifications", "notifQ entries consumed", "notifications"),
            ("paella_policy_decisions", "Kernels the policy picked and the dispatcher "
                                        "released", "decisions"),
            ("paella_policy_fallbacks", "Times a failing policy was replaced by fifo",
             "policy_fallbacks"),
            ("paella_memory_waits", "Times a job waited for device memory that "
             "running jobs would give back", "memory_waits"),
            ("paella_memory_failures", "Requests failed because their buffers could "
             "never fit in device memory", "memory_failures")))
        effects = disp.get("effects")
        if effects is not None:              # the simulated GPU's answer workers
            yield from _unlabelled(GaugeMetricFamily, effects, (
                ("paella_effect_workers", "Worker processes computing the simulated GPU's "
                 "answers, alive", "alive"),
                ("paella_effect_queue", "Answers waiting for a worker", "queued"),
                ("paella_effect_running", "Answers being computed", "running"),
                ("paella_effect_awaiting_jobs", "Jobs waiting for their answer before they "
                 "start (holding no stream)", "awaiting_jobs"),
                ("paella_effect_held_kernels", "Kernels held back until their answer is in",
                 "held_kernels")))
            yield from _unlabelled(CounterMetricFamily, effects, (
                ("paella_effect_completed", "Answers computed", "completed"),
                ("paella_effect_failed", "Answers that failed (raised, crashed, timed out)",
                 "failed"),
                ("paella_effect_worker_restarts", "Workers started again after a crash or a "
                 "deadline", "restarts"),
                ("paella_effect_evicted", "New inputs refused from a full queue to make room "
                 "for another tenant's (theirs held the most)", "evicted")))
        policy = GaugeMetricFamily("paella_policy", "The scheduling policy in use (1)",
                                   labels=["policy"])
        policy.add_metric([disp["policy"]], 1)
        yield policy


def _unlabelled(cls, values: dict, rows):
    """One metric family of ``cls`` without labels per ``(name, doc, key)`` row, its
    value ``values[key]``."""
    for name, doc, key in rows:
        m = cls(name, doc)
        m.add_metric([], values[key])
        yield m


def start_metrics_server(port: int, addr: str, counts: MetricsCounts,
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
        from .config import ConfigError, shown
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"cannot serve metrics on {shown(addr)}: {e.strerror}; "
                              f"--metrics-addr must be an address of this machine, such as "
                              f"127.0.0.1, ::1 or 0.0.0.0") from None
        raise ConfigError(f"cannot serve metrics on {shown(addr)}:{port}: {e.strerror}; choose "
                          f"another --metrics-port") from None
    log.info("metrics on http://%s:%d/metrics", addr, server.server_port)
    return server
