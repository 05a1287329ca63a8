"""prefixkv's compiled CPU kernels (prefixkv/model/csrc): in-place paged decode attention and one-pass bf16
SiLU-multiply, RMSNorm and rotary embedding.

Built with torch's extension builder the first time they are asked for (about a minute; scripts/setup.sh does it
at install time). Anything that goes wrong (no compiler, headers, a build that does not finish) is reported once
as a warning and the callers keep their torch paths, which compute the same results.

Where: one directory per build, named by a hash of everything the binary depends on (the csrc files, the torch
version, the Python executable, so the installation, the compile flags and the CPU, since it is built with
-march=native), under ~/.cache/prefixkv/native (or $PREFIXKV_NATIVE_DIR), with a module name of its own. Two
checkouts, venvs or torch versions therefore never rebuild or load each other's build, which torch's one shared
per-user directory and fixed name did.

Locks: torch marks a build in progress with a `lock` file and waits, with no deadline, for it to disappear, so a
killed build used to hang every later start. Here every builder first takes an fcntl lock on the directory (the
kernel drops it when its holder dies, and the build subprocess holds it too); whoever holds it knows that a
leftover torch `lock` is stale and removes it. Waiting for another builder and the build itself have deadlines
($PREFIXKV_NATIVE_LOCK_TIMEOUT, $PREFIXKV_NATIVE_BUILD_TIMEOUT, seconds); past them, the torch paths are used.
A finished build leaves a BUILT marker, after which a start only imports the library.

Variants: besides the main build, the same sources built for a fixed instruction set, in a directory and under a
module name of their own (their key has no CPU in it: the flags alone say what the binary runs on), loadable in
one process beside the main build. VARIANTS["avx2"] is AVX2 + FMA without AVX-512 (the kernels an AMD EPYC Zen 3
runs): scripts/setup.sh builds it too, so the suite checks the AVX2 kernels on every CPU that can run them, not
only where -march=native picks them. The engine never loads a variant.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import hashlib
import importlib.util
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


def _csrc_files(*suffixes: str) -> list[str]:
    """The csrc files (subfolders too) ending in any of `suffixes`, sorted."""
    return sorted(
        path for suffix in suffixes for path in glob.glob(os.path.join(_CSRC, "**", "*" + suffix), recursive=True)
    )


_SOURCES = _csrc_files(".cpp")
_FLAGS = {"extra_cflags": ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"], "extra_ldflags": ["-fopenmp"]}
# fixed-ISA builds of the same sources (see the module's docstring): name -> (compile flags, CPU flags it needs).
# x86-64-v3 is AVX2, FMA, F16C, BMI1/2 and no AVX-512: what the "avx2" paths are written for
VARIANTS = {
    "avx2": (
        {"extra_cflags": ["-O3", "-march=x86-64-v3", "-fopenmp", "-fno-math-errno"], "extra_ldflags": ["-fopenmp"]},
        ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"),
    ),
}
_BUILT = "BUILT"  # written once the library is complete
AMX_FAMILIES = ("gemm", "attention")  # the AMX kernels with a self-test and a gate each
_AMX_VERDICT = "AMX_SELFTEST_{family}"  # "ok", or why that family of AMX kernels failed its self-test here
_OUR_LOCK = "prefixkv-build.lock"  # fcntl-locked while a prefixkv process builds here
_TORCH_LOCK = "lock"  # torch's FileBaton: exists while torch builds here, or forever after a killed build
_BUILD_SCRIPT = "import json, sys\nfrom torch.utils import cpp_extension\ncpp_extension.load(**json.loads(sys.argv[1]))"
DEFAULT_TIMEOUT_S = 900.0


class NativeBuildError(RuntimeError):
    """The kernels could not be built here in time; the message says why and where."""


@functools.lru_cache(maxsize=1)
def module():
    """The compiled module, or None when it cannot be built here (PREFIXKV_NO_NATIVE=1 forces None)."""
    if os.environ.get("PREFIXKV_NO_NATIVE") == "1":
        return None
    try:
        return load()
    except Exception as exc:  # noqa: BLE001 - a missing compiler, a hung or failed build must not stop the engine
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        warnings.warn(f"prefixkv: native CPU kernels unavailable, using torch ops ({reason})", stacklevel=2)
        return None


def variant_runs_here(name: str) -> bool:
    """Whether this CPU has every instruction set the variant `name` is compiled for."""
    from prefixkv.model import cpu_features

    return all(cpu_features.has(flag) for flag in VARIANTS[name][1])


@functools.cache
def variant(name: str):
    """The variant `name` of VARIANTS, loaded beside module() (built first if setup.sh has not built it); raises
    when it cannot be built or this CPU cannot run it. For the tests: the engine runs module() only."""
    if not variant_runs_here(name):
        raise NativeBuildError(f"this CPU lacks {', '.join(VARIANTS[name][1])}, which the {name} build needs")
    return load(variant=name)


def fused_ops():
    """The module when its one-pass bf16 elementwise kernels are compiled in (AVX-512, or AVX2 + FMA), else None."""
    m = module()
    return m if m is not None and m.has_fused_ops() else None


def flash_attention():
    """The module when its bf16 attention kernels (prefill and paged decode) are compiled in (AVX-512 BF16, or
    AVX2 + FMA), else None."""
    m = module()
    return m if m is not None and m.has_flash_attention() else None


def attention_isa() -> str:
    """The instruction set of flash_attention()'s vector path: "avx512_bf16", "avx2", or "" (not compiled in)."""
    m = flash_attention()
    return m.attention_isa() if m is not None else ""


