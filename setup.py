"""Builds the Cython kernels in cython_kernels/ as simple_sampler._sampling.

One extension: sampling.pyx includes its parts (row.pxi, nucleus.pxi,
hot_set.pxi, compact.pxi, ...) and cimports the .pxd headers, so the row functions stay in one
translation unit (docs/INTERNALS.md, The kernels); cythonize follows the
includes to decide when to rebuild.

Compiler flags:
  * OpenMP for the parallel loop over rows.
  * -O3 and no -ffast-math or reassociation: NaN / infinity comparisons and
    the rounding trick in ss_exp_nonpositive keep their IEEE meaning. The
    reductions of the row pass vectorize anyway, being written lane by lane
    (scalar_math.h).
  * -march from SIMPLE_SAMPLER_MARCH (default "native": the kernels are
    built on the machine that runs them; set e.g. "x86-64-v3" when building
    an image for other hosts).
"""
import os
import sys

from Cython.Build import cythonize
from setuptools import Extension, setup

march = os.environ.get("SIMPLE_SAMPLER_MARCH", "native")
compile_args = ["-O3", "-fopenmp", "-fno-math-errno", "-Wno-psabi"]
if march:
    compile_args.append(f"-march={march}")
if sys.platform == "darwin":
    compile_args = [a for a in compile_args if a != "-fopenmp"] + ["-Xpreprocessor", "-fopenmp"]

extensions = [
    Extension(
        "simple_sampler._sampling",
        sources=["cython_kernels/sampling.pyx"],
        include_dirs=["cython_kernels"],
        extra_compile_args=compile_args,
        extra_link_args=["-fopenmp"],
    )
]

setup(
    ext_modules=cythonize(
        extensions,
        include_path=["cython_kernels"],
        compiler_directives={"language_level": 3},
    )
)
