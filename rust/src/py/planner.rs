//! The stateless planning functions.

use pyo3::prelude::*;

use super::args;
use super::arrays::{bool_vec, i64_vec, slice};
use super::errors::fence;
use super::range::{wrap, PyBlockRange};
use crate::select::{EarlyInputs, Flag};
use numpy::{PyArray1, PyReadonlyArray1};

/// Positions of eligible requests and their early block counts.
type Selection<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<i64>>);

/// The early prefix slice ``[0, reused_len // tokens_per_block)``, or ``None`` when the reused
/// prefix holds no complete block.
#[pyfunction]
pub fn early_prefix_blocks(
    #[pyo3(from_py_with = args::tokens_per_block)] tokens_per_block: i64,
    #[pyo3(from_py_with = args::reused_len)] reused_len: i64,
) -> PyResult<Option<PyBlockRange>> {
    fence(|| {
        Ok(wrap(crate::plan::early_prefix_blocks(
            tokens_per_block,
            reused_len,
        )?))
    })
}

/// The blocks a finished prefill chunk ``[chunk_start, chunk_end)`` sends.
#[pyfunction]
#[pyo3(signature = (tokens_per_block, prompt_len, chunk_start, chunk_end, *, reused_len=0, prefix_sent=false, window=None))]
pub fn chunk_blocks(
    #[pyo3(from_py_with = args::tokens_per_block)] tokens_per_block: i64,
    #[pyo3(from_py_with = args::prompt_len)] prompt_len: i64,
    #[pyo3(from_py_with = args::chunk_start)] chunk_start: i64,
    #[pyo3(from_py_with = args::chunk_end)] chunk_end: i64,
    #[pyo3(from_py_with = args::reused_len)] reused_len: i64,
    #[pyo3(from_py_with = args::prefix_sent)] prefix_sent: bool,
    #[pyo3(from_py_with = args::window)] window: Option<i64>,
) -> PyResult<Option<PyBlockRange>> {
    fence(|| {
        Ok(wrap(crate::plan::chunk_blocks(
            tokens_per_block,
            prompt_len,
            chunk_start,
            chunk_end,
            reused_len,
            prefix_sent,
            window,
        )?))
    })
}

/// Positions and early block counts of the requests eligible for an early send.
/// ``pipelined`` is one bool for the batch or a bool array (one per request).
#[pyfunction]
#[pyo3(
    signature = (tokens_per_block, reused_len, *, context_only, cancelled, first_chunk, pipelined=None),
    text_signature = "(tokens_per_block, reused_len, *, context_only, cancelled, first_chunk, pipelined=True)"
)]
pub fn select_early<'py>(
    py: Python<'py>,
    #[pyo3(from_py_with = args::tokens_per_block)] tokens_per_block: i64,
    reused_len: &Bound<'py, PyAny>,
    context_only: &Bound<'py, PyAny>,
    cancelled: &Bound<'py, PyAny>,
    first_chunk: &Bound<'py, PyAny>,
    pipelined: Option<&Bound<'py, PyAny>>,
) -> PyResult<Selection<'py>> {
    fence(|| {
        let reused = i64_vec(reused_len, "reused_len")?;
        let context_only = bool_vec(context_only, "context_only")?;
        let cancelled = bool_vec(cancelled, "cancelled")?;
        let first_chunk = bool_vec(first_chunk, "first_chunk")?;
        let per_request: Option<PyReadonlyArray1<'py, bool>> = match pipelined {
            None => None,
            Some(p) if p.extract::<bool>().is_ok() => None,
            Some(p) => Some(bool_vec(p, "pipelined")?),
        };
        let flag = match (&per_request, pipelined) {
            (Some(array), _) => Flag::PerRequest(slice(array)?),
            (None, Some(p)) => Flag::All(p.extract::<bool>()?),
            (None, None) => Flag::All(true),
        };
        let inputs = EarlyInputs {
            reused_len: slice(&reused)?,
            context_only: slice(&context_only)?,
            cancelled: slice(&cancelled)?,
            first_chunk: slice(&first_chunk)?,
            pipelined: flag,
        };
        let (indices, blocks) = crate::select::select_early(tokens_per_block, &inputs)?;
        Ok((
            PyArray1::from_vec(py, indices),
            PyArray1::from_vec(py, blocks),
        ))
    })
}