def gemm():
    """The module when its row-invariant bf16 matrix product is compiled in (AVX-512 BF16, or AVX2 + FMA), else
    None."""
    m = module()
    return m if m is not None and m.has_gemm() else None


def gemm_isa() -> str:
    """The instruction set gemm() is compiled for: "avx512_bf16", "avx2", or "" (not compiled in)."""
    m = gemm()
    return m.gemm_isa() if m is not None else ""


def gemm_f32():
    """The module when its row-invariant float32 matrix product is compiled in (any build on a CPU with AVX2 + FMA,
    AVX-512 ones included: csrc/gemm/f32_avx2.h), else None."""
    m = module()
    return m if m is not None and hasattr(m, "has_gemm_f32") and m.has_gemm_f32() else None


def qgemm():
    """The module when its weight-only quantized matrix product is compiled in (AVX-512), else None."""
    m = module()
    return m if m is not None and hasattr(m, "has_qgemm") and m.has_qgemm() else None


def decode_layers():
    """The module when its one-call decoder loop can run (the kernels it calls are compiled in), else None."""
    m = module()
    ok = m is not None and m.has_fused_ops() and m.has_gemm() and m.has_flash_attention()
    return m if ok else None


@functools.lru_cache(maxsize=1)
def amx_gemm():
    """The module when its AMX matrix product (matmul "amx") runs here, else None: see amx_status."""
    m = gemm()
    return m if m is not None and amx_status("gemm") == "ok" else None


@functools.lru_cache(maxsize=1)
def amx_attention():
    """The module when its AMX attention (isa 1: prefill, paged decode, the fused decode loop) runs here, else
    None: see amx_status. Gated on its own self-test, not the matrix product's."""
    m = flash_attention()
    return m if m is not None and amx_status("attention") == "ok" else None


@functools.cache
def amx_status(family: str) -> str:
    """ "ok" when the AMX kernels of `family` ("gemm" or "attention") may run here, else why not: the kernels are
    compiled in, the CPU and the OS offer AMX tiles (PREFIXKV_NO_AMX=1 says no), and the family passed its own
    self-test on this machine (prefixkv.model.amx_selftest, run once per build in a subprocess, so that a kernel
    that faults cannot take the engine down; the verdict is kept in the build directory). A failed self-test is
    warned about once."""
    from prefixkv.model import cpu_features

    m = module()
    if m is None:
        return "the native kernels are not built"
    if not cpu_features.has_amx():
        return f"this CPU ({cpu_features.model_name()}) has no AMX tiles"
    if os.environ.get("PREFIXKV_NO_AMX") == "1":
        return "PREFIXKV_NO_AMX=1"
    if not m.has_amx():
        return "the OS does not grant the AMX tile state, or the build lacks the AMX kernels"
    verdict = amx_verdict(build_directory(), family)
    if verdict != "ok":
        warnings.warn(f"prefixkv: AMX {family} kernels not used, their self-test failed: {verdict}", stacklevel=2)
        return f"self-test failed: {verdict}"
    return "ok"


