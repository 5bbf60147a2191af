"""The lean engine's fused CPU kernels (`csrc/lean_ops.cpp`): built once per machine, then loaded.

Why: after the weight products, a lean decode step was ~1,000 small torch operations (norms,
RoPE, cache writes, dtype conversions, float64 attention), each a few microseconds of dispatch on
a tensor of a few hundred numbers; on SmolLM2 that was more than half of an 8.6-9.4 ms step
(docs/BENCHMARKS.md). These kernels do the work between two products in one call each:
`rms_norm`, `add_rms_norm` (residual add + next norm), `silu_mul`, and `attention` (q/k norm,
RoPE, cache write and softmax attention for every head). Each row (token) is computed by the same
instruction sequence however many rows share the call, so a verify is bit-identical to decoding
its tokens one at a time (the file's header says how), in float32, where torch's attention needed
float64 for that.

Built with torch's C++ extension tooling (g++ and ninja) into the cache directory
(`DFLASH_ROBOT_CACHE`, default ~/.cache/dflash-robot) under a name keyed by the source, the
compiler flags and this CPU's model, so the build runs once (about a minute, announced on stderr)
and a later start only loads the library. `DFLASH_ROBOT_KERNELS=0` turns them off; without a
compiler they are unavailable and the engine runs its torch path (`available()` says why).

On a CPU with AMX-BF16 (Intel Sapphire Rapids and later) the library also holds an int4 product
(`q4_pack`, `q4_mm`) whose cost barely grows with the rows, where torch's int4 kernel pays one FMA
per weight per row: a 4-token verify then costs little more than one decode step
(`quant.int4_linear` uses it; `amx()`; `DFLASH_ROBOT_AMX=0` turns it off).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

_SOURCE = Path(__file__).with_name("csrc") / "lean_ops.cpp"
# -fopenmp at compile time only: at::parallel_for's OpenMP regions then bind, when the library is
# loaded, to the OpenMP runtime torch itself links (one thread pool, sized by torch.set_num_threads)
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast", "-fopenmp"]
_module: ModuleType | None = None
_error: str | None = None


def cpu_identity() -> str:
    """The CPU's model and feature flags (`-march=native` builds for exactly these): a cache shared
    between machines must not hand one a library with instructions it lacks."""
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")  # x86, then aarch64
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    found: dict[str, str] = {}
    for line in lines:
        key = line.split(":", 1)[0].strip()
        if key in keys and key not in found:
            found[key] = line
    return "\n".join([platform.machine(), platform.processor() or "", *found.values()])


def build_name() -> str:
    import torch

    key = "\0".join([_SOURCE.read_text(), " ".join(_FLAGS), cpu_identity(), torch.__version__, sys.version])
    return "dflash_lean_ops_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def for_engine(device: Any, dtype: Any) -> ModuleType | None:
    """The kernels for an engine on `device` in `dtype`: only an fp32 model on the CPU runs them."""
    import torch

    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    return load()


def enabled() -> bool:
    return os.environ.get("DFLASH_ROBOT_KERNELS", "1") not in ("0", "false", "no")


def load() -> ModuleType | None:
    """The kernels module, building it on first use; None (and `unavailable_reason()`) when it
    cannot be built or is turned off."""
    global _module, _error
    if _module is not None or _error is not None:
        return _module
    if not enabled():
        _error = "turned off by DFLASH_ROBOT_KERNELS=0"
        return None
    try:
        _module = _load()
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path still runs
        _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        print(f"dflash-robot: fused CPU kernels unavailable ({_error}); using the torch path", file=sys.stderr)
    return _module


def amx() -> ModuleType | None:
    """The kernels module where its AMX int4 product runs here (built with AMX-BF16, tile state
    granted by the OS, not turned off by `DFLASH_ROBOT_AMX=0`); else None."""
    if os.environ.get("DFLASH_ROBOT_AMX", "1") in ("0", "false", "no"):
        return None
    mod = load()
    return mod if mod is not None and mod.amx_available() else None


def unavailable_reason() -> str | None:
    load()
    return _error


def _load() -> ModuleType:
    import importlib.util

    from dflash_robot.targets.loading import cache_root

    name = build_name()
    build_dir = cache_root() / "kernels" / name
    lib = build_dir / f"{name}.so"
    if lib.is_file():  # built before: load the library directly (no ninja run, no compiler needed)
        import torch  # noqa: F401  (the library links against torch's)

        spec = importlib.util.spec_from_file_location(name, lib)
        try:
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
        except (ImportError, OSError, AssertionError):  # a damaged or partial build: build it again
            lib.unlink(missing_ok=True)
    import shutil
    import tempfile

    from torch.utils import cpp_extension

    try:  # the `ninja` wheel's binary, even when its bin directory is not on PATH (an unactivated venv)
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    build_dir.parent.mkdir(parents=True, exist_ok=True)
    print(f"dflash-robot: building the fused CPU kernels, once for this machine (~20-60 s), in {build_dir} ...",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    # Built in a private directory, then moved into place whole: a concurrent start never sees a
    # half-written library, and a killed build leaves no lock behind, only a stray directory.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=build_dir.parent))
    try:
        mod = cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=_FLAGS, build_directory=str(tmp),
                                 verbose=False)
        if not lib.is_file():
            shutil.rmtree(build_dir, ignore_errors=True)  # a damaged earlier build
            try:
                os.replace(tmp, build_dir)
            except OSError:  # another process moved its build in first: keep that one
                pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"dflash-robot: fused CPU kernels built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return mod
