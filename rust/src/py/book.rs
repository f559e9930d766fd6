//! `kvferry.TransferBook` and the flat plans it returns: one call per scheduler step.

use pyo3::prelude::*;

use super::args;
use super::arrays::{i64_vec, slice};
use super::errors::{fence, type_error};
use super::ledger::PyTransferLedger;
use super::pairs::{BorrowedTables, PySlicePlan};
use super::range::PyBlockRange;
use super::spec::PyRequestSpec;
use crate::book::{RequestSpec, SlicePlan, TransferBook};
use crate::error::CoreError;
use crate::pairs::{BlockPairs, BlockTable};

/// The block pairs of `plan` when tables were given, checked against the pools' sizes when
/// those were given too.
fn pairs_if(
    plan: &SlicePlan,
    tables: Option<(BlockTable<'_>, BlockTable<'_>)>,
    pools: Pools,
) -> crate::Result<Option<BlockPairs>> {
    let Some((src, dst)) = tables else {
        return Ok(None);
    };
    let pairs = crate::pairs::block_pairs(plan, src, dst)?;
    crate::pairs::check_pools(plan, &pairs, pools.src, pools.dst)?;
    Ok(Some(pairs))
}

/// Block counts of the source and destination pools a plan's pairs must fit (`None`: not
/// checked).
#[derive(Clone, Copy)]
struct Pools {
    src: Option<i64>,
    dst: Option<i64>,
}

impl Pools {
    /// Pool sizes only mean something next to the tables they bound.
    fn new(src: Option<i64>, dst: Option<i64>, with_tables: bool) -> PyResult<Self> {
        if !with_tables {
            for (name, blocks) in [("src_blocks", src), ("dst_blocks", dst)] {
                if let Some(blocks) = blocks {
                    return Err(CoreError::invalid(
                        name,
                        blocks,
                        "given with src_block_table and dst_block_table",
                    )
                    .into());
                }
            }
        }
        Ok(Self { src, dst })
    }
}