def amx_line() -> str:
    """The start log's line on the AMX kernels: each family's verdict (why it is not used, where it is not)."""
    return "AMX kernels: " + "; ".join(f"{family} {amx_status(family)}" for family in AMX_FAMILIES)


def selftest_command(family: str) -> list[str]:
    """The self-test's command line for `family` (the tests point it at another kernel)."""
    return [sys.executable, "-m", "prefixkv.model.amx_selftest", family]


def amx_verdict(directory: str, family: str) -> str:
    """ "ok" or why the AMX self-test of `family` failed, run once for the build in `directory` and kept there."""
    path = os.path.join(directory, _AMX_VERDICT.format(family=family))
    with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
        return f.read().strip()
    try:
        proc = subprocess.run(
            selftest_command(family),
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PREFIXKV_NO_AMX": "1"},  # the child never runs a self-test of its own
        )
        lines = proc.stdout.strip().splitlines()
        verdict = (
            "ok"
            if proc.returncode == 0 and lines[-1:] == ["ok"]
            else ((lines[-1] if lines else "") or f"the self-test process ended with status {proc.returncode}")
        )
    except subprocess.TimeoutExpired:
        verdict = "the self-test did not finish within 300 s"
    with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as f:
        f.write(verdict + "\n")
    return verdict


# -- where -------------------------------------------------------------------------------------------------


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's feature flags (Linux), else the machine name."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[-1].strip()
    return platform.machine()


def build_key(csrc_files: list[str], torch_version: str, installation: str, flags: dict, cpu: str) -> str:
    """16 hex digits naming one build: equal exactly when the inputs that shape the binary are equal."""
    h = hashlib.sha256()
    for path in sorted(csrc_files):
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")
    for part in (torch_version, installation, json.dumps(flags, sort_keys=True), cpu):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _flags(variant: str) -> dict:
    """The compile flags of the main build ("") or of a variant (a key of VARIANTS)."""
    if not variant:
        return _FLAGS
    if variant not in VARIANTS:
        raise ValueError(f"unknown native build variant {variant!r}; known: {', '.join(VARIANTS)}")
    return VARIANTS[variant][0]


def build_directory(variant: str = "") -> str:
    """This installation's build directory for the current sources, torch, flags and CPU (the main build), or for
    a variant of VARIANTS (no CPU in its key: its -march is fixed)."""
    import torch

    base = os.environ.get("PREFIXKV_NATIVE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "prefixkv", "native"
    )
    installation = f"{sys.prefix}\0{sys.executable}"  # a venv's python is often a symlink to a shared one
    cpu = "" if variant else _cpu_identity()
    key = build_key(_csrc_files(".cpp", ".h"), torch.__version__, installation, _flags(variant), cpu)
    return os.path.join(base, key)


def module_name(directory: str) -> str:
    """The Python module name of the build in `directory` (unique per build, so two can be loaded at once)."""
    return "prefixkv_native_" + os.path.basename(os.path.normpath(directory))


def _library(directory: str) -> str:
    return os.path.join(directory, module_name(directory) + ".so")


def is_built(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, _BUILT)) and os.path.exists(_library(directory))


# -- build and load ------------------------------------------------------------------------------------------


def _seconds(variable: str) -> float:
    value = os.environ.get(variable)
    return float(value) if value else DEFAULT_TIMEOUT_S


