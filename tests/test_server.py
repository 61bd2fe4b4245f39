"""Capture from a vLLM OpenAI-compatible server (``vc.Server``), through its ``/collective_rpc``.

Without an engine: the JSON transport of bytes, and how ``Server`` reports what a server answers
(a stub HTTP server). With one (``engine``): vLLM's own API server on the tiny Llama, in a process
of its own, started as the README says; requests go through ``/v1/completions`` and the rows
come back through ``/dev/shm`` (this host) or as base64 text (a client elsewhere), equal to each
other and to transformers' forward on the same weights.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch

import vllm_capture as vc
from tests.engine_support import (
    BLOCK_SIZE,
    ENGINE_KWARGS,
    MAX_BATCHED_TOKENS,
    MAX_MODEL_LEN,
    HFReference,
    assert_close_rows,
    brute_force_positions,
    owner_of,
    random_prompt,
)
from vllm_capture.engine.config import WORKER_EXTENSION
from vllm_capture.session import shm
from vllm_capture.session.wire import (
    TEXT_BYTES_KEY,
    bytes_as_text,
    bytes_from_text,
    deserialize_captured,
    serialize_capture_layer,
)

NUM_LAYERS = 4
RTOL = ATOL = 1e-5  # as test_engine_dense.py
START_TIMEOUT_S = 600


# ---- without an engine --------------------------------------------------------------------------

def test_bytes_as_text_carries_a_fetch_reply_through_json():
    rows = torch.randn(5, 7).to(torch.bfloat16)
    labels = torch.tensor([[0, p, 10 + p] for p in range(5)], dtype=torch.int32)
    reply = {"tp_rank": 0, "layers": {"3": serialize_capture_layer(rows, labels, ["a-1"], "l3")}}
    text = json.dumps(bytes_as_text(reply))
    back = bytes_from_text(json.loads(text))
    tensors, meta = deserialize_captured(back["layers"])
    assert torch.equal(tensors[3], rows)
    assert meta[3].req_ids == ["a-1"] * 5 and meta[3].positions.tolist() == list(range(5))
    assert back["tp_rank"] == 0


@pytest.mark.parametrize("bad", [{TEXT_BYTES_KEY: "not base64!"}, {TEXT_BYTES_KEY: 3}])
def test_bytes_from_text_refuses_what_is_not_base64(bad):
    with pytest.raises(ValueError, match=TEXT_BYTES_KEY):
        bytes_from_text({"layers": [bad]})


@pytest.mark.parametrize("kwargs, field", [
    (dict(url="localhost:8000"), "url"),
    (dict(url="http://h:1", timeout=0), "timeout"),
    (dict(url="http://h:1", timeout=True), "timeout"),
    (dict(url="http://h:1", timeout=float("nan")), "timeout"),
    (dict(url="http://h:1", timeout=float("inf")), "timeout"),
])
def test_server_refuses_bad_arguments(kwargs, field):
    url = kwargs.pop("url")
    with pytest.raises(ValueError, match=f"^{field}:"):
        vc.Server(url, **kwargs)


def test_capture_refuses_a_server():
    server = vc.Server("http://127.0.0.1:9")
    for call in (lambda: vc.capture(server, ["a"]), lambda: vc.capture_batches(server, ["a"])):
        with pytest.raises(TypeError, match="start_capture and fetch_captured"):
            call()


class _Stub(http.server.BaseHTTPRequestHandler):
    """Answers every POST with the class's ``status`` and ``body`` after ``delay`` seconds;
    keeps what it was sent."""

    status, body, seen, delay = 200, b"", [], 0.0

    def do_POST(self):  # noqa: N802 (http.server's name)
        length = int(self.headers["Content-Length"])
        type(self).seen.append((self.path, dict(self.headers), json.loads(self.rfile.read(length))))
        time.sleep(self.delay)
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub():
    _Stub.seen, _Stub.delay = [], 0.0
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield _Stub, f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()


def _answer(stub_cls, status: int, body) -> None:
    stub_cls.status = status
    stub_cls.body = body if isinstance(body, bytes) else json.dumps(body).encode()


def test_server_sends_the_rpc_as_vllm_dev_endpoint_reads_it(stub):
    cls, url = stub
    _answer(cls, 200, {"results": [{"tp_rank": 0, "layouts": {"2": {"width": 8}}}]})
    select = vc.SelectSpec(prompt_positions=(-1,))
    status = vc.start_capture(vc.Server(url, api_key="k"), vc.HIDDEN_STATES, layers=range(2),
                              dtype=torch.float16, select=select)
    path, headers, body = cls.seen[0]
    assert path == "/collective_rpc" and headers["Authorization"] == "Bearer k"
    assert body == {"method": "start_capture", "kwargs": {},
                    "args": ["hidden_states", {"layers": [0, 1], "dtype": "torch.float16",
                                               "select": select.to_wire()}]}
    assert status["layouts"] == {2: {"width": 8}}  # int layer ids, as from vllm.LLM


def test_server_raises_the_workers_error_as_its_type(stub):
    cls, url = stub
    message = ("Call to collective_rpc method failed: Worker failed with error '[vllm-capture "
               "ValueError] stream: unknown capture stream 'x'', please check the stack trace "
               "above for the root cause")
    _answer(cls, 500, {"error": {"message": message, "type": "InternalServerError", "code": 500}})
    with pytest.raises(ValueError, match=r"^stream: unknown capture stream 'x'$"):
        vc.start_capture(vc.Server(url), "x")


def test_server_names_what_the_server_lacks(stub):
    cls, url = stub
    _answer(cls, 404, {"detail": "Not Found"})
    with pytest.raises(RuntimeError, match="VLLM_SERVER_DEV_MODE=1"):
        vc.capture_status(vc.Server(url))
    _answer(cls, 500, {"error": {"message": "Worker failed with error ''Worker' object has no "
                                            "attribute 'capture_status''"}})
    with pytest.raises(RuntimeError, match=f"worker_extension_cls='{WORKER_EXTENSION}'"):
        vc.capture_status(vc.Server(url))
    _answer(cls, 200, b"<html>")
    with pytest.raises(RuntimeError, match="unexpected reply"):
        vc.capture_status(vc.Server(url))


def test_a_server_that_does_not_answer_in_time(stub):
    cls, url = stub
    _answer(cls, 200, {"results": [{"tp_rank": 0, "tp_size": 1, "layers": {}}]})
    cls.delay = 2.0
    with pytest.raises(TimeoutError, match="clear=True has then dropped the rows"):
        vc.fetch_captured(vc.Server(url, timeout=0.2), vc.HIDDEN_STATES)


def test_server_that_is_not_there():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        vc.capture_status(vc.Server(f"http://127.0.0.1:{port}"))


# ---- vLLM's API server on the tiny Llama --------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def served(model_path, tmp_path_factory):
    """(Server, model path): vLLM's API server with capture, started as the README says."""
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    # eager: the compiled path is the other engine tests'; this one is about the transport.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model_path), "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
               "--dtype", ENGINE_KWARGS["dtype"], "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
               "--max-num-seqs", str(ENGINE_KWARGS["max_num_seqs"]),
               "--block-size", str(BLOCK_SIZE), "--seed", "0",
               "--additional-config", json.dumps({"capture": {}}),
               "--worker-extension-cls", WORKER_EXTENSION]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the API server did not start:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        yield vc.Server(url), model_path
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _complete(server: vc.Server, model_path, prompts, max_tokens: int, request_id: str,
              xargs: dict | None = None) -> list[list[int]]:
    """Greedy completions of token-id prompts; every token each request fed (the prompt, then
    each generated token but the last)."""
    body = {"model": str(model_path), "prompt": prompts, "max_tokens": max_tokens,
            "temperature": 0.0, "return_token_ids": True}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    request = urllib.request.Request(
        f"{server.url}/v1/completions", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    with urllib.request.urlopen(request, timeout=300) as response:
        reply = json.loads(response.read())
    assert reply["id"] == f"cmpl-{request_id}"
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    assert [c["prompt_token_ids"] for c in choices] == prompts
    return [p + c["token_ids"][:-1] for p, c in zip(prompts, choices)]


def _fetch(server, monkeypatch, *, shared: bool, **kwargs):
    """A fetch, with the rows through /dev/shm (``shared``) or as base64 text in the reply, as a
    client on another host gets them (it cannot show the workers a probe file); checks which."""
    transports = []
    read_replies = shm.read_replies

    def spy(replies):
        transports.extend("shm" if "shm_path" in r else "text" for r in replies)
        return read_replies(replies)

    with monkeypatch.context() as m:
        m.setattr(shm, "read_replies", spy)
        if not shared:
            m.setattr(shm, "client_probe", lambda: None)
        result = vc.fetch_captured(server, vc.HIDDEN_STATES, **kwargs)
    assert transports == ["shm" if shared else "text"]
    return result


@pytest.mark.engine
def test_rows_over_the_server_match_transformers(served, monkeypatch):
    server, model_path = served
    rng = np.random.default_rng(11)
    prompts = [random_prompt(rng, n) for n in (5, 90)]  # 90: a chunked prefill
    selected_prompt = [random_prompt(rng, 12)]
    select = vc.SelectSpec(prompt_positions=(0, -1), generation_positions=(1,)).to_wire()
    vc.start_capture(server, vc.HIDDEN_STATES, reduce="all")
    try:
        fed = _complete(server, model_path, prompts, 4, "plain")
        fed += _complete(server, model_path, selected_prompt, 4, "picked",
                         xargs={"capture": json.dumps(select)})
        as_text = _fetch(server, monkeypatch, shared=False, clear=False)
        one = _fetch(server, monkeypatch, shared=True, clear=False, req_ids=["cmpl-plain-1"])
        tensors, meta, layouts = _fetch(server, monkeypatch, shared=True)
        assert vc.capture_status(server, vc.HIDDEN_STATES)["tokens_stored"] == 0
    finally:
        vc.stop_capture(server, vc.HIDDEN_STATES)

    request_ids = ["cmpl-plain-0", "cmpl-plain-1", "cmpl-picked-0"]
    wanted = [set(range(len(f))) for f in fed[:2]]
    wanted.append(brute_force_positions(select, selected_prompt[0], fed[2][12:]))
    hf = HFReference(model_path)
    assert sorted(tensors) == list(range(NUM_LAYERS))
    for layer in range(NUM_LAYERS):
        assert torch.equal(as_text[0][layer], tensors[layer]), "base64 and /dev/shm rows differ"
        assert as_text[1][layer].req_ids == meta[layer].req_ids
        assert layouts[layer]["width"] == tensors[layer].shape[1]
        owner = owner_of(meta[layer], request_ids)
        assert (owner >= 0).all(), "a row of no request sent"
        for i, f in enumerate(fed):
            rows = np.flatnonzero(owner == i)
            positions = meta[layer].positions[rows].long()
            assert set(positions.tolist()) == wanted[i] and len(rows) == len(wanted[i])
            assert meta[layer].token_ids[rows].tolist() == [f[p] for p in positions.tolist()]
            assert_close_rows(tensors[layer][rows], hf.run(f)["hidden_states"][layer][positions],
                              rtol=RTOL, atol=ATOL, what=f"layer {layer} request {i}")
            if i == 1:
                assert torch.equal(one[0][layer], tensors[layer][rows])
    assert sorted(one[0]) == sorted(tensors)


@pytest.mark.engine
def test_last_token_over_the_server(served, monkeypatch):
    server, model_path = served
    rng = np.random.default_rng(12)
    prompts = [random_prompt(rng, n) for n in (3, 40, 70)]
    status = vc.start_capture(server, vc.HIDDEN_STATES, reduce="last", layers=[1, 3])
    assert sorted(status["layouts"]) == list(range(NUM_LAYERS))
    try:
        fed = _complete(server, model_path, prompts, 3, "last")
        tensors, meta, _ = _fetch(server, monkeypatch, shared=False)
    finally:
        vc.stop_capture(server, vc.HIDDEN_STATES)
    hf = HFReference(model_path)
    assert sorted(tensors) == [1, 3]
    for layer in (1, 3):
        owner = owner_of(meta[layer], [f"cmpl-last-{i}" for i in range(len(prompts))])
        assert sorted(owner.tolist()) == [0, 1, 2]
        for row, i in enumerate(owner.tolist()):
            last = len(fed[i]) - 1
            assert meta[layer].positions[row] == last
            assert_close_rows(tensors[layer][row:row + 1],
                              hf.run(fed[i])["hidden_states"][layer][last:last + 1],
                              rtol=RTOL, atol=ATOL, what=f"layer {layer} request {i}")


@pytest.mark.engine
def test_worker_errors_over_the_server(served):
    server, _ = served
    with pytest.raises(ValueError, match="^stream: unknown capture stream 'nonsense'"):
        vc.start_capture(server, "nonsense")
    with pytest.raises(ValueError, match="reduce"):
        vc.start_capture(server, vc.HIDDEN_STATES, reduce="median")
    with pytest.raises(ValueError, match="^layers must be a list"):
        vc.fetch_captured(server, vc.HIDDEN_STATES, layers="3")
