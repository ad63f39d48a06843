"""scipy's FFT and CSR kernels loaded without scipy's packages (`pipeline.kernels`), and the
frame sums of the Kaldi fbank (`pipeline.features.frame_sums`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import scipy.fft
import scipy.sparse

from pipeline import kernels
from pipeline.features import KALDI_FRAME, KALDI_SHIFT, frame_sums
from pipeline.kernels import KERNELS, CsrMatrix, Kernels

PUBLIC = Kernels(None, None)


def banded(rows: int, cols: int, dtype: type[np.floating]) -> np.ndarray:
    """A matrix shaped like mel filters: a few non-zero weights per row, some rows empty."""
    rng = np.random.default_rng(rows)
    dense = np.zeros((rows, cols))
    for r in range(rows):
        if r % 7 == 3:
            continue
        start, width = int(rng.integers(0, cols - 4)), int(rng.integers(1, 5))
        dense[r, start : start + width] = rng.random(width)
    return dense.astype(dtype)


def test_the_compiled_kernels_load_on_this_install() -> None:
    assert KERNELS.source == "scipy's compiled modules"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rfft_is_scipys_bit_for_bit(dtype: type[np.floating]) -> None:
    x = np.random.default_rng(0).standard_normal((37, 512)).astype(dtype)
    expected = scipy.fft.rfft(x, axis=-1)
    for implementation in (KERNELS, PUBLIC):
        got = implementation.rfft(x)
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_csr_matmul_is_scipys_bit_for_bit(dtype: type[np.floating]) -> None:
    dense = banded(80, 256, dtype)
    matrix = CsrMatrix.from_dense(dense)
    vectors = np.random.default_rng(1).random((256, 300)).astype(dtype)
    expected = scipy.sparse.csr_matrix(dense) @ vectors
    for implementation in (KERNELS, PUBLIC):
        got = implementation.csr_matmul(matrix, vectors)
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got, expected)
    # a transposed (non-contiguous) operand, as the fbank passes its power spectrum
    np.testing.assert_array_equal(
        KERNELS.csr_matmul(matrix, np.ascontiguousarray(vectors.T).T), expected
    )


def test_csr_matrix_holds_what_scipy_holds() -> None:
    dense = banded(20, 64, np.float32)
    ours, theirs = CsrMatrix.from_dense(dense), scipy.sparse.csr_matrix(dense)
    assert ours.shape == theirs.shape
    np.testing.assert_array_equal(ours.indptr, theirs.indptr)
    np.testing.assert_array_equal(ours.indices, theirs.indices)
    np.testing.assert_array_equal(ours.data, theirs.data)


def test_a_missing_compiled_module_falls_back_to_scipys_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "POCKETFFT", ("fft", "_pocketfft", "no_such_module"))
    fallback = kernels.load_kernels()
    assert fallback.source == "scipy's public functions"
    x = np.random.default_rng(2).standard_normal((3, 512)).astype(np.float32)
    np.testing.assert_array_equal(fallback.rfft(x), scipy.fft.rfft(x, axis=-1))


def test_a_kernel_that_disagrees_with_numpy_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another scipy whose private module takes other arguments: the check at load refuses it."""
    monkeypatch.setattr(kernels, "SPARSETOOLS", ("fft", "_pocketfft", "pypocketfft"))  # no csr_matvecs
    assert kernels.load_kernels().source == "scipy's public functions"


def test_features_import_no_scipy_package() -> None:
    """The point of the module: a worker computing both features never imports scipy's packages."""
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        from pipeline.features import kaldi_fbank, whisper_log_mel
        wave = np.random.default_rng(0).standard_normal(48000).astype(np.float32) * 0.1
        assert kaldi_fbank(wave).shape == (298, 80)
        assert whisper_log_mel(wave).shape == (128, 300)
        print(sorted(name for name in sys.modules if name.split(".")[0] == "scipy"))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("n_samples", [400, 559, 560, 16000, 400_001])
def test_frame_sums_are_each_frames_sum(n_samples: int) -> None:
    wave = np.random.default_rng(n_samples).standard_normal(n_samples).astype(np.float32)
    n_frames = 1 + (n_samples - KALDI_FRAME) // KALDI_SHIFT
    starts = [i * KALDI_SHIFT for i in range(n_frames)]
    expected = [wave[s : s + KALDI_FRAME].astype(np.float64).sum() for s in starts]
    np.testing.assert_allclose(frame_sums(wave, n_frames), expected, rtol=0, atol=1e-12)
