"""The step scheduler on the kernel scheduler (simulated GPU, virtual time): each batched
step a job; Orca's generation with its KV cache in device memory, tokens checked against
a from-scratch numpy recomputation from the same weights."""
import numpy as np
import pytest

from paella.dispatcher.batchers.stage import scheduler_context
from paella.dispatcher.core import Dispatcher
from paella.dispatcher.devices.sim import SimDevice
from paella.dispatcher.instruments import Instrument
from paella.models.gpt import GPTConfig, generate_reference, gpt_weights
from paella.models.rnn import RNNConfig, lstm_cell
from paella.stepsched.cell_scheduler import CellType, CellularScheduler
from paella.stepsched.generation import GenerationEngine, GenerationError
from paella.stepsched.graph import unfold_chain
from paella.stepsched.step_kernels import compile_steps
from paella.stepsched.padding import PaddingBatcher
from paella.stepsched.runtime import StepRuntime

CFG = GPTConfig.tiny()
W = gpt_weights(CFG)


def dispatcher(policy="paella"):
    dev = SimDevice("t4", n_streams=64, seed=0)
    return Dispatcher(dev, policy, profile_runs=0)


def context(d=None, name="steps"):
    """A scheduler context on ``d`` (a fresh dispatcher by default): the runtime's one
    way to the dispatcher, in virtual time as in the daemon."""
    return scheduler_context(d if d is not None else dispatcher(), name)


@pytest.fixture(scope="module")
def lstm_kernels(tmp_path_factory):
    root = tmp_path_factory.mktemp("lstm")
    return compile_steps(lambda n: lstm_cell(n, RNNConfig.tiny()), (1, 2, 4), root)


class Kernels(Instrument):
    """Counts the kernel scheduler's releases per job's model."""

    def __init__(self):
        self.released = 0

    def op_released(self, op, t):
        self.released += 1


def test_cellular_steps_are_jobs_and_requests_leave_when_done(lstm_kernels):
    d = dispatcher()
    probe = Kernels()
    d.instruments.add(probe)
    log = []
    rt = StepRuntime(context(d), CellularScheduler([CellType("lstm", (1, 2, 4))], 5),
                     lambda t: lstm_kernels[t.batch_size],
                     on_task_done=lambda t, done: log.append((t.requests, done)))
    lengths = {"a": 2, "b": 6, "c": 3, "d": 9, "e": 1}
    rt.drive([(0.0 if k in "abc" else 30e-6, unfold_chain(k, n)) for k, n in lengths.items()])
    # every cell of every request ran exactly once, in tasks of at most 4
    assert rt.stats.rows == sum(lengths.values())
    assert all(len(reqs) <= 4 for reqs, _ in log)
    # a request leaves with the task that ran its last cell, not later
    for k, n in lengths.items():
        ran = [i for i, (reqs, _) in enumerate(log) if k in reqs]
        assert len(ran) == n and k in log[ran[-1]][1]
    assert rt.finished["a"] < rt.finished["b"] < rt.finished["d"]
    assert rt.stats.tasks == len(log) and d.in_flight == 0 and not rt.active
    # each task was a job whose kernels the kernel scheduler released, one by one
    assert probe.released == sum(len(lstm_kernels[1].launches) for _ in log)


def test_graph_batching_pads_and_holds_everyone_to_the_longest(lstm_kernels):
    d = dispatcher()
    rt = StepRuntime(context(d), PaddingBatcher(4, width=10, bsizes=(1, 2, 4)),
                     lambda t: lstm_kernels[t.batch_size].repeated(t.steps), name="graph")
    rt.drive([(0.0, ("a", 2)), (0.0, ("b", 9)), (0.0, ("c", 12))])
    assert rt.finished["a"] == rt.finished["b"] < rt.finished["c"]    # bucket 10 together
    assert rt.stats.tasks == 2 and rt.stats.padded_rows == 0          # sizes 2 and 1 compiled
    assert rt.stats.padded_cells == (10 - 2) + (10 - 9) + (20 - 12)


