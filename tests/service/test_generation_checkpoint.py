"""Orca on the compiled iteration with a user's checkpoint, served by the real daemon
(issue 39, item 2): a model folder whose ``config.toml`` names a GPT-2 safetensors
file; two client processes stream its tokens at once, each checked against the numpy
reference computed from the same file; a client vanishing mid-generation gives its KV
slots back; bad checkpoints are skipped, each with its reason, and the rest served."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("safetensors")

from paella import rings
from paella.client import RequestFailed, connect
from paella.models.gpt import GPTConfig, generate_reference, gpt_weights
from paella.models.gpt_checkpoint import gpt2_names, load_checkpoint
from service_daemon import cleanup, start_daemon
from test_generation import GENERATE

#: The checkpoint's model: 16 KV slots hold one full-context generation.
CFG = GPTConfig(vocab=64, d=32, n_layer=2, n_head=2, n_ctx=16)
SEED = 7
OPTIONS = 'checkpoint = "model.safetensors"\nn_head = 2\nmax_bs = 2\nn_slots = 16\n'


def write(path: Path, edit=None, seed: int = SEED) -> None:
    from safetensors.numpy import save_file
    names = gpt2_names(CFG)
    tensors = {names[k]: np.array(v) for k, v in gpt_weights(CFG, seed).items()}
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(path))


BAD = {
    "bad-missing": (lambda t: t.pop("h.1.attn.c_proj.weight"), "tensor 'h.1.attn.c_proj.weight' is missing"),
    "bad-shape": (lambda t: t.__setitem__("h.0.mlp.c_fc.bias", np.zeros(7, np.float32)),
                  "'h.0.mlp.c_fc.bias' has shape (7,); expected (128,)"),
    "bad-dtype": (lambda t: t.__setitem__("wpe.weight", t["wpe.weight"].astype(np.float64)),
                  "'wpe.weight' has dtype float64"),
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    models = root / "models"
    for name in ("gpt-user", *BAD, "bad-truncated", "bad-absent", "unbuilt"):
        (models / name).mkdir(parents=True)
        (models / name / "config.toml").write_text(f'[batching]\nbatcher = "orca"\n{OPTIONS}')
    write(models / "gpt-user" / "model.safetensors")
    for name, (edit, _) in BAD.items():
        write(models / name / "model.safetensors", edit)
    write(models / "unbuilt" / "model.safetensors", seed=time.time_ns() % 2**31)   # weights never built
    whole = (models / "gpt-user" / "model.safetensors").read_bytes()
    (models / "bad-truncated" / "model.safetensors").write_bytes(whole[:len(whole) - 100])
    # Build the compiled iteration here first: the daemon finds it in the compile cache
    # (the same model and weights) instead of spending a minute at start-up.
    from paella.stepsched.compiled_iteration import CompiledIteration
    cfg, w = load_checkpoint(models / "gpt-user" / "model.safetensors", n_head=2)
    CompiledIteration(cfg, w, max_tokens=2 * cfg.n_ctx, max_slots=16, out=root / "warm").close()
    dp = start_daemon("--backend", "sim", "--models", str(models))
    dp.weights = w
    yield dp
    cleanup(dp)


def reference(dp, prompt, n):
    return generate_reference(CFG, dp.weights, prompt, n)


def test_bad_checkpoints_are_skipped_with_their_reason(daemon):
    with connect(daemon.socket) as c:
        names = set(c.models)
    assert "gpt-user" in names and not names & {*BAD, "bad-truncated", "bad-absent"}
    log = daemon.log()
    for name, (_, reason) in BAD.items():
        line = next(ln for ln in log.splitlines() if f"{name} not served" in ln)
        assert reason in line, line
    assert any("bad-truncated not served" in ln and "cannot be read as safetensors" in ln
               for ln in log.splitlines())
    assert any("bad-absent not served" in ln and "does not exist" in ln for ln in log.splitlines())
    # The daemon does not compile (its plug-in calls must be short): the command that does.
    line = next(ln for ln in log.splitlines() if "unbuilt not served" in ln)
    assert "is not built yet: build it with `python -m paella.stepsched.compiled_iteration" in line
    assert "unbuilt" not in names


#: test_generation's client process, on this model.
GENERATE = GENERATE.replace('"gpt-tiny"', '"gpt-user"')


def test_two_client_processes_stream_the_checkpoints_tokens(daemon):
    start = time.time() + 2.0            # both start at once, after their imports
    prompts = ([3, 7, 1, 9], [60, 2, 2, 5, 11])
    jobs = {tuple(p): subprocess.Popen(
        [sys.executable, "-c", f"SOCK = {daemon.socket!r}\n" + GENERATE, json.dumps([p, 8, start])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in prompts}
    for prompt, proc in jobs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        r = json.loads(out)
        assert r["tokens"] == reference(daemon, list(prompt), 8)
        assert r["first"] < r["end"]                  # streamed: the first token came early


def test_token_ids_outside_the_vocabulary_fail_that_request_alone(daemon):
    with connect(daemon.socket) as c:
        with pytest.raises(RequestFailed) as e:
            list(c.generate("gpt-user", [1, 64], 3, timeout=30))
        assert e.value.status == rings.E_OPTIONS and "outside the vocabulary [0, 64)" in str(e.value)
        assert list(c.generate("gpt-user", [1, 2], 3, timeout=30)) == reference(daemon, [1, 2], 3)


VANISH = textwrap.dedent('''
    import os
    import paella
    c = paella.connect(SOCK)
    g = c.generate("gpt-user", [1, 2], 14, timeout=60)
    next(g)                      # its first token: the generation holds its 16 slots
    print(c.in_flight, flush=True)       # 1: its completion not seen yet
    os._exit(0)                  # gone mid-generation, socket and all
''')


def test_a_client_vanishing_mid_generation_gives_its_kv_slots_back(daemon):
    """16 slots hold one 16-token generation: the next one is admitted only once the
    vanished client's slots are back (13 more iterations after its first token, about
    as many effect round trips: it is still running when the client's process ends)."""
    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", f"SOCK = {daemon.socket!r}\n" + VANISH],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        with connect(daemon.socket) as c:          # needs all 16 slots
            assert list(c.generate("gpt-user", [4, 3], 14, timeout=30)) == reference(daemon, [4, 3], 14)
        if r.stdout.strip() == "1":
            return
    pytest.fail("the client never vanished mid-generation in 3 attempts")
