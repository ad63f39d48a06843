"""The two compiled kernels the features need from scipy, loaded without importing scipy's packages.

The Kaldi fbank runs a real FFT over blocks of frames and both features run a sparse (CSR) mel
product: scipy's pocketfft is about 6x faster than numpy's FFT on these blocks, and the CSR
product about 4x faster than the quickest numpy-only banded product measured (BENCHMARKS.md,
change 14). But `import scipy.fft` and `import scipy.sparse` run scipy's array-API layer, which
imports numpy.f2py and scipy.special: 0.15 s at every worker start, a quarter of it.

So this module loads the two extension modules' own files (`pypocketfft` and `_sparsetools`)
from the installed scipy, checks each against numpy on a small input, and uses them; if either
file is missing or disagrees (another scipy layout), it uses scipy's public functions instead,
which call the same kernels (same numbers, the import paid). `KERNELS.source` says which.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]
# (file inside the scipy package, without the extension suffix): module name = its last part
POCKETFFT = ("fft", "_pocketfft", "pypocketfft")
SPARSETOOLS = ("sparse", "_sparsetools")


@dataclass(frozen=True)
class CsrMatrix:
    """A sparse matrix in CSR form (what scipy.sparse.csr_matrix holds), for `Kernels.csr_matmul`."""

    shape: tuple[int, int]
    indptr: npt.NDArray[np.int32]
    indices: npt.NDArray[np.int32]
    data: Array

    @classmethod
    def from_dense(cls, dense: Array) -> CsrMatrix:
        rows, cols = np.nonzero(dense)  # row-major order: grouped by row, columns ascending
        indptr = np.zeros(dense.shape[0] + 1, dtype=np.int32)
        np.cumsum(np.bincount(rows, minlength=dense.shape[0]), out=indptr[1:])
        return cls(
            (int(dense.shape[0]), int(dense.shape[1])),
            indptr,
            cols.astype(np.int32),
            np.ascontiguousarray(dense[rows, cols]),
        )


class Kernels:
    """`rfft` along the last axis and `csr_matmul`, from scipy's compiled modules."""

    def __init__(self, pocketfft: ModuleType | None, sparsetools: ModuleType | None) -> None:
        self._pocketfft = pocketfft
        self._sparsetools = sparsetools
        self.compiled = pocketfft is not None and sparsetools is not None
        self.source = "scipy's compiled modules" if self.compiled else "scipy's public functions"

    def rfft(self, x: Array) -> Array:
        """The real FFT of `x` along its last axis (complex, n // 2 + 1 bins, no scaling)."""
        if self._pocketfft is None:
            import scipy.fft

            result: Array = scipy.fft.rfft(x, axis=-1)
            return result
        transformed: Array = self._pocketfft.r2c(x, axes=[x.ndim - 1], forward=True, inorm=0, nthreads=1)
        return transformed

    def csr_matmul(self, matrix: CsrMatrix, dense: Array) -> Array:
        """`matrix @ dense` for a 2-D `dense` of the matrix's dtype: [rows, dense.shape[1]]."""
        if self._sparsetools is None:
            import scipy.sparse

            csr = scipy.sparse.csr_matrix((matrix.data, matrix.indices, matrix.indptr), shape=matrix.shape)
            result: Array = csr @ dense
            return result
        x = np.ascontiguousarray(dense, dtype=matrix.data.dtype)
        out = np.zeros((matrix.shape[0], x.shape[1]), dtype=matrix.data.dtype)
        self._sparsetools.csr_matvecs(
            matrix.shape[0],
            matrix.shape[1],
            x.shape[1],
            matrix.indptr,
            matrix.indices,
            matrix.data,
            x.reshape(-1),
            out.reshape(-1),  # accumulated into in place: `out` is contiguous, so this is a view
        )
        return out


def _load_scipy_extension(parts: tuple[str, ...]) -> ModuleType | None:
    """The compiled module at `scipy/<parts>` loaded on its own (not entered in sys.modules), or
    None when scipy or the file is not there or it does not load."""
    spec = importlib.util.find_spec("scipy")  # a top-level name: finds it without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(next(iter(spec.submodule_search_locations)), *parts)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = base.with_name(base.name + suffix)
        if not path.is_file():
            continue
        try:
            loader = importlib.machinery.ExtensionFileLoader(parts[-1], str(path))
            module_spec = importlib.util.spec_from_file_location(parts[-1], path, loader=loader)
            if module_spec is None:
                return None
            module = importlib.util.module_from_spec(module_spec)
            loader.exec_module(module)
            return module
        except (ImportError, OSError):
            return None
    return None


def _checked(kernels: Kernels) -> bool:
    """Both kernels agree with numpy on a small input (a changed private signature fails here)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    dense = np.where(rng.random((4, 16)) < 0.3, rng.standard_normal((4, 16)), 0.0)
    vectors = rng.standard_normal((16, 5))
    try:
        spectrum = kernels.rfft(x)
        product = kernels.csr_matmul(CsrMatrix.from_dense(dense), vectors)
    except (AttributeError, TypeError, ValueError, RuntimeError):  # another module, other arguments
        return False
    return (
        spectrum.shape == (3, 9)
        and bool(np.allclose(spectrum, np.fft.rfft(x, axis=-1), rtol=1e-4, atol=1e-4))
        and bool(np.allclose(product, dense @ vectors, rtol=1e-12, atol=1e-12))
    )


def load_kernels() -> Kernels:
    """The compiled kernels if they load and pass the check, otherwise scipy's public functions."""
    direct = Kernels(_load_scipy_extension(POCKETFFT), _load_scipy_extension(SPARSETOOLS))
    if direct.compiled and _checked(direct):
        return direct
    return Kernels(None, None)


KERNELS = load_kernels()
