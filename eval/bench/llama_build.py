"""llama.cpp's own programs, built from the source that the installed llama-cpp-python vendors, so that
they are the llama.cpp the in-process comparisons run: the tools ``make bench-gguf`` needs
(llama-imatrix, llama-quantize) for this CPU, and llama-bench for a CPU class ``make bench-8b``
emulates (an AVX2 desktop: llama.cpp compiled for AVX2, as its release builds for such CPUs are).

Each build lives in ~/.cache/quantkit/llama.cpp-<llama-cpp-python version>/<name>: static binaries (they
outlive any pip reinstall), CPU only, no network code; built once, about 10 minutes on 2 cores.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

# CPU only, static, no network code, no server; the examples (llama-speculative-simple) only when asked for
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
               "-DLLAMA_BUILD_TOOLS=ON")
NATIVE = ("-DGGML_NATIVE=ON",)  # every instruction set of this CPU


def llama_cpp_dir() -> Path:
    """One directory per llama-cpp-python release: the programs must be the llama.cpp it vendors."""
    import llama_cpp

    return Path.home() / ".cache" / "quantkit" / f"llama.cpp-{llama_cpp.__version__}"


def _vendored_source(root: Path) -> Path:
    """llama.cpp's source from the llama-cpp-python sdist of the installed version (pip download)."""
    import llama_cpp

    src = root / "src"
    if src.exists():
        return src
    sdist = root / "sdist"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={llama_cpp.__version__}", "-d", str(sdist)], check=True)
    archive = next(sdist.glob("llama_cpp_python-*.tar.gz"))
    prefix = f"{archive.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for member in members:
            member.name = member.name[len(prefix):]
        tar.extractall(root / "src.partial", members=members, filter="data")
    (root / "src.partial").rename(src)
    shutil.rmtree(sdist)
    return src


def llama_cpp_source() -> Path:
    """The source tree of the llama.cpp the installed llama-cpp-python vendors, fetched on first use: what its
    programs are built from, and its converter (convert_hf_to_gguf.py with gguf-py) that tests compare with."""
    return _vendored_source(llama_cpp_dir())


def llama_cpp_programs(name: str, programs: tuple[str, ...], instruction_sets: tuple[str, ...], build: bool = True,
                       jobs: int = 1, examples: bool = False) -> Path | None:
    """The bin directory of the build ``name`` holding ``programs``, compiled with ``instruction_sets`` (cmake
    GGML_* flags), with llama.cpp's examples/ configured if ``examples``; built on first use, or None if absent
    and ``build`` is off."""
    root = llama_cpp_dir()
    bin_dir = root / name / "bin"
    if all((bin_dir / program).exists() for program in programs):
        return bin_dir
    if not build:
        return None
    src, build_dir = llama_cpp_source(), root / name / "build"
    subprocess.run(["cmake", "-S", str(src), "-B", str(build_dir), *CMAKE_FLAGS,
                    f"-DLLAMA_BUILD_EXAMPLES={'ON' if examples else 'OFF'}", *instruction_sets], check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target",
                    *programs], check=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for program in programs:
        shutil.copy2(build_dir / "bin" / program, bin_dir / program)
    return bin_dir
