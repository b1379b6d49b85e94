"""llama.cpp's tools the benchmarks run beside Lumen (llama-bench, llama-batched-bench, llama-server,
llama-lookup): where each one is found.

A path the user gives, with the tool's flag or its environment variable, must name an executable file (a bare name
is looked up on $PATH): a wrong one is a usage error before any work, never a silent fallback to Lumen alone or to
another copy of the tool. With neither given, the tool is looked up on $PATH by its name.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil


# How to build the tools (lumen/bench/README.md says why): from the llama.cpp inside the llama-cpp-python 0.3.36
# sdist, with exactly the vector extensions /proc/cpuinfo reports and never AMX (a native build dies with SIGILL in
# its weight repacking on a virtual machine whose CPU has AMX but whose OS does not grant it), repacking left on.
BUILD_LLAMA = """\
pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
on() { case "$flags" in *" $1 "*) echo ON;; *) echo OFF;; esac; }
cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \\
  -DGGML_AVX=$(on avx) -DGGML_AVX2=$(on avx2) -DGGML_FMA=$(on fma) -DGGML_F16C=$(on f16c) -DGGML_BMI2=$(on bmi2) \\
  -DGGML_AVX_VNNI=$(on avx_vnni) -DGGML_AVX512=$(on avx512f) -DGGML_AVX512_VBMI=$(on avx512vbmi) \\
  -DGGML_AVX512_VNNI=$(on avx512_vnni) -DGGML_AVX512_BF16=$(on avx512_bf16) \\
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \\
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF
cmake --build build -j2 --target llama-server llama-batched-bench llama-lookup llama-bench   # ~10 min on 2 cores"""


class ToolNotFound(ValueError):
    """A tool path the user gave names no executable file, or a tool that was asked for is nowhere."""


def find_tool(name: str, flag: str, path: str | None, env: str | None = None) -> str | None:
    """The executable of tool `name`: `path` (given with `flag`), else $env, else `name` on $PATH; None when
    neither is given and $PATH has none. Raises ToolNotFound, naming where the path came from, when a given
    one is not an executable file."""
    for given, source in ((path, flag), (os.environ.get(env) if env else None, f"${env}")):
        if not given:
            continue
        found = given if os.sep in given else shutil.which(given)
        if found and os.path.isfile(found) and os.access(found, os.X_OK):
            return found
        what = ("is not an executable file" if found and os.path.exists(found) else
                "does not exist" if os.sep in given else
                f"is not on $PATH; the file in this directory is ./{given}" if os.path.exists(given) else
                "is not on $PATH")                  # (a bare name is looked up on $PATH only, as the shell does)
        raise ToolNotFound(f"{source} {given}: {what} (give the path of llama.cpp's {name})")
    return shutil.which(name)


def given_tool(ap: argparse.ArgumentParser, name: str, flag: str, path: str | None, env: str) -> str | None:
    """For a script whose comparison runs only when asked for: the tool's executable when `path` (given with
    `flag`) or $env names one, else None (not looked up on $PATH). A wrong one exits 2 with one line, before any
    work: a script must not measure for minutes and then skip the comparison, or die on it."""
    if not path and not os.environ.get(env):
        return None
    try:
        return find_tool(name, flag, path, env)
    except ToolNotFound as e:
        refuse(ap, str(e))


def refuse(ap: argparse.ArgumentParser, message: str):
    """Exit 2 with argparse's error line alone: the usage block would bury a wrong path in seven lines."""
    ap.exit(2, f"{ap.prog}: error: {message}\n")


def comma_list(flag: str, text: str) -> list[str]:
    """A comma-separated flag's items, stripped; ValueError on an empty one: "1,2," or "a,,b" is a typo, not a
    shorter list. Every list flag of the benchmarks reads its value with this."""
    items = [x.strip() for x in text.split(",")]
    if "" in items:
        raise ValueError(f"{flag} {text!r} has an empty item (comma-separated, none empty)")
    return items


def split_args(ap: argparse.ArgumentParser, flag: str, value: str) -> list[str]:
    """`--llama-args "..."` as the tool's argv (shell quoting); an unclosed quote is a usage error, said before any
    work rather than as a traceback after the model has loaded."""
    try:
        return shlex.split(value)
    except ValueError as e:
        refuse(ap, f"{flag} {value!r}: {str(e).lower()}")
