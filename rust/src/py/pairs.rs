//! `kvferry.SlicePlan` and the physical block ids derived from it.

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::args;
use super::arrays::{i64_table, slice};
use super::errors::{fence, type_error};
use super::range::PyBlockRange;
use crate::book::SlicePlan;
use crate::error::CoreError;
use crate::pairs::{BlockPairs, BlockRuns, BlockTable};

/// Pair/run emission releases the GIL above this many blocks (about 10 us of work).
pub const DETACH_BLOCKS: u64 = 8192;

/// The slices planned for one batch, as parallel arrays (one element per slice). Row
/// ``request_index[k]`` of the block tables belongs to slice ``k``.
#[pyclass(frozen, name = "SlicePlan", module = "kvferry")]
pub struct PySlicePlan {
    plan: SlicePlan,
    pairs: Option<Py<PyBlockPairs>>,
}

impl PySlicePlan {
    /// Wraps a plan and, when the book emitted them with the plan, its block pairs.
    pub fn new(py: Python<'_>, plan: SlicePlan, pairs: Option<BlockPairs>) -> PyResult<Self> {
        let pairs = pairs
            .map(|p| Py::new(py, PyBlockPairs::from_core(py, p)))
            .transpose()?;
        Ok(Self { plan, pairs })
    }
}

#[pymethods]
impl PySlicePlan {
    /// Number of requests in the batch the plan was made from.
    #[getter]
    fn num_requests(&self) -> usize {
        self.plan.num_requests
    }

    /// Batch position of each slice's request (int64).
    #[getter]
    fn request_index<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.plan.request_index)
    }

    /// Request id of each slice (int64).
    #[getter]
    fn request_id<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.plan.request_id)
    }

    /// First block of each slice (int64).
    #[getter]
    fn start<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.plan.start)
    }

    /// One past the last block of each slice (int64).
    #[getter]
    fn end<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.plan.end)
    }

    /// True for the slice that finishes its request (bool).
    #[getter]
    fn last<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<bool>> {
        PyArray1::from_slice(py, &self.plan.last)
    }

    /// The physical block pairs, when the plan was made with block tables; else ``None``.
    #[getter]
    fn pairs(&self, py: Python<'_>) -> Option<Py<PyBlockPairs>> {
        self.pairs.as_ref().map(|p| p.clone_ref(py))
    }

    /// Total blocks over all slices.
    #[getter]
    fn total_blocks(&self) -> u64 {
        self.plan.total_blocks()
    }

    /// ``(request_id, BlockRange, last)`` per slice, for logs and tests (not the hot path).
    fn slices(&self) -> Vec<(i64, PyBlockRange, bool)> {
        (0..self.plan.len())
            .map(|k| {
                let range = crate::range::BlockRange::from_bounds(
                    self.plan.start[k] as u64,
                    self.plan.end[k] as u64,
                );
                (
                    self.plan.request_id[k],
                    PyBlockRange(range),
                    self.plan.last[k],
                )
            })
            .collect()
    }

    fn __len__(&self) -> usize {
        self.plan.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "SlicePlan(<{} slices, {} blocks, from {} requests>)",
            self.plan.len(),
            self.plan.total_blocks(),
            self.plan.num_requests
        )
    }
}

/// Physical ``(src, dst)`` block ids of a plan; slice ``k`` owns
/// ``src[offsets[k]:offsets[k+1]]``.
#[pyclass(frozen, name = "BlockPairs", module = "kvferry")]
pub struct PyBlockPairs {
    #[pyo3(get)]
    src: Py<PyArray1<i64>>,
    #[pyo3(get)]
    dst: Py<PyArray1<i64>>,
    #[pyo3(get)]
    offsets: Py<PyArray1<i64>>,
}

impl PyBlockPairs {
    fn from_core(py: Python<'_>, pairs: BlockPairs) -> Self {
        Self {
            src: PyArray1::from_vec(py, pairs.src).unbind(),
            dst: PyArray1::from_vec(py, pairs.dst).unbind(),
            offsets: PyArray1::from_vec(py, pairs.offsets).unbind(),
        }
    }
}

#[pymethods]
impl PyBlockPairs {
    fn __len__(&self, py: Python<'_>) -> usize {
        PyUntypedArrayMethods::len(self.src.bind(py))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "BlockPairs(<{} pairs>)",
            PyUntypedArrayMethods::len(self.src.bind(py))
        )
    }
}

/// Coalesced runs of a plan (both sides contiguous); slice ``k`` owns runs
/// ``offsets[k]:offsets[k+1]``.
#[pyclass(frozen, name = "BlockRuns", module = "kvferry")]
pub struct PyBlockRuns {
    #[pyo3(get)]
    src: Py<PyArray1<i64>>,
    #[pyo3(get)]
    dst: Py<PyArray1<i64>>,
    #[pyo3(get)]
    len: Py<PyArray1<i64>>,
    #[pyo3(get)]
    offsets: Py<PyArray1<i64>>,
}

#[pymethods]
impl PyBlockRuns {
    fn __len__(&self, py: Python<'_>) -> usize {
        PyUntypedArrayMethods::len(self.src.bind(py))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "BlockRuns(<{} runs>)",
            PyUntypedArrayMethods::len(self.src.bind(py))
        )
    }
}

/// Both block tables of a batch, borrowed from numpy for the duration of one call.
pub struct BorrowedTables<'py> {
    src: PyReadonlyArray2<'py, i64>,
    dst: PyReadonlyArray2<'py, i64>,
}

