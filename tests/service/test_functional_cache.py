"""The daemon's cache of reference outputs: repeated inputs skip the slow CPU build."""
import numpy as np

from paella.dispatcher.daemon import FunctionalCache


class CountingBundle:
    """Doubles its input, counting how often the 'CPU build' runs."""

    def __init__(self):
        self.runs = 0

    def run_cpu(self, inputs, variant=0):
        self.runs += 1
        return {"y": inputs["x"] * 2}


def test_repeated_inputs_are_answered_from_the_cache():
    cache, b = FunctionalCache(), CountingBundle()
    x1, x2 = np.arange(8, dtype=np.float32), np.ones(8, dtype=np.float32)
    np.testing.assert_array_equal(cache.outputs("m", b, {"x": x1})["y"], x1 * 2)
    np.testing.assert_array_equal(cache.outputs("m", b, {"x": x1.copy()})["y"], x1 * 2)
    np.testing.assert_array_equal(cache.outputs("m", b, {"x": x2})["y"], x2 * 2)
    assert b.runs == 2 and cache.hits == 1 and cache.misses == 2
    cache.outputs("other", b, {"x": x1})          # another model never shares an entry
    assert b.runs == 3


def test_the_cache_evicts_least_recently_used_within_its_bound():
    cache, b = FunctionalCache(max_bytes=2 * 64), CountingBundle()
    xs = [np.full(8, i, dtype=np.float32) for i in range(3)]     # 32-byte inputs and outputs
    for x in xs:
        cache.outputs("m", b, {"x": x})
    cache.outputs("m", b, {"x": xs[2]})            # still cached
    assert b.runs == 3
    cache.outputs("m", b, {"x": xs[0]})            # evicted: computed again
    assert b.runs == 4


class RewritingClient:
    """The CPU build, with a client that rewrites its input in its arena while the
    daemon works on it: the store lands between the cache's hash and the run."""

    def __init__(self, arena):
        self.arena = arena

    def run_cpu(self, inputs, variant=0):
        self.arena[:] = 99
        return {"y": inputs["x"] * 2}


def test_a_client_rewriting_its_input_cannot_poison_the_cache():
    """Hash and run see the same bytes (a private copy), so the entry under the digest
    of zeros holds the outputs of zeros, and another client asking zeros gets them."""
    cache, arena = FunctionalCache(), np.zeros(8, dtype=np.float32)
    cache.outputs("m", RewritingClient(arena), {"x": arena})
    assert (arena == 99).all()                     # the rewrite happened
    honest = cache.outputs("m", CountingBundle(), {"x": np.zeros(8, dtype=np.float32)})
    np.testing.assert_array_equal(honest["y"], np.zeros(8))


def test_inputs_sharing_the_sampled_key_are_told_apart():
    """The key samples the input; a hit is the whole input compared. Two inputs that
    differ only between the sampled bytes share the key and get their own answers."""
    cache, b = FunctionalCache(), CountingBundle()
    x1 = np.zeros(1 << 16, dtype=np.float32)        # 256 KB: the sample skips bytes
    x2 = x1.copy()
    x2[1] = 5.0                                      # bytes 4..7: between two samples
    assert cache._key("m", {"x": x1}) == cache._key("m", {"x": x2})
    np.testing.assert_array_equal(cache.outputs("m", b, {"x": x1})["y"], x1 * 2)
    np.testing.assert_array_equal(cache.outputs("m", b, {"x": x2})["y"], x2 * 2)
    np.testing.assert_array_equal(cache.outputs("m", b, {"x": x1.copy()})["y"], x1 * 2)
    np.testing.assert_array_equal(cache.outputs("m", b, {"x": x2.copy()})["y"], x2 * 2)
    assert b.runs == 2 and cache.hits == 2


def test_one_key_holds_a_bounded_number_of_inputs():
    """Inputs crafted to share the sampled key (they differ only between sampled bytes)
    cannot grow one key's list without bound, which would make every lookup under it
    compare them all: past MAX_PER_KEY the oldest goes, and the byte count follows."""
    from paella.dispatcher.daemon.bundles import MAX_PER_KEY
    cache, b = FunctionalCache(), CountingBundle()
    xs = []
    for i in range(3 * MAX_PER_KEY):
        x = np.zeros(1 << 16, dtype=np.float32)
        x[1] = i + 1.0                               # between two samples: one key
        xs.append(x)
        cache.outputs("m", b, {"x": x})
    assert len({cache._key("m", {"x": x}) for x in xs}) == 1
    (chain,) = cache._entries.values()
    assert len(chain) == MAX_PER_KEY
    assert cache._bytes == MAX_PER_KEY * 2 * xs[0].nbytes
    runs = b.runs
    np.testing.assert_array_equal(cache.outputs("m", b, {"x": xs[-1].copy()})["y"], xs[-1] * 2)
    assert b.runs == runs                            # the newest: still cached
    np.testing.assert_array_equal(cache.outputs("m", b, {"x": xs[0].copy()})["y"], xs[0] * 2)
    assert b.runs == runs + 1                        # the oldest: gone, computed again


def test_a_stream_of_new_inputs_writes_a_bounded_log(caplog):
    """A client sending a new input each time: each costs a CPU run, but the log gets a
    few lines per interval, the rest counted (before: 3 MB in 10 s)."""
    cache, b = FunctionalCache(), CountingBundle()
    with caplog.at_level("INFO", logger="paella.daemon"):
        for i in range(200):
            cache.outputs("m", b, {"x": np.full(8, i, np.float32)})
    lines = [r for r in caplog.records if "computed reference outputs" in r.getMessage()]
    assert b.runs == 200 and 1 <= len(lines) <= 6, len(lines)