def test_generation_tokens_match_the_reference_while_requests_join_and_leave():
    d = dispatcher()
    eng = GenerationEngine(context(d), CFG, max_bs=3, n_slots=64, weights=W)
    a = eng.submit([3, 7, 1, 9], 6, kick=False)
    b = eng.submit([5, 2], 2)
    streamed = list(eng.generate([11, 12, 13], 5))        # joins the running a and b
    eng.runtime.drive([])
    assert streamed == generate_reference(CFG, W, [11, 12, 13], 5)
    assert a.tokens == generate_reference(CFG, W, [3, 7, 1, 9], 6)
    assert b.tokens == generate_reference(CFG, W, [5, 2], 2)
    assert b.times[-1] < a.times[-1]                      # b left early
    assert len(eng.free_slots) == 64 and eng.sched.n_rsrv == 0
    assert all(np.diff(a.times) > 0)                      # one token per iteration


def test_a_vanishing_client_frees_its_slots_and_the_others_go_on():
    d = dispatcher()
    eng = GenerationEngine(context(d), CFG, max_bs=4, n_slots=24, weights=W)
    gone = eng.submit([1, 2, 3], 9, user=7, kick=False)        # 12 slots
    keep = eng.submit([4, 5], 6, user=8, kick=False)           # 8 slots
    wait = eng.submit([6], 8, user=9)                          # 9 slots: does not fit yet
    eng.runtime.drive([], until=lambda: len(gone.tokens) >= 2)
    assert wait.tokens == [] and eng.sched.n_rsrv == 20
    assert eng.cancel_user(7) == 1
    eng.runtime.drive([])
    assert gone.cancelled and not gone.done and len(gone.tokens) <= 3
    assert keep.tokens == generate_reference(CFG, W, [4, 5], 6)
    assert wait.tokens == generate_reference(CFG, W, [6], 8)
    assert len(eng.free_slots) == 24 and eng.sched.n_rsrv == 0 and d.in_flight == 0


@pytest.mark.parametrize("how", ["swap", "recompute"])
def test_preempted_request_resumes_in_place_with_the_same_tokens(how):
    d = dispatcher()
    copied = []
    for name in ("memcpy_dtoh", "memcpy_htod"):
        real = getattr(d.device, name)
        setattr(d.device, name, lambda dst, src, *a, real=real, name=name, **kw: (
            copied.append((name, (dst if name == "memcpy_dtoh" else src).nbytes)), real(dst, src, *a, **kw))[1])
    eng = GenerationEngine(context(d), CFG, max_bs=4, n_slots=20, weights=W, priorities=True, preempt=True)
    eng.preempt_cost = lambda r: how
    eng.sched.preempt_cost = eng.preempt_cost
    a = eng.submit([3, 7, 1, 9], 6, kick=False)             # 10 slots
    b = eng.submit([5, 2, 8], 7)                            # 10 slots: cache full
    eng.runtime.drive([], until=lambda: len(b.tokens) >= 3)
    urgent = eng.submit([9, 9], 3, priority=1)              # 5 slots: b (last in line) yields
    eng.runtime.drive([])
    assert (eng.swaps, eng.recomputes) == ((1, 0) if how == "swap" else (0, 1))
    # a swap moves b's cached tokens (prompt 3 + its tokens so far - 1) out and back in
    kv_copies = [c for c in copied if c[1] % CFG.kv_bytes_per_slot() == 0 and c[1] > 8]
    if how == "swap":
        n = kv_copies[0][1] // CFG.kv_bytes_per_slot()
        assert kv_copies == [("memcpy_dtoh", n * CFG.kv_bytes_per_slot()),
                             ("memcpy_htod", n * CFG.kv_bytes_per_slot())] and n >= 3 + 3 - 1
    else:
        assert kv_copies == []
    assert urgent.times[-1] < b.times[-1]
    assert b.tokens == generate_reference(CFG, W, [5, 2, 8], 7)
    assert a.tokens == generate_reference(CFG, W, [3, 7, 1, 9], 6)
    assert urgent.tokens == generate_reference(CFG, W, [9, 9], 3)
    assert len(eng.free_slots) == 20


