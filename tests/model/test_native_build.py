"""Where and how the native kernels are built: never into a place another checkout, venv or torch uses, never a
wait without a deadline, and the torch paths (with a warning) when the build cannot finish.

At most one real compile runs here (the module's own build, usually already done by scripts/setup.sh); the lock
and timeout cases reuse copies of that build, or stop a fresh compile after a second. Each load runs in a fresh
subprocess (module() is cached per process), with a generous timeout that only guards against a hang.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from prefixkv.model import native

HANG_GUARD_S = 300
_LOAD = "from prefixkv.model import native; m = native.module(); print('LOADED', m is not None and m.__name__)"


def _load_in_subprocess(base: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PREFIXKV_NATIVE_DIR": base, **env}
    full_env.pop("PREFIXKV_NO_NATIVE", None)
    return subprocess.run(
        [sys.executable, "-c", _LOAD],
        check=False,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env=full_env,
        cwd=os.getcwd(),
    )


@pytest.fixture(scope="module")
def built() -> str:
    """This checkout's build directory, built (the one compile, when setup.sh has not done it)."""
    if native.module() is None:
        pytest.skip("the native kernels cannot be built on this machine")
    directory = native.build_directory()
    assert native.is_built(directory)
    return directory


def _copy_of(built: str, tmp_path) -> tuple[str, str]:
    """(base, directory): a copy of the build under a base of its own, named as the subprocess will look for it."""
    base = str(tmp_path / "native")
    directory = os.path.join(base, os.path.basename(built))
    shutil.copytree(built, directory, symlinks=True)  # copy2 keeps mtimes (ninja's logs record them)
    _sources_not_newer_than(built)
    return base, directory


def _sources_not_newer_than(built: str) -> None:
    """A build directory is reused by the sources' content (native.build_key), so a fresh clone of the same
    sources (at the same path, as CI's) finds the objects an earlier clone built, older than its sources' mtimes:
    ninja would recompile all of it when a test asks it to finish a build (74 s of the suite). Sources no newer
    than the objects: nothing to redo, as the tests mean. Their content, and so the key, is untouched."""
    objects = [os.path.join(built, n) for n in os.listdir(built) if n.endswith((".o", ".so"))]
    oldest = min(os.stat(o).st_mtime for o in objects) - 1
    csrc = os.path.join(os.path.dirname(native.__file__), "csrc")
    for folder, _, names in os.walk(csrc):  # the per-ISA subfolders too
        for name in names:
            path = os.path.join(folder, name)
            if os.stat(path).st_mtime > oldest:
                os.utime(path, (oldest, oldest))


def test_build_key_separates_installations(tmp_path):
    """Sources, torch version, installation, flags and CPU each give another directory and module name."""
    src = tmp_path / "a.cpp"
    src.write_text("int f() { return 1; }\n")
    base = ([str(src)], "2.13.0+cpu", "/venv-a\0/venv-a/bin/python", {"extra_cflags": ["-O3"]}, "avx512f")
    key = native.build_key(*base)
    assert key == native.build_key(*base) and len(key) == 16
    variants = [
        ([str(src)], "2.12.0+cpu", *base[2:]),
        (*base[:2], "/venv-b\0/venv-b/bin/python", *base[3:]),
        (*base[:3], {"extra_cflags": ["-O2"]}, base[4]),
        (*base[:4], "avx2"),
    ]
    keys = {native.build_key(*v) for v in variants}
    src.write_text("int f() { return 2; }\n")
    keys.add(native.build_key(*base))
    assert len(keys) == 5 and key not in keys
    dirs = [os.path.join("/base", k) for k in sorted(keys)]
    assert len({native.module_name(d) for d in dirs}) == 5


def test_build_directory_is_per_checkout(monkeypatch, tmp_path):
    """Not torch's shared per-user cache under a fixed name: a directory of its own under the chosen base."""
    monkeypatch.setenv("PREFIXKV_NATIVE_DIR", str(tmp_path))
    directory = native.build_directory()
    assert os.path.dirname(directory) == str(tmp_path)
    assert native.module_name(directory) == "prefixkv_native_" + os.path.basename(directory)
    assert "torch_extensions" not in directory


def test_two_builds_load_side_by_side(built, tmp_path):
    """The process's own build and a copy under another base both load, as distinct modules from their own
    files: nothing is shared between two build directories."""
    base, directory = _copy_of(built, tmp_path)
    result = _load_in_subprocess(base)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"LOADED {native.module_name(built)}" in result.stdout
    assert native.module().__file__ == native._library(built)
    assert native._library(directory) != native._library(built)


def test_stale_torch_lock_does_not_hang(built, tmp_path):
    """A build killed mid-way leaves torch's `lock` file, on which torch itself waits forever. The next start
    holds the fcntl lock every builder takes, so it knows the file is stale: removes it, finishes the build
    (nothing to recompile here) and loads it."""
    base, directory = _copy_of(built, tmp_path)
    os.remove(os.path.join(directory, "BUILT"))  # the killed build never finished
    open(os.path.join(directory, "lock"), "w").close()
    result = _load_in_subprocess(base)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"LOADED {native.module_name(built)}" in result.stdout, result.stderr[-3000:]
    assert "left by a native build that was killed" in result.stderr
    assert f"building native kernels in {directory} (first start, ~1 min)" in result.stderr
    assert not os.path.exists(os.path.join(directory, "lock")) and native.is_built(directory)


def test_live_builder_is_waited_for_with_a_deadline(built, tmp_path):
    """Another process still building (it holds the fcntl lock): wait, but only until the deadline, then fall
    back to the torch paths with a warning that says so."""
    base, directory = _copy_of(built, tmp_path)
    os.remove(os.path.join(directory, "BUILT"))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, os, sys, time\n"
                f"fd = os.open({os.path.join(directory, 'prefixkv-build.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
                "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(600)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        result = _load_in_subprocess(base, PREFIXKV_NATIVE_LOCK_TIMEOUT="1")
        waited = time.monotonic() - start
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LOADED False" in result.stdout
    assert f"waiting up to 1 s for another process building native kernels in {directory}" in result.stderr
    assert "native CPU kernels unavailable, using torch ops (another process has been building" in result.stderr
    assert waited < HANG_GUARD_S


def test_build_past_its_deadline_falls_back(tmp_path):
    """A build that cannot finish in time is stopped (compiler included) and the torch paths are used; it leaves
    torch's lock file behind, as a killed build does, for the next start to clear."""
    base = str(tmp_path / "native")
    result = _load_in_subprocess(base, PREFIXKV_NATIVE_BUILD_TIMEOUT="1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LOADED False" in result.stdout
    assert "building native kernels in" in result.stderr
    assert "did not finish within 1 s" in result.stderr
    (directory,) = os.listdir(base)
    assert not native.is_built(os.path.join(base, directory))
