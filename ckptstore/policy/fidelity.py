"""What a lossy level promises, measured on the reconstruction the encoder actually wrote.

Each quantized tensor is judged in the quantity that decides what a restore gives back:
- a weight matrix (and SGD's momentum): the relative error of the tensor, ||W' - W|| / ||W||;
- Adam's first moment: the relative error of the update a resume takes first, u = m / sqrt(v + eps)
  with each commit's own v, ||u' - u|| / ||u||;
- Adam's second moment: its relative error (the grid, `v_levels_log2`, bounds each entry's ratio
  to the original, so this is measured and shown, not enforced).
The writer measures each chunk and, where a chunk is over its bound, encodes it again at a finer
step (`tighten`), so every chunk, and hence every tensor, keeps its bound.

A few outlier entries can hold most of a matrix's norm: a step in its RMS then rounds the rest to
zero while ||W' - W|| / ||W|| stays small. So a weight's bulk, its entries within BULK_SPREAD times
the whole tensor's median nonzero magnitude (`bulk_median`, planned once per tensor), keeps
BULK_ALLOWANCE times the bound as well, judged chunk by chunk (`bulk_error`): squared errors and norms
add up over chunks, so every chunk's bulk keeping it keeps the matrix's. A chunk's own median let an
embedding's trained rows and near-init rows, in different chunks, each keep theirs while the matrix's
bulk lost 46%.
"""

from __future__ import annotations

import math

import numpy as np

from ckptstore.codecs.floats import sum_of_squares, to_float32

# Retries per chunk before a bound counts as unreachable (see `finer`).
MAX_TIGHTEN = 8
# A weight chunk's outliers lie past this many times its median nonzero magnitude (a Gaussian's: past 6.7 sigma).
BULK_SPREAD = 10.0
BULK_SAMPLE = 4096  # magnitudes sampled for the median
# Its other entries keep this many times its bound: twice, so trained weights, whose few far entries
# hold a few percent of the norm, are coded as before (see bulk_error).
BULK_ALLOWANCE = 2.0


def chunk_error(codec: str, data: np.ndarray, recon: np.ndarray, params: dict,
                v: np.ndarray | None = None, v_recon: np.ndarray | None = None) -> tuple[float, float]:
    """(squared error, squared norm) of one chunk in its promise's quantity (module docstring).

    `v` and `v_recon` are a first moment's original and reconstructed second moment (bytes).
    """
    original = to_float32(data, params["dtype"])
    rebuilt = to_float32(recon, params["dtype"])
    if codec == "normmoment" and v is not None and v_recon is not None:
        eps = np.float32(params["eps"])
        original = original / np.sqrt(to_float32(v, params["v_dtype"]) + eps)
        rebuilt = rebuilt / np.sqrt(to_float32(v_recon, params["v_dtype"]) + eps)
    return sum_of_squares(rebuilt - original), sum_of_squares(original)


def bulk_error(codec: str, data: np.ndarray, recon: np.ndarray, params: dict, bound: float | None,
               norm_sq: float) -> tuple[float, float] | None:
    """(squared error, squared norm) of a weight chunk's bulk, scaled to be judged by `bound` (module docstring).

    For a chunk that keeps its bound. None where the bulk keeps it too for certain: no bound, no
    weight, or outliers holding at most 1 - 1/BULK_ALLOWANCE**2 of the norm (the bulk's relative
    error is then at most BULK_ALLOWANCE times the chunk's), as in every trained matrix measured.
    """
    if not bound or codec != "deadzone" or norm_sq <= 0:
        return None
    original = to_float32(data, params["dtype"])
    magnitude = np.abs(original)
    median = params.get("bulk_median")  # the whole tensor's; a plan made without it: the chunk's own
    outlying = magnitude > BULK_SPREAD * (_median(magnitude) if median is None else median)
    if sum_of_squares(original[outlying]) <= (1 - BULK_ALLOWANCE ** -2) * norm_sq:
        return None
    bulk = ~outlying
    kept = original[bulk]
    kept_sq = sum_of_squares(kept)
    if kept_sq <= 0:  # a bulk of zeros: the chunk's own bound is all there is to judge
        return None
    error_sq = sum_of_squares(to_float32(recon, params["dtype"])[bulk] - kept)
    return error_sq, kept_sq * BULK_ALLOWANCE * BULK_ALLOWANCE


def sample_positions(count: int) -> np.ndarray:
    """The flat positions (C order) of a tensor of `count` entries whose magnitudes give its median.

    All of a small tensor, else BULK_SAMPLE random places a seed fixes: no stride to alias with a
    matrix's columns, and the same places whether the tensor is read whole or shard by shard.
    """
    if count <= BULK_SAMPLE:
        return np.arange(count)
    return np.random.default_rng(0).integers(0, count, BULK_SAMPLE)


def median_nonzero(values: np.ndarray) -> float:
    """The median of the nonzero magnitudes among `values` (inf where none is).

    Not the mean: outliers in a fifth of the entries moved it past their own size.
    """
    magnitude = np.abs(np.asarray(values, dtype=np.float64))
    nonzero = magnitude[magnitude > 0]  # a pruned (sparse) matrix's zeros are no scale of its values
    return float(np.median(nonzero)) if nonzero.size else math.inf


def _median(magnitude: np.ndarray) -> float:
    """The sampled median of a chunk's nonzero magnitudes: for a plan that carries no `bulk_median`."""
    return median_nonzero(magnitude[sample_positions(magnitude.size)])


def within(error_sq: float, norm_sq: float, bound: float | None) -> bool:
    """Whether a chunk's relative error keeps `bound` (no bound, or an all-zero chunk kept exactly: yes)."""
    if not bound:
        return True
    return error_sq <= bound * bound * norm_sq


def finer(tighten: float, error_sq: float, norm_sq: float, bound: float) -> float:
    """The next retry's step factor: error scales with the step, so aim 10% under the bound.

    Each retry at least halves the step and at most divides it by 16 (levels are int32: a step
    far below the values would overflow them, which the measurement after would catch anyway).
    """
    if norm_sq <= 0:
        return tighten * 0.5
    measured = math.sqrt(error_sq / norm_sq)
    return tighten * min(0.5, max(1 / 16, 0.9 * bound / measured))
