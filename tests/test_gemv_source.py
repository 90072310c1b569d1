"""runtime/csrc/gemv.cpp compiles for every instruction set it is written for, not only the one this machine builds:
a defect in another CPU's code (once: AVX-512 vector wrappers that called themselves, which only AVX-512 machines
would have run, and crashed on) is caught here, on any machine."""
import os
import subprocess
import sysconfig

import pytest
from torch.utils import cpp_extension

from runtime import cpu_ops


def compile_errors(source, variant: str) -> str:
    """The compiler's errors for ``source`` built with ``variant``'s flags and the build's own warnings made errors
    (unoptimized: the checks, not the code), or ''."""
    includes = [f"-I{path}" for path in cpp_extension.include_paths() + [sysconfig.get_paths()["include"]]]
    flags = [flag for flag in cpu_ops.CFLAGS if flag.startswith("-W")] + cpu_ops.VARIANTS[variant]
    run = subprocess.run([cpp_extension.get_cxx_compiler(), "-std=c++17", "-O0", "-c", "-o", os.devnull, *flags,
                          *includes, str(source)], capture_output=True, text=True)
    return "" if run.returncode == 0 else run.stderr


@pytest.mark.parametrize("variant", [name for name in cpu_ops.VARIANTS if name != cpu_ops.variant()])
def test_the_variants_this_machine_does_not_build_compile(variant):
    assert compile_errors(cpu_ops.SOURCE, variant) == ""


def test_a_vector_wrapper_that_calls_itself_fails_the_compile(tmp_path):
    """Negative control: the AVX-512 ``zero()`` as the blanket rename had left it (928a5fc mended it)."""
    right = "inline VF zero() { return _mm512_setzero_ps(); }"
    source = cpu_ops.SOURCE.read_text()
    assert right in source
    (tmp_path / "gemv.cpp").write_text(source.replace(right, "inline VF zero() { return zero(); }"))
    assert "infinite recursion" in compile_errors(tmp_path / "gemv.cpp", "avx512")
