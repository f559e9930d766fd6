//! `kvferry.BlockRange`: a frozen, hashable value.

use pyo3::prelude::*;

use super::args;
use super::errors::fence;
use crate::range::BlockRange;

/// Blocks ``[start, end)`` of one request's KV cache.
#[pyclass(frozen, eq, hash, name = "BlockRange", module = "kvferry")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyBlockRange(pub BlockRange);

#[pymethods]
impl PyBlockRange {
    #[new]
    fn new(
        #[pyo3(from_py_with = args::start)] start: i64,
        #[pyo3(from_py_with = args::end)] end: i64,
    ) -> PyResult<Self> {
        fence(|| Ok(Self(BlockRange::new(start, end)?)))
    }

    /// First block.
    #[getter]
    fn start(&self) -> u64 {
        self.0.start
    }

    /// One past the last block.
    #[getter]
    fn end(&self) -> u64 {
        self.0.end
    }

    fn __len__(&self) -> usize {
        self.0.len() as usize
    }

    fn __repr__(&self) -> String {
        format!("BlockRange({}, {})", self.0.start, self.0.end)
    }

    fn __getnewargs__(&self) -> (u64, u64) {
        (self.0.start, self.0.end)
    }
}

/// Converts an optional core range.
pub fn wrap(range: Option<BlockRange>) -> Option<PyBlockRange> {
    range.map(PyBlockRange)
}
