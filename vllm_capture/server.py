"""A running vLLM OpenAI-compatible server, as the ``llm`` of the low-level capture calls.

    server = vc.Server("http://localhost:8000")
    vc.start_capture(server, vc.HIDDEN_STATES, reduce="last")
    ...  # requests through the server's own API (/v1/completions, /v1/chat/completions)
    tensors, meta, layouts = vc.fetch_captured(server, vc.HIDDEN_STATES)

The server must have been started with capture installed (``--additional-config
'{"capture": {}}' --worker-extension-cls vllm_capture.engine.worker_ext.CaptureWorkerExtension``)
and with ``VLLM_SERVER_DEV_MODE=1``, which serves vLLM's ``/collective_rpc`` endpoint: the
capture calls reach the workers through it, as ``vllm.LLM.collective_rpc`` does in process. That
endpoint calls any worker method for anyone who can reach the port (vLLM's ``--api-key`` does
not guard it); keep such a server private.

The endpoint speaks JSON, so a fetch's rows ride as base64 text, except on the server's own host,
where they come through ``/dev/shm`` as they do from an in-process engine.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from vllm_capture.session.wire import bytes_from_text

# The socket layer's limit turns a larger timeout into an OverflowError at the first call.
_LONGEST_TIMEOUT_S = 1e9


class Server:
    """The capture RPCs of one vLLM server at ``url`` (``http://host:port``).

    ``timeout``: seconds to wait for the server's answer, which starts only once every worker
    has done the call (a fetch of many rows takes longest), and then for each read of it.
    ``api_key``: sent as a bearer token, for a proxy in front of the server that wants one
    (vLLM's ``--api-key`` does not guard ``/collective_rpc``).
    """

    def __init__(self, url: str, *, timeout: float = 600.0, api_key: str | None = None):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected the server's http:// or https:// address, got {url!r}")
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not 0 < timeout < _LONGEST_TIMEOUT_S):
            raise ValueError(f"timeout: expected a positive, finite number of seconds, got "
                             f"{timeout!r}")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.api_key = api_key

    def __repr__(self) -> str:
        return f"Server({self.url!r})"

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """``method`` on every worker of the server, as ``vllm.LLM.collective_rpc``: one result
        per worker. A worker's error raises ``RuntimeError`` with the server's message."""
        body: dict[str, Any] = {"method": method, "args": list(args), "kwargs": kwargs or {}}
        if timeout is not None:
            body["timeout"] = timeout
        headers = {"Content-Type": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(f"{self.url}/collective_rpc", method="POST",
                                         data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(self._failure(method, exc.code, exc.read())) from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise self._timed_out(method) from None
            raise ConnectionError(f"{self.url}: {exc.reason}") from None
        except TimeoutError:
            raise self._timed_out(method) from None
        if not text:  # the endpoint's reply when every worker returned None
            return []
        try:
            results = json.loads(text)["results"]
        except (ValueError, KeyError, TypeError):
            raise RuntimeError(f"{self.url}/collective_rpc: unexpected reply {text[:200]!r}") from None
        return bytes_from_text(results)

    def _timed_out(self, method: str) -> TimeoutError:
        return TimeoutError(
            f"{self.url}: no answer to {method} within {self.timeout:g} s. The workers may have "
            f"done the call all the same: a fetch with clear=True has then dropped the rows it "
            f"fetched. Fetch large captures in parts (layers=, req_ids=) or with clear=False "
            f"then clear_captured, or give Server a longer timeout")

    def _failure(self, method: str, status: int, text: bytes) -> str:
        if status == 404:
            return (f"{self.url} serves no /collective_rpc: start the server with "
                    f"VLLM_SERVER_DEV_MODE=1")
        try:
            error = json.loads(text)
            message = error.get("error", {}).get("message") or error.get("detail") or str(error)
        except (ValueError, AttributeError):
            message = text.decode(errors="replace")
        return f"{self.url}/collective_rpc {method} failed (HTTP {status}): {message}"
