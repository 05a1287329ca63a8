"""Fuzz a real `python -m prefixkv.server` with schemathesis, driven by its own /openapi.json.

    python scripts/fuzz_server.py [--max-time 240] [--max-examples 60] [--workers 1] [-- extra schemathesis args]

Installs schemathesis into this interpreter's environment if it is missing, starts a server on 127.0.0.1 (small KV
pool, short context, an API key), runs schemathesis bounded in time, and reports two numbers that must both be 0:
server errors (5xx) and error answers whose body is not their API's shape: OpenAI's {"error": {"message", "type",
"param", "code"}}, Anthropic's {"type": "error", "error": {"type", "message"}} on /v1/messages, or Google's
{"error": {"code", "message", "status"}} under /v1beta and on /v1/models/{model}:METHOD (the Gemini API).
Exit status 0 only then. Not part of the test suite (it takes minutes); the server's log and schemathesis's
report land in --out (default: a temporary directory).

This file is also the schemathesis hooks module (SCHEMATHESIS_HOOKS=fuzz_server): importing it from schemathesis
registers the error-body check.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "fuzz-key"
ERROR_FIELDS = {"message", "type", "param", "code"}
GEMINI_ERROR_FIELDS = {"code", "message", "status"}
GEMINI_V1 = re.compile(r"/v1/models/[^/]+:\w+")  # Gemini's model methods under v1, beside OpenAI's /v1 routes
CHECKS = (
    "not_a_server_error,status_code_conformance,response_schema_conformance,content_type_conformance,"
    "negative_data_rejection,api_error_body"
)


def error_problem(status: int, body: bytes, path: str = "") -> str | None:
    """Why an error answer is not in its API's shape (Anthropic's under /v1/messages, Google's under /v1beta and
    on Gemini's v1 model methods, OpenAI's elsewhere), or None when it is (or when it is not an error)."""
    if status < 400:
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return f"{status} with a body that is not JSON: {body[:200]!r}"
    error = payload.get("error") if isinstance(payload, dict) else None
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        if not isinstance(error, dict) or set(payload) != {"type", "error"} or set(error) != {"type", "message"}:
            return f"{status} with a body that is not Anthropic's error shape: {str(payload)[:200]}"
    elif path.startswith("/v1beta/") or GEMINI_V1.fullmatch(path):
        if not isinstance(error, dict) or set(payload) != {"error"} or set(error) != GEMINI_ERROR_FIELDS:
            return f"{status} with a body that is not Gemini's error shape: {str(payload)[:200]}"
        if error["code"] != status or not isinstance(error["status"], str):
            return f"{status} with a Gemini error body whose code or status is wrong: {str(payload)[:200]}"
    elif not isinstance(error, dict) or set(payload) != {"error"} or set(error) != ERROR_FIELDS:
        return f"{status} with a body that is not OpenAI's error shape: {str(payload)[:200]}"
    if not isinstance(error["message"], str) or not error["message"]:
        return f"{status} with an empty error message"
    return None


def _register_check() -> None:
    import schemathesis

    @schemathesis.check
    def api_error_body(ctx, response, case):
        """Every non-2xx answer carries its API's error body, so each SDK raises the right exception."""
        problem = error_problem(response.status_code, response.content or b"", case.path)
        if problem is not None:
            raise AssertionError(problem)


if __name__ != "__main__":  # imported by schemathesis as its hooks module
    _register_check()


def _ensure_schemathesis() -> None:
    if importlib.util.find_spec("schemathesis") is None:
        print("installing schemathesis into", sys.prefix, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "schemathesis"], check=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(base: str, proc: subprocess.Popen, log_path: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path) as f:
                raise SystemExit(f"server exited:\n{f.read()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not become healthy")