/// A sequence of `BlockRange`s, refused by name otherwise.
pub fn held_ranges(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<crate::range::BlockRange>> {
    let not_ranges = || type_error(name, "a sequence of BlockRange", args::kind_and_value(obj));
    let mut out = Vec::new();
    for item in obj.try_iter().map_err(|_| not_ranges())? {
        let item = item?;
        let range = item.cast::<PyBlockRange>().map_err(|_| not_ranges())?;
        out.push(range.get().0);
    }
    Ok(out)
}

/// Whether planning a batch is worth releasing the GIL for.
fn detach(requests: usize, with_pairs: bool) -> bool {
    requests > DETACH_REQUESTS || (with_pairs && requests > DETACH_REQUESTS_WITH_PAIRS)
}

/// Batches larger than this release the GIL while they are planned: below it, the cost of
/// dropping and retaking the GIL is a noticeable share of a few-microsecond call.
const DETACH_REQUESTS: usize = 4096;
/// With block tables, batches above this many requests release the GIL: their pairs are
/// tens of microseconds of work (a reused prefix is hundreds of blocks per request).
const DETACH_REQUESTS_WITH_PAIRS: usize = 16;

/// What checks a plan's block pairs against the call's tables and pools (`pairs_if`).
type PairsCheck<'a> = dyn Fn(&SlicePlan) -> crate::Result<Option<BlockPairs>> + Sync + 'a;

/// The part every planning call shares: borrows the block tables (both or neither), checks
/// the pool sizes go with them, runs `plan` (the book's call, given the pairs check) with
/// the GIL released for a large batch of `requests`, and hands the plan to Python.
fn plan_batch(
    py: Python<'_>,
    requests: usize,
    (src_block_table, dst_block_table): (Option<&Bound<'_, PyAny>>, Option<&Bound<'_, PyAny>>),
    (src_blocks, dst_blocks): (Option<i64>, Option<i64>),
    plan: impl Send + FnOnce(&PairsCheck<'_>) -> crate::Result<(SlicePlan, Option<BlockPairs>)>,
) -> PyResult<PySlicePlan> {
    let tables = BorrowedTables::borrow_optional(src_block_table, dst_block_table)?;
    let views = tables.as_ref().map(BorrowedTables::views).transpose()?;
    let with_pairs = views.is_some();
    let pools = Pools::new(src_blocks, dst_blocks, with_pairs)?;
    let check = move |plan: &SlicePlan| pairs_if(plan, views, pools);
    let run = || plan(&check);
    let (plan, pairs) = if detach(requests, with_pairs) {
        py.detach(run)
    } else {
        run()
    }?;
    PySlicePlan::new(py, plan, pairs)
}

/// A chunk-batch call (`plan_chunks`, `plan_layers`): the chunk slices of `chunks`
/// (request ids, starts, ends), or the layer slices of `layer_group` when given.
fn plan_chunk_batch(
    py: Python<'_>,
    book: &mut TransferBook,
    (request_ids, chunk_starts, chunk_ends): (
        &Bound<'_, PyAny>,
        &Bound<'_, PyAny>,
        &Bound<'_, PyAny>,
    ),
    layer_group: Option<i64>,
    tables: (Option<&Bound<'_, PyAny>>, Option<&Bound<'_, PyAny>>),
    pools: (Option<i64>, Option<i64>),
) -> PyResult<PySlicePlan> {
    let (ids, starts, ends) = (
        i64_vec(request_ids, "request_ids")?,
        i64_vec(chunk_starts, "chunk_starts")?,
        i64_vec(chunk_ends, "chunk_ends")?,
    );
    let (ids, starts, ends) = (slice(&ids)?, slice(&starts)?, slice(&ends)?);
    plan_batch(py, ids.len(), tables, pools, |check| match layer_group {
        None => book.plan_chunks_then(ids, starts, ends, check),
        Some(group) => book.plan_layers_then(ids, starts, ends, group, check),
    })
}

/// The transfer ledgers of every live request of one worker, planned a batch at a time.
/// Owned by the executor thread that runs the scheduler loop.
#[pyclass(name = "TransferBook", module = "kvferry")]
pub struct PyTransferBook(TransferBook);

#[pymethods]
impl PyTransferBook {
    #[new]
    #[pyo3(signature = (tokens_per_block, *, pipelined=true, layer_groups=1))]
    fn new(
        #[pyo3(from_py_with = args::tokens_per_block)] tokens_per_block: i64,
        #[pyo3(from_py_with = args::pipelined)] pipelined: bool,
        #[pyo3(from_py_with = args::layer_groups)] layer_groups: i64,
    ) -> PyResult<Self> {
        fence(|| {
            Ok(Self(TransferBook::with_layer_groups(
                tokens_per_block,
                pipelined,
                layer_groups,
            )?))
        })
    }

    /// Layer groups whose blocks may stream separately (``plan_layers``).
    #[getter]
    fn layer_groups(&self) -> usize {
        self.0.layer_groups()
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
        #[pyo3(from_py_with = args::request_id)] request_id: i64,
        #[pyo3(from_py_with = args::prompt_len)] prompt_len: i64,
        #[pyo3(from_py_with = args::reused_len)] reused_len: i64,
        #[pyo3(from_py_with = args::window)] window: Option<i64>,
        #[pyo3(from_py_with = args::context_only)] context_only: bool,
    ) -> PyResult<()> {
        let spec = RequestSpec {
            prompt_len,
            reused_len,
            window,
            context_only,
        };
        fence(|| Ok(self.0.add(request_id, spec)?))
    }

    /// Registers a request from its `RequestSpec`, with the blocks it holds: all or nothing
    /// (a refused ``held`` leaves the request out of the book).
    fn add_spec(
        &mut self,
        #[pyo3(from_py_with = args::request_id)] request_id: i64,
        spec: &Bound<'_, PyRequestSpec>,
    ) -> PyResult<()> {
        let spec = spec.get();
        fence(|| {
            self.0.add(request_id, spec.spec)?;
            if let Err(err) = self.0.hold(request_id, &spec.held) {
                self.0.remove(request_id)?;
                return Err(err.into());
            }
            Ok(())
        })
    }

    /// Records blocks the generation worker already holds for a request (advertised before
    /// prefill): they count as sent and every slice skips them. All or nothing.
    fn hold(
        &mut self,
        #[pyo3(from_py_with = args::request_id)] request_id: i64,
        ranges: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let ranges = held_ranges(ranges, "ranges")?;
        fence(|| Ok(self.0.hold(request_id, &ranges)?))
    }

    /// Blocks of a request the receiver already holds.
    fn held_blocks(
        &self,
        #[pyo3(from_py_with = args::request_id)] request_id: i64,
    ) -> PyResult<u64> {
        fence(|| Ok(self.0.ledger(request_id)?.held_blocks()))
    }

    /// Forgets a request, freeing its ledger, and returns the ledger.
    fn remove(
        &mut self,
        #[pyo3(from_py_with = args::request_id)] request_id: i64,
    ) -> PyResult<PyTransferLedger> {
        fence(|| Ok(PyTransferLedger(self.0.remove(request_id)?)))
    }

    /// Marks a request cancelled: no early send is planned for it any more.
    fn cancel(&mut self, #[pyo3(from_py_with = args::request_id)] request_id: i64) -> PyResult<()> {
        fence(|| Ok(self.0.cancel(request_id)?))
    }

    /// Whether a request was cancelled.
    fn is_cancelled(
        &self,
        #[pyo3(from_py_with = args::request_id)] request_id: i64,
    ) -> PyResult<bool> {
        fence(|| Ok(self.0.is_cancelled(request_id)?))
    }

    /// Whether every needed block of a request has been planned.
    fn is_complete(
        &self,
        #[pyo3(from_py_with = args::request_id)] request_id: i64,
    ) -> PyResult<bool> {
        fence(|| Ok(self.0.ledger(request_id)?.is_complete()))
    }

    /// Whether a request's prefix left early.
    fn prefix_sent(
        &self,
        #[pyo3(from_py_with = args::request_id)] request_id: i64,
    ) -> PyResult<bool> {
        fence(|| Ok(self.0.ledger(request_id)?.prefix_sent()))
    }

    /// Blocks of a request planned so far.
    fn claimed_blocks(
        &self,
        #[pyo3(from_py_with = args::request_id)] request_id: i64,
    ) -> PyResult<u64> {
        fence(|| Ok(self.0.ledger(request_id)?.claimed_blocks()))
    }

    /// Needed blocks of a request not yet planned.
    fn missing(
        &self,
        #[pyo3(from_py_with = args::request_id)] request_id: i64,
    ) -> PyResult<Vec<PyBlockRange>> {
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
    /// With both block tables, the plan also carries its block pairs (``plan.pairs``), and a
    /// table that cannot serve the plan fails the call before anything is claimed. With the
    /// pools' block counts (``src_blocks``, ``dst_blocks``) too, so does a planned id outside
    /// its pool or a destination planned twice: what the copy would refuse after the claim.
    #[pyo3(signature = (request_ids, *, src_block_table=None, dst_block_table=None, src_blocks=None, dst_blocks=None))]
    fn plan_early(
        &mut self,
        py: Python<'_>,
        request_ids: &Bound<'_, PyAny>,
        src_block_table: Option<&Bound<'_, PyAny>>,
        dst_block_table: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = args::opt_src_blocks)] src_blocks: Option<i64>,
        #[pyo3(from_py_with = args::opt_dst_blocks)] dst_blocks: Option<i64>,
    ) -> PyResult<PySlicePlan> {
        fence(|| {
            let ids = i64_vec(request_ids, "request_ids")?;
            let ids = slice(&ids)?;
            let book = &mut self.0;
            plan_batch(
                py,
                ids.len(),
                (src_block_table, dst_block_table),
                (src_blocks, dst_blocks),
                |check| book.plan_early_then(ids, check),
            )
        })
    }

    /// Plans and claims the slices of a batch of finished prefill chunks; block tables as in
    /// ``plan_early``.
    #[pyo3(signature = (request_ids, chunk_starts, chunk_ends, *, src_block_table=None, dst_block_table=None, src_blocks=None, dst_blocks=None))]
    #[allow(clippy::too_many_arguments)] // the Python signature: keyword arguments, no Rust caller
    fn plan_chunks(
        &mut self,
        py: Python<'_>,
        request_ids: &Bound<'_, PyAny>,
        chunk_starts: &Bound<'_, PyAny>,
        chunk_ends: &Bound<'_, PyAny>,
        src_block_table: Option<&Bound<'_, PyAny>>,
        dst_block_table: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = args::opt_src_blocks)] src_blocks: Option<i64>,
        #[pyo3(from_py_with = args::opt_dst_blocks)] dst_blocks: Option<i64>,
    ) -> PyResult<PySlicePlan> {
        let chunks = (request_ids, chunk_starts, chunk_ends);
        let (tables, pools) = ((src_block_table, dst_block_table), (src_blocks, dst_blocks));
        fence(|| plan_chunk_batch(py, &mut self.0, chunks, None, tables, pools))
    }

    /// Plans and claims the layer slices of one layer group for a batch of prefill chunks
    /// whose forward finished that group's layers (layer-wise streaming): each chunk's slice
    /// minus held blocks and blocks that group already sent. ``plan_chunks`` still follows
    /// for the chunk, and then plans only blocks not every group sent. Block tables as in
    /// ``plan_early``.
    #[pyo3(signature = (request_ids, chunk_starts, chunk_ends, layer_group, *, src_block_table=None, dst_block_table=None, src_blocks=None, dst_blocks=None))]
    #[allow(clippy::too_many_arguments)] // the Python signature: keyword arguments, no Rust caller
    fn plan_layers(
        &mut self,
        py: Python<'_>,
        request_ids: &Bound<'_, PyAny>,
        chunk_starts: &Bound<'_, PyAny>,
        chunk_ends: &Bound<'_, PyAny>,
        #[pyo3(from_py_with = args::layer_group)] layer_group: i64,
        src_block_table: Option<&Bound<'_, PyAny>>,
        dst_block_table: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = args::opt_src_blocks)] src_blocks: Option<i64>,
        #[pyo3(from_py_with = args::opt_dst_blocks)] dst_blocks: Option<i64>,
    ) -> PyResult<PySlicePlan> {
        let chunks = (request_ids, chunk_starts, chunk_ends);
        let (tables, pools) = ((src_block_table, dst_block_table), (src_blocks, dst_blocks));
        fence(|| plan_chunk_batch(py, &mut self.0, chunks, Some(layer_group), tables, pools))
    }

    fn __len__(&self) -> usize {
        self.0.len()
    }

    /// Like a dict: anything that is not an int64 is simply not in the book.
    fn __contains__(&self, request_id: &Bound<'_, PyAny>) -> bool {
        request_id
            .extract::<i64>()
            .is_ok_and(|id| self.0.contains(id))
    }

    fn __repr__(&self) -> String {
        // `layer_groups` only when set, so the common repr stays as it was.
        let groups = match self.0.layer_groups() {
            1 => String::new(),
            n => format!(", layer_groups={n}"),
        };
        format!(
            "TransferBook({}, pipelined={}{groups}) <{} live requests>",
            self.0.tokens_per_block(),
            if self.0.pipelined() { "True" } else { "False" },
            self.0.len()
        )
    }
}