def test_preemption_cost_picks_swap_for_long_contexts_on_a_big_model():
    d = dispatcher()
    eng = GenerationEngine(context(d), GPTConfig.gpt2_small(), max_bs=8, n_slots=4096)
    from paella.stepsched.iteration_scheduler import GenRequest
    r = GenRequest("x", 500, 600)
    r.generated = 20
    # GPT-2 small on a T4: recomputing 520 tokens (~130 GFLOP) costs more than moving
    # 520 x 72 KiB twice over PCIe: swap
    assert eng.preempt_cost(r) == "swap"
    tiny = GenerationEngine(context(), CFG, max_bs=8, n_slots=64)
    assert tiny.preempt_cost(r) == "recompute"


def test_bad_generation_requests_are_refused_with_the_cause():
    eng = GenerationEngine(context(), CFG, max_bs=2, n_slots=32, weights=W)
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        eng.submit([1, 64], 2)
    with pytest.raises(GenerationError, match="empty"):
        eng.submit([], 2)
    with pytest.raises(GenerationError, match="exceeds the KV cache"):
        eng.submit([1] * 30, 5)
    with pytest.raises(GenerationError, match="context of 64"):
        GenerationEngine(context(), CFG, max_bs=2, n_slots=100).submit([1] * 60, 5)
    assert not eng.runtime.active


def test_steps_of_two_models_share_the_gpu_through_the_kernel_scheduler(lstm_kernels):
    d = dispatcher()
    ends = []
    rnn = StepRuntime(context(d), CellularScheduler([CellType("lstm", (1, 2, 4))], 1),
                      lambda t: lstm_kernels[t.batch_size], name="lstm",
                      on_task_done=lambda t, done: ends.append(d.device.now()))
    eng = GenerationEngine(context(d), CFG, max_bs=2, n_slots=64, weights=W, name="gpt")
    for k in "abc":
        rnn.add(unfold_chain(k, 20), kick=False)
    rnn.kick()
    g = eng.submit([1, 2, 3], 8)
    eng.runtime.drive([])
    rnn.drive([])
    assert g.tokens == generate_reference(CFG, W, [1, 2, 3], 8)
    assert rnn.stats.rows == 60 and set(rnn.finished) == {"a", "b", "c"}
    # the two models' steps interleaved on the GPU: LSTM steps ended between GPT tokens
    assert any(g.times[0] < t < g.times[-1] for t in ends)


def test_seq2seq_encoder_and_decoder_cells_batch_separately_decoders_first(tmp_path):
    from paella.models.rnn import decoder_cell, encoder_cell
    from paella.stepsched.graph import unfold_seq2seq
    cfg = RNNConfig.tiny()
    k = {"encoder": compile_steps(lambda n: encoder_cell(n, cfg), (2,), tmp_path)[2],
         "decoder": compile_steps(lambda n: decoder_cell(n, cfg), (2,), tmp_path)[2]}
    d = dispatcher()
    log = []
    sch = CellularScheduler([CellType("encoder", (2,), priority=0), CellType("decoder", (2,), priority=1)], 1)
    rt = StepRuntime(context(d), sch, lambda t: k[t.kind], name="s2s",
                     on_task_done=lambda t, done: log.append((t.kind, sorted(t.requests))))
    rt.drive([(0.0, unfold_seq2seq("a", 2, 3)), (0.0, unfold_seq2seq("b", 2, 2)),
              (0.0, unfold_seq2seq("c", 4, 1))])
    # encoders of a and b fill a batch of 2 (tier 1); their decoders, once ready, go before
    # c's remaining encoders (later cell type first); every request leaves when its own
    # decoding ends
    assert log[0] == ("encoder", ["a", "b"])
    first_dec = next(i for i, (kind, _) in enumerate(log) if kind == "decoder")
    assert log[first_dec] == ("decoder", ["a", "b"])
    assert sum(len(r) for kind, r in log if kind == "encoder") == 8
    assert sum(len(r) for kind, r in log if kind == "decoder") == 6
    assert rt.finished["b"] < rt.finished["a"] and set(rt.finished) == {"a", "b", "c"}


