"""The serving rows: start one engine's OpenAI server, warm it, drive it with `vllm bench serve`, stop it.

Stdlib only (it runs in the orchestrator). Each server starts in a session of its own so stopping it ends its
whole process tree (vLLM's engine core is a child process), and an orchestrator that dies leaves no server behind
as long as its `finally` or the shell script's trap runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from compare_vllm.workloads import Sizes, TokenSource

SERVED_MODEL_NAME = "smollm2"  # both servers answer to it, so the client's --model is the same for both
READY_TIMEOUT_S = 900  # a first vLLM start compiles the model: minutes on two cores


def _pid_file() -> str | None:
    return os.environ.get("COMPARE_VLLM_PID_FILE")


def track(pid: int) -> None:
    """Notes a child's process group in $COMPARE_VLLM_PID_FILE: compare_vllm.sh's trap ends what is listed there
    even if this process is killed outright and its `finally` never runs."""
    if path := _pid_file():
        with open(path, "a") as f:
            f.write(f"{pid}\n")


def untrack(pid: int) -> None:
    if not (path := _pid_file()):
        return
    with contextlib.suppress(OSError):
        with open(path) as f:
            kept = [line for line in f if line.strip() != str(pid)]
        with open(path, "w") as f:
            f.writelines(kept)


class SideFailed(RuntimeError):
    """One engine's part failed; the message says which, what and where its log is."""


def log_tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def _get_text(url: str, timeout: float) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name (labels dropped) -> the sum of its samples: enough for the counters read here."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def prometheus_labels(text: str, metric: str) -> dict[str, str]:
    """The labels of the first sample of `metric` (vLLM reports its cache config as an info metric's labels)."""
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            body = line[len(metric) + 1 : line.rindex("}")]
            labels = {}
            for part in body.split('",'):
                key, _, value = part.partition('="')
                labels[key.strip()] = value.rstrip('"')
            return labels
    return {}


class Server:
    """One engine's server process; a context manager that always stops it."""

    def __init__(self, engine: str, argv: list[str], env: dict[str, str], port: int, log_path: str) -> None:
        self.engine, self.argv, self.env, self.port, self.log_path = engine, argv, env, port, log_path
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        with open(self.log_path, "w") as log:
            log.write("$ " + shlex.join(self.argv) + "\n")  # which model and flags it ran, as the parts' logs say
            log.flush()
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        track(self.proc.pid)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def fail(self, what: str) -> SideFailed:
        return SideFailed(f"{self.engine} server: {what}; log {self.log_path}, last lines:\n{log_tail(self.log_path)}")

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise self.fail(f"exited with status {self.proc.returncode} before it was ready")
            with contextlib.suppress(OSError, urllib.error.URLError):
                if _get_text(self.base_url + "/health", timeout=5) is not None:
                    return
            time.sleep(2)
        raise self.fail(f"not ready after {timeout_s:.0f} s")

    def warm_up(self, sizes: Sizes) -> None:
        """Untimed: a short prompt, then one as long as the served shared-prefix prompts (unrelated ids)."""
        src = TokenSource(seed=12345)
        for n in (16, sizes.shared_prefix_tokens + sizes.shared_suffix_tokens):
            body = {"model": SERVED_MODEL_NAME, "prompt": src.tokens(n), "max_tokens": 1, "temperature": 0}
            try:
                _post_json(self.base_url + "/v1/completions", body, timeout=600)
            except (OSError, urllib.error.URLError) as exc:
                raise self.fail(f"warm-up request failed ({exc})") from exc

    def check_stream_usage(self, max_tokens: int = 4) -> None:
        """`vllm bench serve` counts output tokens from the usage chunk a stream ends with when the request sets
        stream_options.include_usage; a server that leaves it out would be credited with re-tokenized text."""
        body = {
            "model": SERVED_MODEL_NAME,
            "prompt": TokenSource(seed=54321).tokens(16),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        req = urllib.request.Request(
            self.base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        usage = None
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if line.startswith("data: {"):
                        chunk = json.loads(line[len("data: ") :])
                        if chunk.get("usage") and not chunk.get("choices"):
                            usage = chunk["usage"]
        except (OSError, urllib.error.URLError, ValueError) as exc:
            raise self.fail(f"streamed request failed ({exc})") from exc
        if not usage or usage.get("completion_tokens") != max_tokens:
            raise self.fail(
                f"a stream with stream_options.include_usage ended with usage {usage!r}, not a usage "
                f"chunk counting {max_tokens} completion tokens"
            )

    def metrics(self) -> str:
        try:
            return _get_text(self.base_url + "/metrics", timeout=30)
        except (OSError, urllib.error.URLError) as exc:
            raise self.fail(f"/metrics failed ({exc})") from exc

    def stop(self) -> None:
        """SIGTERM to the server's process group (vLLM's engine core included), SIGKILL after a minute."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):  # whatever is left, children that outlived their parent too
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        untrack(self.proc.pid)


@contextlib.contextmanager
def running(server: Server) -> Iterator[Server]:
    with server:
        server.wait_ready()
        yield server