impl<'py> BorrowedTables<'py> {
    /// Borrows (or converts) both tables.
    pub fn borrow(
        src_block_table: &Bound<'py, PyAny>,
        dst_block_table: &Bound<'py, PyAny>,
    ) -> PyResult<Self> {
        Ok(Self {
            src: i64_table(src_block_table, "src_block_table")?,
            dst: i64_table(dst_block_table, "dst_block_table")?,
        })
    }

    /// Both tables or neither: one without the other is a caller bug.
    pub fn borrow_optional(
        src_block_table: Option<&Bound<'py, PyAny>>,
        dst_block_table: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Option<Self>> {
        match (src_block_table, dst_block_table) {
            (Some(s), Some(d)) => Self::borrow(s, d).map(Some),
            (None, None) => Ok(None),
            (Some(_), None) => {
                Err(
                    CoreError::invalid("dst_block_table", "None", "given with src_block_table")
                        .into(),
                )
            }
            (None, Some(_)) => {
                Err(
                    CoreError::invalid("src_block_table", "None", "given with dst_block_table")
                        .into(),
                )
            }
        }
    }

    /// Core views of the two tables.
    pub fn views(&self) -> PyResult<(BlockTable<'_>, BlockTable<'_>)> {
        let (s_shape, d_shape) = (self.src.shape(), self.dst.shape());
        let src = BlockTable::new("src_block_table", slice(&self.src)?, s_shape[0], s_shape[1])?;
        let dst = BlockTable::new("dst_block_table", slice(&self.dst)?, d_shape[0], d_shape[1])?;
        Ok((src, dst))
    }
}

/// `plan` of `block_pairs` / `block_runs`, refused by name when it is not a `SlicePlan`.
fn slice_plan<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PySlicePlan>> {
    obj.cast::<PySlicePlan>()
        .cloned()
        .map_err(|_| type_error("plan", "a SlicePlan", args::kind_and_value(obj)))
}

/// Runs `f` on the plan and both tables, without the GIL for big plans.
fn with_tables<T: Send>(
    py: Python<'_>,
    plan: &SlicePlan,
    src_block_table: &Bound<'_, PyAny>,
    dst_block_table: &Bound<'_, PyAny>,
    f: impl FnOnce(&SlicePlan, BlockTable<'_>, BlockTable<'_>) -> crate::Result<T> + Send,
) -> PyResult<T> {
    let tables = BorrowedTables::borrow(src_block_table, dst_block_table)?;
    let (src, dst) = tables.views()?;
    let result = if plan.total_blocks() > DETACH_BLOCKS {
        py.detach(|| f(plan, src, dst))
    } else {
        f(plan, src, dst)
    };
    Ok(result?)
}

/// The physical ``(src, dst)`` id of every planned block. Row ``i`` of each ``(n, max_blocks)``
/// int64 table maps request ``i`` of the planned batch's logical blocks to physical ids.
#[pyfunction]
pub fn block_pairs(
    py: Python<'_>,
    plan: &Bound<'_, PyAny>,
    src_block_table: &Bound<'_, PyAny>,
    dst_block_table: &Bound<'_, PyAny>,
) -> PyResult<PyBlockPairs> {
    fence(|| {
        let plan = slice_plan(plan)?;
        let BlockPairs { src, dst, offsets } = with_tables(
            py,
            &plan.get().plan,
            src_block_table,
            dst_block_table,
            crate::pairs::block_pairs,
        )?;
        Ok(PyBlockPairs {
            src: PyArray1::from_vec(py, src).unbind(),
            dst: PyArray1::from_vec(py, dst).unbind(),
            offsets: PyArray1::from_vec(py, offsets).unbind(),
        })
    })
}

/// The planned blocks as maximal runs where both source and destination ids are contiguous.
#[pyfunction]
pub fn block_runs(
    py: Python<'_>,
    plan: &Bound<'_, PyAny>,
    src_block_table: &Bound<'_, PyAny>,
    dst_block_table: &Bound<'_, PyAny>,
) -> PyResult<PyBlockRuns> {
    fence(|| {
        let BlockRuns {
            src,
            dst,
            len,
            offsets,
        } = with_tables(
            py,
            &slice_plan(plan)?.get().plan,
            src_block_table,
            dst_block_table,
            crate::pairs::block_runs,
        )?;
        Ok(PyBlockRuns {
            src: PyArray1::from_vec(py, src).unbind(),
            dst: PyArray1::from_vec(py, dst).unbind(),
            len: PyArray1::from_vec(py, len).unbind(),
            offsets: PyArray1::from_vec(py, offsets).unbind(),
        })
    })
}

/// Validates a copy's block ids and packs them as a ``(2, n)`` int64 array: row 0 the
/// sources, row 1 the destinations (one call instead of several array operations per copy).
#[pyfunction]
pub fn pack_pairs<'py>(
    py: Python<'py>,
    src_ids: &Bound<'py, PyAny>,
    dst_ids: &Bound<'py, PyAny>,
    #[pyo3(from_py_with = args::src_blocks)] src_blocks: i64,
    #[pyo3(from_py_with = args::dst_blocks)] dst_blocks: i64,
) -> PyResult<Bound<'py, numpy::PyArray2<i64>>> {
    fence(|| {
        let (s, d) = (
            super::arrays::i64_vec(src_ids, "src_ids")?,
            super::arrays::i64_vec(dst_ids, "dst_ids")?,
        );
        let (s, d) = (slice(&s)?, slice(&d)?);
        let n = s.len();
        let packed = crate::pairs::pack_pairs(s, d, src_blocks, dst_blocks)?;
        PyArray1::from_vec(py, packed).reshape([2, n])
    })
}
