"""Compiling CUDA source without a GPU: NVRTC (PyPI's nvidia-cuda-nvrtc + cuda-bindings) or nvcc, with the
options CuPy's RawModule gets (codegen/cuda.py's OPTIONS). CI compiles every kernel the backend can generate."""
from __future__ import annotations

from ..engine.codegen.cuda import OPTIONS


def compilers_available() -> list[str]:
    """The CUDA compilers here: 'nvrtc' (PyPI's nvidia-cuda-nvrtc + cuda-bindings, no GPU needed) and/or
    'nvcc' (on PATH)."""
    import shutil
    found = []
    try:
        from cuda.bindings import nvrtc
        nvrtc.nvrtcVersion()    # loads libnvrtc (the nvidia-cuda-nvrtc wheel's, found by cuda-pathfinder)
        found.append("nvrtc")
    except Exception:           # not installed, or the shared library cannot be loaded
        pass
    if shutil.which("nvcc"):
        found.append("nvcc")
    return found


def compiler_available() -> str | None:
    """The compiler :func:`compile_source` uses by default (NVRTC first), or None."""
    found = compilers_available()
    return found[0] if found else None


def _nvrtc(source: str, arch: str, name: str) -> bytes:
    from cuda.bindings import nvrtc

    def ok(res, what):
        if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC {what} failed: {res[0]}")
        return res[1:]

    (prog,) = ok(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []), "create")
    try:
        opts = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in OPTIONS]
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            (size,) = ok(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
            log = b" " * size
            ok(nvrtc.nvrtcGetProgramLog(prog, log), "log")
            raise RuntimeError(f"NVRTC could not compile {name} for {arch}:\n"
                               f"{log.rstrip(bytes(1)).decode(errors='replace')}")
        (size,) = ok(nvrtc.nvrtcGetCUBINSize(prog), "cubin size")
        cubin = b" " * size
        ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvcc(source: str, arch: str, name: str) -> bytes:
    import subprocess
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / f"{name}.cu", Path(d) / f"{name}.cubin"
        src.write_text(source)
        res = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", *OPTIONS, str(src), "-o", str(out)],
                             capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"nvcc could not compile {name} for {arch}:\n{res.stderr}")
        return out.read_bytes()


def compile_source(source: str, arch: str = "sm_80", name: str = "kernel", compiler: str | None = None) -> bytes:
    """Compile CUDA source for ``arch`` exactly as given (with :data:`OPTIONS`, as CuPy's RawModule gets them);
    returns the CUBIN or raises RuntimeError with the compiler's log. ``compiler``: 'nvrtc', 'nvcc' or None
    (the first available). This is the check CI runs on every kernel the backend can generate."""
    how = compiler or compiler_available()
    if how == "nvrtc":
        return _nvrtc(source, arch, name)
    if how == "nvcc":
        return _nvcc(source, arch, name)
    if how is None:
        raise RuntimeError("no CUDA compiler: pip install nvidia-cuda-nvrtc cuda-bindings (no GPU needed), "
                           "or put nvcc on PATH")
    raise ValueError(f"unknown CUDA compiler {how!r}: nvrtc or nvcc")
