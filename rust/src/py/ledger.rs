//! `kvferry.TransferLedger`: one request's ownership bitmap.

use pyo3::prelude::*;

use super::args;
use super::errors::{fence, type_error};
use super::range::{wrap, PyBlockRange};
use crate::ledger::Ledger;
use crate::plan::Prompt;

/// `range` of `claim`: a `BlockRange`, refused by name otherwise (`PyO3` would only note it).
fn range_arg(obj: &Bound<'_, PyAny>) -> PyResult<PyBlockRange> {
    obj.cast::<PyBlockRange>()
        .map(|r| *r.get())
        .map_err(|_| type_error("range", "a BlockRange", args::kind_and_value(obj)))
}

/// Which blocks of one request have left; every block leaves exactly once.
/// Owned by whoever drives that request's transfer (one thread at a time).
#[pyclass(name = "TransferLedger", module = "kvferry")]
pub struct PyTransferLedger(pub Ledger);

#[pymethods]
impl PyTransferLedger {
    #[new]
    #[pyo3(signature = (tokens_per_block, prompt_len, *, reused_len=0, window=None))]
    fn new(
        #[pyo3(from_py_with = args::tokens_per_block)] tokens_per_block: i64,
        #[pyo3(from_py_with = args::prompt_len)] prompt_len: i64,
        #[pyo3(from_py_with = args::reused_len)] reused_len: i64,
        #[pyo3(from_py_with = args::window)] window: Option<i64>,
    ) -> PyResult<Self> {
        fence(|| {
            Ok(Self(Ledger::new(Prompt::new(
                tokens_per_block,
                prompt_len,
                reused_len,
                window,
            )?)?))
        })
    }

    /// Tokens per block.
    #[getter]
    fn tokens_per_block(&self) -> u64 {
        self.0.prompt().tokens_per_block()
    }

    /// Prompt length in tokens.
    #[getter]
    fn prompt_len(&self) -> u64 {
        self.0.prompt().prompt_len()
    }

    /// Reused prompt length in tokens.
    #[getter]
    fn reused_len(&self) -> u64 {
        self.0.prompt().reused_len()
    }

    /// Sliding window shorter than the prompt, else ``None``.
    #[getter]
    fn window(&self) -> Option<u64> {
        self.0.prompt().window()
    }

    /// ``ceil(prompt_len / tokens_per_block)``.
    #[getter]
    fn num_blocks(&self) -> u64 {
        self.0.num_blocks()
    }

    /// True once the early prefix slice was claimed.
    #[getter]
    fn prefix_sent(&self) -> bool {
        self.0.prefix_sent()
    }

    /// True once a chunk was recorded (a forward has run).
    #[getter]
    fn forward_started(&self) -> bool {
        self.0.forward_started()
    }

    /// Number of claimed blocks.
    #[getter]
    fn claimed_blocks(&self) -> u64 {
        self.0.claimed_blocks()
    }

    /// True when every needed block is claimed.
    #[getter]
    fn is_complete(&self) -> bool {
        self.0.is_complete()
    }

    /// Claims and returns the early prefix slice, or ``None`` when there is nothing to send
    /// early. Raises ``DuplicateTransferError`` when it was already sent.
    fn send_early(&mut self) -> PyResult<Option<PyBlockRange>> {
        fence(|| Ok(wrap(self.0.send_early()?)))
    }

    /// Claims and returns the slice of a finished chunk ``[chunk_start, chunk_end)``.
    fn send_chunk(
        &mut self,
        #[pyo3(from_py_with = args::chunk_start)] chunk_start: i64,
        #[pyo3(from_py_with = args::chunk_end)] chunk_end: i64,
    ) -> PyResult<Option<PyBlockRange>> {
        fence(|| Ok(wrap(self.0.send_chunk(chunk_start, chunk_end)?)))
    }

    /// Claims an explicit range; nothing changes on error.
    fn claim(&mut self, #[pyo3(from_py_with = range_arg)] range: PyBlockRange) -> PyResult<()> {
        fence(|| Ok(self.0.claim(range.0)?))
    }

    /// Claims an explicit range for one layer group (a layer slice that arrived): refused,
    /// changing nothing, if a block of it is claimed whole or that group claimed it before.
    /// A block counts as claimed once every one of ``layer_groups`` groups claimed it.
    fn claim_layer(
        &mut self,
        #[pyo3(from_py_with = range_arg)] range: PyBlockRange,
        #[pyo3(from_py_with = args::layer_group)] layer_group: i64,
        #[pyo3(from_py_with = args::layer_groups)] layer_groups: i64,
    ) -> PyResult<()> {
        fence(|| Ok(self.0.claim_layer(range.0, layer_group, layer_groups)?))
    }

    /// Needed blocks not yet claimed, as maximal ranges.
    fn missing(&self) -> Vec<PyBlockRange> {
        self.0.missing().into_iter().map(PyBlockRange).collect()
    }

    fn __repr__(&self) -> String {
        let p = self.0.prompt();
        let window = p
            .window()
            .map_or_else(|| "None".to_string(), |w| w.to_string());
        format!(
            "TransferLedger({}, {}, reused_len={}, window={window}) <{}/{} blocks claimed>",
            p.tokens_per_block(),
            p.prompt_len(),
            p.reused_len(),
            self.0.claimed_blocks(),
            self.0.num_blocks()
        )
    }
}