def _tally(ndjson: str) -> tuple[dict[str, int], dict[str, set[str]]]:
    """(responses per status, failed test case ids per check) from schemathesis's ndjson events."""
    statuses: dict[str, int] = {}
    failed: dict[str, set[str]] = {}
    with open(ndjson) as f:
        for line in f:
            _walk(json.loads(line), statuses, failed, None)
    return statuses, failed


def _walk(node, statuses: dict[str, int], failed: dict[str, set[str]], case_id: str | None) -> None:
    """Responses carry "status_code"; check results sit under recorder.checks[<case id>] as {name, status}."""
    if isinstance(node, dict):
        response = node.get("response")
        if isinstance(response, dict) and isinstance(response.get("status_code"), int):
            key = str(response["status_code"])
            statuses[key] = statuses.get(key, 0) + 1
        if isinstance(node.get("name"), str) and node.get("status") == "failure":
            failed.setdefault(node["name"], set()).add(case_id or "?")
        for key, value in node.items():
            _walk(value, statuses, failed, key if isinstance(value, list) and key.isalnum() else case_id)
    elif isinstance(node, list):
        for value in node:
            _walk(value, statuses, failed, case_id)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-time", type=int, default=240, help="schemathesis's time budget, seconds")
    parser.add_argument("--max-examples", type=int, default=60, help="generated cases per operation and phase")
    parser.add_argument("--workers", default="1")
    parser.add_argument("--out", default=None, help="where the server log and the report go")
    parser.add_argument("extra", nargs="*", help="more schemathesis arguments (after --)")
    args = parser.parse_args()

    _ensure_schemathesis()
    out = args.out or tempfile.mkdtemp(prefix="prefixkv-fuzz-")
    os.makedirs(out, exist_ok=True)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
        "TOKENIZERS_PARALLELISM": "false",
    }
    log_path = os.path.join(out, "server.log")
    server_cmd = [
        sys.executable,
        "-m",
        "prefixkv.server",
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--kv-cache-tokens",
        "4096",
        "--max-model-len",
        "256",
        "--log-level",
        "warning",
    ]
    with open(log_path, "wb") as log:
        server = subprocess.Popen(server_cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        _wait_healthy(base, server, log_path)
        ndjson = os.path.join(out, "events.ndjson")
        st_cmd = [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "run",
            base + "/openapi.json",
            "--header",
            f"Authorization: Bearer {KEY}",
            "--checks",
            CHECKS,
            "--phases",
            "examples,coverage,fuzzing",
            "--max-time",
            str(args.max_time),
            "--max-examples",
            str(args.max_examples),
            "--workers",
            args.workers,
            "--request-timeout",
            "120",
            "--continue-on-failure",
            "--suppress-health-check",
            "all",
            "--report",
            "ndjson",
            "--report-ndjson-path",
            ndjson,
            *args.extra,
        ]
        st_env = {
            **env,
            "SCHEMATHESIS_HOOKS": "fuzz_server",
            "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "scripts"), env["PYTHONPATH"]]),
        }
        print("$", " ".join(st_cmd), flush=True)
        started = time.monotonic()
        st = subprocess.run(st_cmd, env=st_env, cwd=out, check=False)
        elapsed = time.monotonic() - started
        statuses, failed = _tally(ndjson) if os.path.exists(ndjson) else ({}, {"no report": {"?"}})
        alive = server.poll() is None
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    print(f"\nschemathesis ran {elapsed:.0f} s, exit status {st.returncode}; server alive at the end: {alive}")
    server_errors = sum(n for status, n in statuses.items() if status.startswith("5"))
    bad_bodies = len(failed.get("api_error_body", ()))
    print("responses by status:", json.dumps(dict(sorted(statuses.items()))))
    print("failed test cases per check:", json.dumps({k: len(v) for k, v in sorted(failed.items())}))
    print(f"server errors (5xx): {server_errors}")
    print(f"error bodies not in their API's shape: {bad_bodies}")
    print(f"server log and report: {out}")
    return 0 if server_errors == 0 and bad_bodies == 0 and alive and st.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