def load(directory: str | None = None, variant: str = ""):
    """Import the build in `directory` (default: build_directory(variant)), building it first if needed, with the
    flags of `variant` ("" the main build); raises NativeBuildError when that cannot finish in time."""
    import torch  # noqa: F401 - the library links against libtorch, which must be loaded first

    directory = directory or build_directory(variant)
    if not is_built(directory):
        os.makedirs(directory, exist_ok=True)
        with _build_lock(directory, _seconds("PREFIXKV_NATIVE_LOCK_TIMEOUT")) as lock_fd:
            if not is_built(directory):  # else another process finished it while we waited
                _build(directory, lock_fd, _seconds("PREFIXKV_NATIVE_BUILD_TIMEOUT"), _flags(variant))
    name = module_name(directory)
    spec = importlib.util.spec_from_file_location(name, _library(directory))
    if spec is None or spec.loader is None:  # the library's suffix is not one this Python imports
        raise ImportError(f"cannot import {_library(directory)} as an extension module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _build_lock(directory: str, timeout: float) -> Iterator[int]:
    """Hold the directory's fcntl lock (waiting at most `timeout` s for another builder); yields its fd."""
    fd = os.open(os.path.join(directory, _OUR_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise NativeBuildError(
                        f"another process has been building the native kernels in {directory} for over {timeout:.0f} s"
                    ) from None
                if not told:
                    logger.warning(
                        "waiting up to %.0f s for another process building native kernels in %s", timeout, directory
                    )
                    told = True
                time.sleep(0.1)
        yield fd
    finally:
        os.close(fd)  # releases the lock, unless the build subprocess still holds it


def _build(directory: str, lock_fd: int, timeout: float, flags: dict) -> None:
    """Build in a subprocess (so a deadline can stop it, compiler included) that shares our fcntl lock."""
    stale = os.path.join(directory, _TORCH_LOCK)
    if os.path.exists(stale):  # we hold the lock every builder takes first: whoever made this is gone
        logger.warning("removing %s, left by a native build that was killed before it finished", stale)
        os.remove(stale)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(directory, _BUILT))
    logger.warning("building native kernels in %s (first start, ~1 min)", directory)
    args = {
        "name": module_name(directory),
        "sources": _SOURCES,
        "build_directory": directory,
        "verbose": False,
        **flags,
    }
    env = dict(os.environ)
    bin_dir = os.path.dirname(sys.executable)  # pip's ninja lives beside python in a venv that is not activated
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    log_path = os.path.join(directory, "build.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _BUILD_SCRIPT, json.dumps(args)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=(lock_fd,),
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise NativeBuildError(
                f"the native build in {directory} did not finish within {timeout:.0f} s (log: {log_path})"
            ) from None
        except BaseException:  # interrupted: stop the compiler too
            _kill(proc)
            raise
    if code != 0 or not os.path.exists(_library(directory)):
        raise NativeBuildError(f"the native build in {directory} failed: {_first_error(log_path)} (log: {log_path})")
    with open(os.path.join(directory, _BUILT), "w") as f:
        f.write(module_name(directory) + "\n")
    logger.warning("native kernels built in %s", directory)


def _kill(proc: subprocess.Popen) -> None:
    """The build and everything it started (ninja, the compilers): it runs in a session of its own."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _first_error(log_path: str) -> str:
    with open(log_path, encoding="utf-8", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no output"])[0][:300]


def _main(argv: list[str]) -> int:
    """scripts/setup.sh: build now rather than at the first engine start; `--variant NAME`: that variant (for the
    tests), status 1 when it cannot be built on a CPU that runs it."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if argv[:1] == ["--variant"] and len(argv) == 2 and argv[1] in VARIANTS:
        name = argv[1]
        if not variant_runs_here(name):
            print(f"prefixkv native {name} build: skipped, this CPU lacks {', '.join(VARIANTS[name][1])}")
            return 0
        try:
            m = variant(name)
        except Exception as exc:  # noqa: BLE001 - reported, and the status says so
            print(f"prefixkv native {name} build: failed ({exc})")
            return 1
        print(f"prefixkv native {name} build: ready ({build_directory(name)}, attention {m.attention_isa()})")
        return 0
    if argv:
        print(f"usage: python -m prefixkv.model.native [--variant {'|'.join(VARIANTS)}]")
        return 2
    state = "ready" if module() is not None else "unavailable, the torch paths will be used"
    print(f"prefixkv native kernels: {state} ({build_directory()})")
    if module() is not None:
        print(amx_line())
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
