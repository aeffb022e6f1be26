"""The network front end's streaming protocols against a real daemon serving the tiny GPT
(``orca``) and ``echo``: gRPC ``ModelStreamInfer`` with the unmodified ``tritonclient``,
and the OpenAI-compatible API with the ``openai`` package. Every token is checked
against ``generate_reference`` (the same seeded weights, recomputed in numpy)."""
from __future__ import annotations

import json
import queue

import numpy as np
import pytest

tritongrpc = pytest.importorskip("tritonclient.grpc")
openai = pytest.importorskip("openai")

from service_daemon import cleanup, start_daemon, start_kserve  # noqa: E402
from test_generation import CFG, W, generate_reference, model_repository  # noqa: E402

#: The words of the test tokenizer: word i is token id i.
WORDS = [f"w{i}" for i in range(CFG.vocab)]


def write_tokenizer(path) -> None:
    """A word-level tokenizer.json (the ``tokenizers`` library's format): "w5" is id 5."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(path))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("fe")
    models = model_repository(root)
    (models / "gpt-text").mkdir()
    write_tokenizer(models / "gpt-text" / "tokenizer.json")
    (models / "gpt-text" / "config.toml").write_text(
        'tokenizer = "tokenizer.json"\n[batching]\nbatcher = "orca"\nconfig = "tiny"\n'
        'max_bs = 4\nn_slots = 256\n')
    dp = start_daemon("--backend", "sim", "--models", str(models),
                      env={"PYTHONPATH": str(root / "plugin")})
    yield dp
    cleanup(dp)


@pytest.fixture(scope="module")
def front(daemon):
    proc, hp, gp, log = start_kserve(daemon.socket)
    yield hp, gp, log
    proc.terminate()
    assert proc.wait(15) == 0, log.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()


def _stream(gp: int, requests: list[tuple[str, list, dict]], timeout: float = 30.0) -> list:
    """Send ``requests`` (model, inputs, keyword arguments) on one stream; every result
    (InferResult or error) until each request had its final response."""
    got: queue.Queue = queue.Queue()
    c = tritongrpc.InferenceServerClient(f"127.0.0.1:{gp}")
    c.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        for model, inputs, kw in requests:
            c.async_stream_infer(model, inputs, enable_empty_final_response=True, **kw)
        out, finals = [], 0
        while finals < len(requests):
            result, error = got.get(timeout=timeout)
            out.append((result, error))
            if error is not None:
                finals += 1
            else:
                p = result.get_response().parameters
                finals += p["triton_final_response"].bool_param
        return out
    finally:
        c.stop_stream()
        c.close()


def _gen_inputs(prompt: list[int], max_tokens: int, cap: int = 64) -> list:
    p = tritongrpc.InferInput("prompt", [cap], "INT32")
    p.set_data_from_numpy(np.array(prompt + [0] * (cap - len(prompt)), np.int32))
    n = tritongrpc.InferInput("lengths", [2], "INT32")
    n.set_data_from_numpy(np.array([len(prompt), max_tokens], np.int32))
    return [p, n]


def test_grpc_stream_generation_one_response_per_token_then_final(front):
    _, gp, _ = front
    want = generate_reference(CFG, W, [3, 1, 4], 9)
    got = _stream(gp, [("gpt-tiny", _gen_inputs([3, 1, 4], 9), {"request_id": "g1",
                                                                "priority": 1})])
    assert all(e is None for _, e in got), got
    tokens = [int(r.as_numpy("token")[0]) for r, _ in got[:-1]]
    assert tokens == want
    idx = [r.get_response().parameters["index"].int64_param for r, _ in got[:-1]]
    assert idx == list(range(9))
    last = got[-1][0].get_response()
    assert last.id == "g1" and last.parameters["triton_final_response"].bool_param
    assert last.parameters["n_tokens"].int64_param == 9 and not last.outputs


def test_grpc_stream_prompt_ids_form_and_interleaved_requests(front):
    """Two generations and an echo on one stream: each answered fully, matched by id."""
    _, gp, _ = front
    ids = tritongrpc.InferInput("prompt_ids", [2], "INT32")
    ids.set_data_from_numpy(np.array([5, 9], np.int32))
    x = np.arange(256, dtype=np.float32)
    e = tritongrpc.InferInput("x", [256], "FP32")
    e.set_data_from_numpy(x)
    got = _stream(gp, [("gpt-tiny", [ids], {"request_id": "a", "parameters": {"max_tokens": 6}}),
                       ("gpt-tiny", _gen_inputs([2], 4), {"request_id": "b"}),
                       ("echo", [e], {"request_id": "c"})])
    by_id: dict[str, list] = {}
    for r, err in got:
        assert err is None, err
        by_id.setdefault(r.get_response().id, []).append(r)
    assert [int(r.as_numpy("token")[0]) for r in by_id["a"][:-1]] == \
        generate_reference(CFG, W, [5, 9], 6)
    assert [int(r.as_numpy("token")[0]) for r in by_id["b"][:-1]] == \
        generate_reference(CFG, W, [2], 4)
    [echo] = by_id["c"]
    assert np.array_equal(echo.as_numpy("y"), x)


def test_grpc_stream_errors_are_responses_and_the_stream_goes_on(front):
    _, gp, _ = front
    bad = tritongrpc.InferInput("x", [3], "FP32")
    bad.set_data_from_numpy(np.zeros(3, np.float32))
    got = _stream(gp, [("echo", [bad], {"request_id": "bad"}),
                       ("nope", [bad], {"request_id": "unknown"}),
                       ("gpt-tiny", _gen_inputs([1], 3), {"request_id": "ok"})])
    errors = [str(err) for _, err in got if err is not None]
    assert len(errors) == 2
    assert any("shape [256]" in e for e in errors) and any("unknown model" in e for e in errors)
    ok = [r for r, err in got if err is None]
    assert [int(r.as_numpy("token")[0]) for r in ok[:-1]] == generate_reference(CFG, W, [1], 3)


def _openai(hp: int):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{hp}/v1", api_key="none", max_retries=0)


def test_openai_models_and_completions(front):
    hp, _, _ = front
    client = _openai(hp)
    names = sorted(m.id for m in client.models.list())
    assert "gpt-tiny" in names and "echo" not in names
    want = generate_reference(CFG, W, [3, 1, 4], 7)
    r = client.completions.create(model="gpt-tiny", prompt=[3, 1, 4], max_tokens=7)
    assert r.object == "text_completion" and r.model == "gpt-tiny"
    assert r.choices[0].finish_reason == "length" and r.choices[0].text == ""
    assert r.choices[0].model_extra["token_ids"] == want
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 7, 10)


def test_openai_stream_chunks_then_done(front):
    hp, _, _ = front
    client = _openai(hp)
    want = generate_reference(CFG, W, [2, 7], 5)
    chunks = list(client.completions.create(model="gpt-tiny", prompt=[2, 7], max_tokens=5,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    tokens = [t for c in chunks for ch in c.choices for t in ch.model_extra["token_ids"]]
    assert tokens == want
    finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
    # the raw stream ends with OpenAI's [DONE] sentinel
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", hp, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": "gpt-tiny", "prompt": [2],
                                                        "max_tokens": 2, "stream": True}),
                 {"Content-Type": "application/json"})
    body = conn.getresponse().read().decode()
    conn.close()
    assert body.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("kw, status, text", [
    ({"prompt": "hello"}, 400, "has no tokenizer"),
    ({"prompt": [1], "n": 2}, 400, "n must be 1"),
    ({"prompt": [1], "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": [1, "x"]}, 400, "token ids"),
    ({"prompt": [1], "echo": True}, 400, "echo is not supported"),
    ({"prompt": [1], "model": "echo"}, 404, "not generative"),
    ({"prompt": [1], "model": "nope"}, 404, "does not exist"),
    ({"prompt": [CFG.vocab + 5], "max_tokens": 2}, 400, "outside the vocabulary"),
    ({"prompt": [1, 2], "max_tokens": 63}, 400, "exceeds the model's context"),
])
def test_openai_errors_in_openais_format(front, kw, status, text):
    hp, _, _ = front
    client = _openai(hp)
    kw = {"model": "gpt-tiny", "max_tokens": 3, **kw}
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**kw)
    assert e.value.status_code == status
    err = e.value.body
    assert text in err["message"], err
    assert {"message", "type", "param", "code"} <= set(err)


def test_openai_text_prompts_with_the_models_tokenizer(front):
    """A model whose config.toml names a tokenizer takes text, and answers text."""
    hp, _, _ = front
    client = _openai(hp)
    want = generate_reference(CFG, W, [3, 1, 4], 6)
    r = client.completions.create(model="gpt-text", prompt="w3 w1 w4", max_tokens=6)
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.choices[0].text == " ".join(WORDS[t] for t in want)
    assert r.usage.prompt_tokens == 3
    chunks = list(client.completions.create(model="gpt-text", prompt="w3 w1 w4", max_tokens=6,
                                            stream=True))
    text = "".join(ch.text for c in chunks for ch in c.choices)
    assert text == " ".join(WORDS[t] for t in want)
