"""The package contracts as checked facts: an acyclic import graph, and an engine core that runs without torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], code: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, *args] if code is None else [sys.executable, "-c", code]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_import_graph_is_a_dag_with_the_contracted_edges():
    proc = _run([str(REPO / "scripts" / "import_graph.py")])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    edges = {}
    for line in proc.stdout.splitlines():
        if " -> " in line:
            node, deps = line.split(" -> ")
            edges[node] = set(deps.split(", "))
    assert not edges["prefixkv.kvcache"] & {"prefixkv.engine", "prefixkv.model", "prefixkv.sim"}
    assert "prefixkv.engine" not in edges["prefixkv.model"]
    assert "prefixkv.bench" not in edges["prefixkv.sim"]
    assert "prefixkv.model" not in edges["prefixkv.engine"]
    assert edges["prefixkv.router"] <= {"prefixkv.kvcache", "prefixkv.config", "prefixkv.request"}  # a pure library


def test_the_engine_imports_no_tier_event_or_model_class():
    """The engine and its core reach a second KV tier and KV events only as step components (engine/core.py)
    built by the composition root (llm.py), and the model only through the runner it is handed."""
    proc = _run([str(REPO / "scripts" / "import_graph.py"), "--modules"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in proc.stdout.splitlines():
        node, _, deps = line.partition(" -> ")
        if node == "prefixkv.engine" or node.startswith("prefixkv.engine."):
            banned = [
                d
                for d in deps.split(", ")
                if d.startswith(("prefixkv.kvcache.offload", "prefixkv.kv_events", "prefixkv.model"))
            ]
            assert not banned, f"{node} imports {banned}"


def test_import_graph_script_reports_a_cycle(tmp_path):
    """The checker itself: a package whose two modules import each other inside functions is reported."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "import_graph.py").write_text((REPO / "scripts" / "import_graph.py").read_text())
    pkg = tmp_path / "prefixkv" / "a"
    pkg.mkdir(parents=True)
    (tmp_path / "prefixkv" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text("def f():\n    from prefixkv.a import y\n")
    (pkg / "y.py").write_text("from prefixkv.a.x import f\n")
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "scripts" / "import_graph.py")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and "CYCLE in the module graph" in proc.stderr


TORCH_FREE = """
import sys
from prefixkv.engine.engine import Engine
from prefixkv.engine.scheduler import Scheduler
from prefixkv.engine.policy_factory import create_policy
from prefixkv.engine.cache_aware_policies import BoundedLPMPolicy
from prefixkv.kvcache.factory import create_kv_cache_manager
from prefixkv.kvcache.hash_cache import HashPrefixCache
from prefixkv.kvcache.radix_cache import RadixPrefixCache
from prefixkv.sim.simulator import SimRequest, make_policy, simulate, summarize_run
from prefixkv.sim.replicas import simulate_replicas
from prefixkv.router import Router
from prefixkv.config import EngineConfig
from prefixkv.engine_args import add_engine_args

prefix = list(range(100, 164))
work = [SimRequest(i, prefix + [i, i + 1], 4, "g") for i in range(12)]
for kind, page in (("hash", 16), ("radix", 1), ("off", 16)):
    kv = create_kv_cache_manager(kind, 512 // page, page)
    res = simulate(kv, make_policy("bounded-lpm"), work, max_num_seqs=4, check_every=1)
    kv.check_invariants()
    assert res.output_tokens == 12 * 4, res.output_tokens
    assert (summarize_run(res, kv)["hit_tokens"] > 0) == (kind != "off")
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "prefixkv.model", "numpy")))
print("LOADED", loaded)
assert not loaded, loaded
"""


def test_engine_core_runs_without_torch():
    """Engine, scheduler, policies, caches and simulator import and run in a process that never loads torch
    (nor the model package): the subprocess is what is tested."""
    proc = _run([], TORCH_FREE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "LOADED []" in proc.stdout