def test_lstm_chains_computed_cell_by_cell_equal_each_chain_alone(lstm_kernels):
    from paella.models.rnn import lstm_reference
    from paella.stepsched.rnn_engine import LSTMEngine
    w, b = lstm_cell(1, RNNConfig.tiny()).params
    eng = LSTMEngine(context(), lstm_kernels, w, b, max_requests=8)
    rng = np.random.default_rng(5)
    xs = {k: rng.standard_normal((n, 16)).astype(np.float32) for k, n in
          {"a": 7, "b": 2, "c": 11, "d": 4, "e": 1}.items()}
    eng.runtime.drive([(0.0 if k in "abc" else 40e-6, k) for k in xs],
                      on_arrival=lambda k: eng.submit(k, xs[k], kick=False))
    for k, x in xs.items():                 # the chain alone, step by step
        h = c = np.zeros((1, 16), np.float32)
        for t in range(len(x)):
            h, c = lstm_reference(x[t:t + 1], h, c, w, b)
        np.testing.assert_allclose(eng.results[k], h[0], rtol=1e-5, atol=1e-6)
    assert eng.runtime.stats.rows == 25 and eng.runtime.stats.tasks < 25   # cells were batched
    assert len(eng.free_rows) == 8
    with pytest.raises(ValueError, match=r"inputs must be \[length >= 1, 16\]"):
        eng.submit("bad", np.zeros((3, 15)))


def test_cancelling_a_swapped_out_request_drops_its_host_copy():
    d = dispatcher()
    eng = GenerationEngine(context(d), CFG, max_bs=4, n_slots=20, weights=W, priorities=True, preempt=True)
    eng.preempt_cost = eng.sched.preempt_cost = lambda r: "swap"
    a = eng.submit([3, 7, 1, 9], 6, kick=False)
    b = eng.submit([5, 2, 8], 7)
    eng.runtime.drive([], until=lambda: len(b.tokens) >= 2)
    urgent = eng.submit([9, 9], 8, priority=1)              # b swapped out for it
    eng.runtime.drive([], until=lambda: len(urgent.tokens) >= 1)
    assert b.req in eng.swapped
    n = len(b.tokens)
    eng.cancel(b)
    eng.runtime.drive([])
    assert not eng.swapped and b.cancelled and len(b.tokens) == n
    assert b.tokens == generate_reference(CFG, W, [5, 2, 8], n)
    assert a.tokens == generate_reference(CFG, W, [3, 7, 1, 9], 6)
    assert urgent.tokens == generate_reference(CFG, W, [9, 9], 8)
    assert len(eng.free_slots) == 20 and eng.sched.n_rsrv == 0


def test_two_batches_in_flight_orca_pipeline_keeps_tokens_exact():
    d = dispatcher()
    eng = GenerationEngine(context(d), CFG, max_bs=2, n_slots=64, weights=W, n_workers=2)
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8, 9, 10]]
    streams = [eng.submit(p, 5, kick=False) for p in prompts]
    eng.runtime.kick()
    assert eng.sched.n_scheduled == 2            # AB and CD in flight together
    eng.runtime.drive([])
    for p, s in zip(prompts, streams):
        assert s.tokens == generate_reference(CFG, W, p, 5)
    assert eng.runtime.stats.tasks == 10 and eng.sched.n_scheduled == 0