def test_a_lookup_begun_early_answers_from_the_comparison_thread():
    """begin() starts comparing (the simulated device calls it once a request's input is
    in device memory); outputs() with it answers the match without comparing again, the
    answer of an equal input even when that entry was evicted in between."""
    cache, b = FunctionalCache(max_bytes=4 * 8192), CountingBundle()
    x1, x2 = np.full(1024, 1.0, np.float32), np.full(1024, 2.0, np.float32)
    cache.outputs("m", b, {"x": x1})
    cache.outputs("m", b, {"x": x2})
    lookup = cache.begin("m", b, {"x": x1.copy()})
    assert lookup.pending is not None and len(lookup.candidates) == 1
    for i in range(3, 8):                              # evict x1's entry meanwhile
        cache.outputs("m", b, {"x": np.full(1024, float(i), np.float32)})
    runs, hits = b.runs, cache.hits
    np.testing.assert_array_equal(cache.finish("m", b, {"x": x1.copy()}, answer=lookup)["y"],
                                  x1 * 2)
    assert b.runs == runs and cache.hits == hits + 1


def test_a_first_seen_input_is_computed_at_begin_and_a_rejected_candidate_at_prepare():
    """No candidate under the key when begin() runs: the computation starts at once (it
    overlaps the request's kernels). A candidate the comparison rejects: prepare(), at
    the last kernel's launch, looks the input up again (another request may have cached
    it meanwhile), then computes."""
    cache, b = FunctionalCache(), CountingBundle()
    x = np.arange(4096, dtype=np.float32)
    empty = cache.begin("m", b, {"x": x})
    assert empty.pending is None and empty.candidates == [] and b.runs == 1
    np.testing.assert_array_equal(cache.finish("m", b, {"x": x}, answer=empty)["y"], x * 2)
    assert b.runs == 1 and cache.misses == 1
    other = x.copy()
    other[5] = -1.0                                    # not sampled: same key, a candidate
    lookup = cache.begin("m", b, {"x": other})
    assert len(lookup.candidates) == 1 and b.runs == 1
    cache.outputs("m", b, {"x": other.copy()})         # cached meanwhile, by another request
    assert b.runs == 2
    answer, pending = cache.prepare("m", b, {"x": other}, answer=lookup)
    assert pending is None and answer.outputs is not None and b.runs == 2
    np.testing.assert_array_equal(cache.finish("m", b, {"x": other}, answer=answer)["y"],
                                  other * 2)
    third = x.copy()
    third[6] = -2.0
    lookup = cache.begin("m", b, {"x": third})
    assert lookup.pending.result() == -1
    answer, _ = cache.prepare("m", b, {"x": third}, answer=lookup)
    assert answer.future is not None and b.runs == 3
    np.testing.assert_array_equal(cache.finish("m", b, {"x": third}, answer=answer)["y"], third * 2)


def test_a_computation_still_running_is_handed_to_the_device_and_cached_when_done():
    """prepare() returns the future of an answer still being computed (the device holds
    the last kernel until it is done); finish() caches the result, so the same input is a
    hit afterwards. A failed computation (a full queue, a crashed worker) raises from
    finish(): the request fails with the reason, nothing is cached."""
    from concurrent.futures import Future
    from paella.dispatcher.devices.sim.effect_workers import EffectQueueFull

    class Later:
        """A runner whose computations finish when the test says so."""
        def __init__(self):
            self.futures, self.max_queue, self.queued = [], None, 0

        def submit(self, fn, *args, bound=True, owner=None):
            f = Future()
            self.futures.append((f, fn, args))
            return f

    later = Later()
    cache, b = FunctionalCache(effects=later), CountingBundle()
    b.path = "/nonexistent"                      # (sent by reference to the workers)
    x = np.arange(64, dtype=np.float32)
    answer = cache.begin("m", b, {"x": x})
    answer, pending = cache.prepare("m", b, {"x": x}, answer=answer)
    (f, fn, args), = later.futures
    assert pending is f and not f.done() and args[0].path == "/nonexistent"
    f.set_result({"y": x * 2})
    np.testing.assert_array_equal(cache.finish("m", b, {"x": x}, answer=answer)["y"], x * 2)
    again, pending = cache.prepare("m", b, {"x": x.copy()})
    assert pending is None and again.outputs is not None and cache.hits == 1

    class Full:
        max_queue, queued = 1, 1

        def submit(self, fn, *args, bound=True, owner=None):
            raise EffectQueueFull("1 task is already waiting")
    cache = FunctionalCache(effects=Full())
    answer = cache.begin("m", b, {"x": x})
    try:
        cache.finish("m", b, {"x": x}, answer=answer)
    except EffectQueueFull as e:
        assert "already waiting" in str(e)
    else:
        raise AssertionError("a computation that could not start answered")
    assert not cache._entries


def test_a_lookup_of_inputs_the_thread_cannot_take_is_compared_in_outputs():
    cache, b = FunctionalCache(), CountingBundle()
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    cache.outputs("m", b, {"x": x[:, ::2]})            # not contiguous
    lookup = cache.begin("m", b, {"x": x[:, ::2]})
    assert lookup.pending is None and len(lookup.candidates) == 1
    np.testing.assert_array_equal(cache.finish("m", b, {"x": x[:, ::2]}, answer=lookup)["y"],
                                  x[:, ::2] * 2)
    assert b.runs == 1 and cache.hits == 1
