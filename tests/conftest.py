"""Shared fixtures: the default model read once per process, and small-pool engines built on it.

Why: an engine is a model plus a KV pool. Reading the GGUF costs seconds and half a GB per copy, and an engine's
default pool is 1 GiB of zeroed memory; a test needs neither more than once. So every engine here runs on one
loaded model per dtype and device (`loaded_model`), with a pool that holds the model's whole context (any single
request the engine accepts fits, and the pool is still a fraction of the default), and the cached factory keeps
only the few engines it handed out last. What collection imported is frozen out of the garbage collector
(pytest_collection_finish), so the collections that free dropped engines stay cheap.

At the end of a run, the wall time and the peak resident memory of the test process are printed (and written to
the file named by $PREFIXKV_TEST_SUMMARY, which .ci/run shows last).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import resource
import time
from collections import OrderedDict

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import prefixkv  # noqa: E402,F401 - before anything imports torch: it sets how OpenMP workers wait

pytest_plugins = ["tests.kv_store"]  # the redis_store fixture: a real store for the shared KV tier's tests

MAX_CACHED_ENGINES = 2  # llm_factory keeps this many engines alive; older ones are dropped and rebuilt on demand
_SESSION_START = time.monotonic()


def model_view(loaded):
    """A LoadedModel whose module is a copy sharing every tensor (weights, buffers) with `loaded`.

    The runner binds its engine's KV pool to the model module, so engines alive at the same time (a server's and
    a reference one) each need their own module object; the weights, read once, are shared read-only.
    """
    import copy
    import dataclasses
    import types

    import torch

    memo: dict[int, object] = {}
    for module in loaded.model.modules():
        for value in [*module.parameters(recurse=False), *module.buffers(recurse=False), *vars(module).values()]:
            native_object = type(value).__module__.startswith("prefixkv_native")  # e.g. the fused decode loop
            if isinstance(value, (torch.Tensor, types.ModuleType)) or native_object:  # shared, not copied
                memo[id(value)] = value
    return dataclasses.replace(loaded, model=copy.deepcopy(loaded.model, memo))


@pytest.fixture(scope="session")
def loaded_model():
    """loaded_model(dtype="float32", device="cpu") -> the default model, read once per process per dtype/device.

    Keyed by dtype and device because a ModelRunner casts a model of another dtype in place. A runner built on it
    directly (the model tests) binds its pool to it; engines get a model_view of it instead.
    """
    from prefixkv.model.loader import load_model, parse_dtype

    cache: dict = {}

    def get(dtype: str = "float32", device: str = "cpu"):
        key = (parse_dtype(dtype), device)
        if key not in cache:
            cache[key] = load_model(None, dtype=dtype, device=device)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def hf_smol():
    """transformers' own GGUF load of the default model in fp32 (independent dequantisation and q/k un-permutation):
    the reference the model tests compare with, and the model the HF throughput benchmark test runs. Read once per
    process: the load takes ~12 s, more than holding its half GB costs."""
    import torch
    from transformers import AutoModelForCausalLM

    from prefixkv.model.loader import default_model_path

    path = default_model_path()
    with _gguf_work_done_once():
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    return model.eval()


@contextlib.contextmanager
def _gguf_work_done_once():
    """transformers' GGUF load without its repeated pure work: it builds gguf's tensor name map (the same one) once
    per module of the model, ~400 times (~5 s), and parses the whole file twice, for the config and for the weights
    (~3 s). Within this block both are memoized; what is read, and how it is dequantized, un-permuted and mapped,
    stays transformers' and gguf's own."""
    import gguf

    get_tensor_name_map, reader = gguf.get_tensor_name_map, gguf.GGUFReader
    readers: dict = {}

    def read_once(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader(path, *args, **kwargs)
        return readers[key]

    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(get_tensor_name_map)
    gguf.GGUFReader = read_once
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = get_tensor_name_map, reader


@pytest.fixture(scope="session")
def new_llm(loaded_model):
    """new_llm(**engine_options) -> a new LLM of its own on the shared weights, with a small pool.

    For an engine nobody else may step (a server's, or one a test reconfigures). The pool holds the model's whole
    context unless kv_cache_tokens or kv_cache_memory says otherwise; a `model` other than the default is loaded.
    """
    from prefixkv.llm import LLM

    def make(**options):
        dtype, device = options.pop("dtype", "float32"), options.pop("device", "cpu")
        if options.get("model") is not None:
            return LLM(dtype=dtype, device=device, **options)
        options.pop("model", None)
        loaded = loaded_model(dtype, device)
        if options.get("kv_cache_tokens") is None and options.get("kv_cache_memory") is None:
            options["kv_cache_tokens"] = loaded.config.max_position_embeddings
        return LLM(dtype=dtype, device=device, loaded_model=model_view(loaded), **options)

    return make


@pytest.fixture(scope="session")
def new_engine(new_llm):
    """new_engine(**engine_options) -> the Engine of a new_llm(...): what a test server runs."""
    return lambda **options: new_llm(**options).llm_engine


@pytest.fixture(scope="session")
def llm_factory(new_llm):
    """llm_factory(**engine_options) -> a cached LLM for those options (fp32 default model, small pool).

    Tests asking for the same options get the same engine; only the MAX_CACHED_ENGINES used last stay alive.
    """
    cache: OrderedDict = OrderedDict()

    def make(**options):
        key = tuple(sorted(options.items()))
        if key in cache:
            cache.move_to_end(key)
        else:
            if len(cache) >= MAX_CACHED_ENGINES:  # drop the least recently used first, so two pools never overlap
                cache.popitem(last=False)
                gc.collect()  # free its pool now (see _free_dropped_engines)
            cache[key] = new_llm(**options)
        return cache[key]

    yield make
    cache.clear()


_RUNNERS_BUILT = [0]  # ModelRunners made in this process: every engine has one, and each holds a KV pool


def _count_runners() -> None:
    from prefixkv.model.runner import ModelRunner

    build = ModelRunner.__init__

    def counted(self, *args, **kwargs):
        _RUNNERS_BUILT[0] += 1
        build(self, *args, **kwargs)

    ModelRunner.__init__ = counted  # type: ignore[method-assign]


_count_runners()


@pytest.fixture(scope="module", autouse=True)
def _free_dropped_engines():
    """Collect after each module that built a runner (an engine, or a model test's own): an engine is a web of
    objects with cycles, so the pool of one a module dropped would otherwise wait for a collection triggered by
    object counts, not by the hundreds of MB it holds. A module that built none skips it (most modules build none;
    a full collection is cheap only because pytest_collection_finish froze the imports)."""
    built = _RUNNERS_BUILT[0]
    yield
    if _RUNNERS_BUILT[0] != built:
        gc.collect()


def pytest_collection_finish(session):
    """Freeze what collection left alive (every module the tests import: torch, the servers' SDKs, ~600k objects,
    and the collected items), so no garbage collection walks it again.

    Those objects live until the process ends anyway. Unfrozen, each full collection (the explicit ones above, and
    the ones Python triggers as objects accumulate, ~150 in a run) spends ~0.5 s walking them: most of a minute of
    the suite's wall time. No fixture has run yet, so nothing frozen here is an engine or a model whose memory a
    collection should give back; objects made later are collected as before. When a collected test loads a
    transformers model, transformers' model code (~140k objects with what it imports: sympy, torch.fx) is imported
    first, to be frozen with the rest instead of being walked by every collection after that test.
    """
    if any({"hf_smol", "tiny_checkpoint"} & set(getattr(item, "fixturenames", ())) for item in session.items):
        import transformers.modeling_utils  # noqa: F401
    gc.collect()
    gc.freeze()


def pytest_configure(config):
    config.addinivalue_line("markers", "kernel_missing(why): the CPU has the instructions, the build lacks the kernel")


def pytest_runtest_setup(item):
    """tests/kernels.py's marks: a kernel the CPU could run but the build lacks fails its tests, never skips them."""
    mark = item.get_closest_marker("kernel_missing")
    if mark is not None:
        pytest.fail(mark.args[0], pytrace=False)


def pytest_terminal_summary(terminalreporter):
    """The two numbers the suite is held to: its wall time and the peak resident memory of this process."""
    gib = 1 << 20  # ru_maxrss is in KiB on Linux
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / gib
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / gib
    seconds = time.monotonic() - _SESSION_START
    line = (
        f"test process: {seconds / 60:.1f} min wall ({seconds:.0f} s; target < 8 min on 2 idle cores), "
        f"peak RSS {own:.2f} GiB (target < 5); largest child process {child:.2f} GiB (a fork counts its "
        "parent's pages)"
    )
    terminalreporter.write_line(line)
    path = os.environ.get("PREFIXKV_TEST_SUMMARY")
    if path:
        with open(path, "w") as f:
            f.write(line + "\n")
