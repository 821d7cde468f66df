"""The row pass's block functions compile to vector code on the x86 targets
we ship for: AVX2 (`x86-64-v3`, the Docker images' target, and `-march=native`
on AMD Zen 3) and AVX-512. GCC lowers a compare of vectors wider than any
register of the target lane by lane, with a scalar compare and a branch per
lane; the 16-lane block pass did that on AVX2 and made a row 3-7x slower
(docs/results/kernels-2026-11-26-avx2.md). This counts the scalar float
compares in the compiled block functions instead of timing them. Baseline
x86-64 (SSE2) is not held to it: its 8-lane compares are still split."""
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

GCC = shutil.which("gcc")
pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or GCC is None,
                                reason="x86-64 targets compiled with gcc")

BLOCK_FUNCTIONS = """
#include "scalar_math.h"
float block_max_mass(const float* x, float s, float* m, int* n)
{ return ss_block_max_mass(x, s, m, n, 0, 0); }
float block_max_mass_bf16(const uint16_t* h, float s, float* m, int* n)
{ return ss_block_max_mass_bf16(h, s, m, n, 0, 0); }
float block_max_nan(const float* x, int* n) { return ss_block_max_nan(x, n); }
float block_max_nan_bf16(const uint16_t* h, int* n) { return ss_block_max_nan_bf16(h, n); }
"""
#: The scalar compares the four functions need: the block max of two lanes
#: and the finiteness test of the max. A block lowered lane by lane has
#: hundreds (764 with the 16-lane pass on x86-64-v3).
MOST_SCALAR_COMPARES = 8


@pytest.mark.parametrize("march", ["x86-64-v3", "skylake-avx512"])
def test_the_block_pass_compiles_to_vector_compares(tmp_path, march):
    source = tmp_path / "blocks.c"
    source.write_text(BLOCK_FUNCTIONS)
    assembly = tmp_path / "blocks.s"
    # setup.py's flags, but for the target named
    subprocess.run([GCC, "-O3", "-fno-math-errno", "-Wno-psabi", f"-march={march}",
                    f"-I{ROOT / 'cython_kernels'}", "-S", str(source), "-o", str(assembly)],
                   check=True, capture_output=True)
    instructions = [line.split()[0] for line in assembly.read_text().splitlines()
                    if line.startswith("\t") and not line.startswith("\t.")]
    scalar_compares = sum(name.endswith("comiss") for name in instructions)
    assert scalar_compares <= MOST_SCALAR_COMPARES, (march, scalar_compares)
