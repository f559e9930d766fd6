//! `kvferry.TransferBook` and the flat plans it returns: one call per scheduler step.

use numpy::{PyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::arrays::{i64_table, i64_vec, slice};
use super::errors::fence;
use super::ledger::PyTransferLedger;
use super::range::PyBlockRange;
use crate::book::{RequestSpec, SlicePlan, TransferBook};
use crate::pairs::{BlockPairs, BlockRuns, BlockTable};

/// Batches larger than this release the GIL while they are planned: below it, the cost of
/// dropping and retaking the GIL is a noticeable share of a few-microsecond call.
const DETACH_REQUESTS: usize = 4096;
/// Pair/run emission releases the GIL above this many blocks (about 10 us of work).
const DETACH_BLOCKS: u64 = 8192;

/// The transfer ledgers of every live request of one worker, planned a batch at a time.
/// Owned by the executor thread that runs the scheduler loop.
#[pyclass(name = "TransferBook", module = "kvferry")]
pub struct PyTransferBook(TransferBook);

#[pymethods]
impl PyTransferBook {
    #[new]
    #[pyo3(signature = (tokens_per_block, *, pipelined=true))]
    fn new(tokens_per_block: i64, pipelined: bool) -> PyResult<Self> {
        fence(|| Ok(Self(TransferBook::new(tokens_per_block, pipelined)?)))
    }

    /// Tokens per block.
    #[getter]
    fn tokens_per_block(&self) -> i64 {
        self.0.tokens_per_block()
    }

    /// Whether early sends are enabled.
    #[getter]
    fn pipelined(&self) -> bool {
        self.0.pipelined()
    }

    /// Registers a request that just arrived.
    #[pyo3(signature = (request_id, prompt_len, *, reused_len=0, window=None, context_only=true))]
    fn add(
        &mut self,
        request_id: i64,
        prompt_len: i64,
        reused_len: i64,
        window: Option<i64>,
        context_only: bool,
    ) -> PyResult<()> {
        let spec = RequestSpec {
            prompt_len,
            reused_len,
            window,
            context_only,
        };
        fence(|| Ok(self.0.add(request_id, spec)?))
    }

    /// Forgets a request, freeing its ledger, and returns the ledger.
    fn remove(&mut self, request_id: i64) -> PyResult<PyTransferLedger> {
        fence(|| Ok(PyTransferLedger(self.0.remove(request_id)?)))
    }

    /// Marks a request cancelled: no early send is planned for it any more.
    fn cancel(&mut self, request_id: i64) -> PyResult<()> {
        fence(|| Ok(self.0.cancel(request_id)?))
    }

    /// Whether a request was cancelled.
    fn is_cancelled(&self, request_id: i64) -> PyResult<bool> {
        fence(|| Ok(self.0.is_cancelled(request_id)?))
    }

    /// Whether every needed block of a request has been planned.
    fn is_complete(&self, request_id: i64) -> PyResult<bool> {
        fence(|| Ok(self.0.ledger(request_id)?.is_complete()))
    }

    /// Whether a request's prefix left early.
    fn prefix_sent(&self, request_id: i64) -> PyResult<bool> {
        fence(|| Ok(self.0.ledger(request_id)?.prefix_sent()))
    }

    /// Blocks of a request planned so far.
    fn claimed_blocks(&self, request_id: i64) -> PyResult<u64> {
        fence(|| Ok(self.0.ledger(request_id)?.claimed_blocks()))
    }

    /// Needed blocks of a request not yet planned.
    fn missing(&self, request_id: i64) -> PyResult<Vec<PyBlockRange>> {
        fence(|| {
            Ok(self
                .0
                .ledger(request_id)?
                .missing()
                .into_iter()
                .map(PyBlockRange)
                .collect())
        })
    }

    /// Plans and claims the early prefix slices of the batch about to run its context forward.
    fn plan_early(
        &mut self,
        py: Python<'_>,
        request_ids: &Bound<'_, PyAny>,
    ) -> PyResult<PySlicePlan> {
        fence(|| {
            let ids = i64_vec(request_ids, "request_ids")?;
            let ids = slice(&ids)?;
            let book = &mut self.0;
            let plan = if ids.len() > DETACH_REQUESTS {
                py.detach(|| book.plan_early(ids))
            } else {
                book.plan_early(ids)
            };
            Ok(PySlicePlan(plan?))
        })
    }

    /// Plans and claims the slices of a batch of finished prefill chunks.
    fn plan_chunks(
        &mut self,
        py: Python<'_>,
        request_ids: &Bound<'_, PyAny>,
        chunk_starts: &Bound<'_, PyAny>,
        chunk_ends: &Bound<'_, PyAny>,
    ) -> PyResult<PySlicePlan> {
        fence(|| {
            let (ids, starts, ends) = (
                i64_vec(request_ids, "request_ids")?,
                i64_vec(chunk_starts, "chunk_starts")?,
                i64_vec(chunk_ends, "chunk_ends")?,
            );
            let (ids, starts, ends) = (slice(&ids)?, slice(&starts)?, slice(&ends)?);
            let book = &mut self.0;
            let plan = if ids.len() > DETACH_REQUESTS {
                py.detach(|| book.plan_chunks(ids, starts, ends))
            } else {
                book.plan_chunks(ids, starts, ends)
            };
            Ok(PySlicePlan(plan?))
        })
    }

    fn __len__(&self) -> usize {
        self.0.len()
    }

    fn __contains__(&self, request_id: i64) -> bool {
        self.0.contains(request_id)
    }

    fn __repr__(&self) -> String {
        format!(
            "TransferBook({}, pipelined={}) <{} live requests>",
            self.0.tokens_per_block(),
            if self.0.pipelined() { "True" } else { "False" },
            self.0.len()
        )
    }
}

/// The slices planned for one batch, as parallel arrays (one element per slice). Row
/// ``request_index[k]`` of the block tables belongs to slice ``k``.
#[pyclass(frozen, name = "SlicePlan", module = "kvferry")]
pub struct PySlicePlan(SlicePlan);

#[pymethods]
impl PySlicePlan {
    /// Number of requests in the batch the plan was made from.
    #[getter]
    fn num_requests(&self) -> usize {
        self.0.num_requests
    }

    /// Batch position of each slice's request (int64).
    #[getter]
    fn request_index<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.0.request_index)
    }

    /// Request id of each slice (int64).
    #[getter]
    fn request_id<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.0.request_id)
    }

    /// First block of each slice (int64).
    #[getter]
    fn start<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.0.start)
    }

    /// One past the last block of each slice (int64).
    #[getter]
    fn end<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.0.end)
    }

    /// True for the slice that finishes its request (bool).
    #[getter]
    fn last<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<bool>> {
        PyArray1::from_slice(py, &self.0.last)
    }

    /// Total blocks over all slices.
    #[getter]
    fn total_blocks(&self) -> u64 {
        self.0.total_blocks()
    }

    /// ``(request_id, BlockRange, last)`` per slice, for logs and tests (not the hot path).
    fn slices(&self) -> Vec<(i64, PyBlockRange, bool)> {
        (0..self.0.len())
            .map(|k| {
                let range = crate::range::BlockRange::from_bounds(
                    self.0.start[k] as u64,
                    self.0.end[k] as u64,
                );
                (self.0.request_id[k], PyBlockRange(range), self.0.last[k])
            })
            .collect()
    }

    fn __len__(&self) -> usize {
        self.0.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "SlicePlan(<{} slices, {} blocks, from {} requests>)",
            self.0.len(),
            self.0.total_blocks(),
            self.0.num_requests
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

/// Borrows both tables and runs `f` on them, without the GIL for big plans.
fn with_tables<T: Send>(
    py: Python<'_>,
    plan: &SlicePlan,
    src_block_table: &Bound<'_, PyAny>,
    dst_block_table: &Bound<'_, PyAny>,
    f: impl FnOnce(&SlicePlan, BlockTable<'_>, BlockTable<'_>) -> crate::Result<T> + Send,
) -> PyResult<T> {
    let src: PyReadonlyArray2<'_, i64> = i64_table(src_block_table, "src_block_table")?;
    let dst = i64_table(dst_block_table, "dst_block_table")?;
    let (s_shape, d_shape) = (src.shape(), dst.shape());
    let (s, d) = (slice(&src)?, slice(&dst)?);
    let src = BlockTable::new("src_block_table", s, s_shape[0], s_shape[1])?;
    let dst = BlockTable::new("dst_block_table", d, d_shape[0], d_shape[1])?;
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
    plan: &PySlicePlan,
    src_block_table: &Bound<'_, PyAny>,
    dst_block_table: &Bound<'_, PyAny>,
) -> PyResult<PyBlockPairs> {
    fence(|| {
        let BlockPairs { src, dst, offsets } = with_tables(
            py,
            &plan.0,
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
    plan: &PySlicePlan,
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
            &plan.0,
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
