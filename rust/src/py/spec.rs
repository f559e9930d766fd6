//! `kvferry.RequestSpec`: a request's specification, declared once for every layer that
//! registers a request (the book, the sender, the multi-peer sender, the executor hook).

use pyo3::prelude::*;
use pyo3::types::PyBool;

use super::args;
use super::book::held_ranges;
use super::errors::type_error;
use super::range::PyBlockRange;
use crate::book::RequestSpec;
use crate::error::CoreError;
use crate::range::BlockRange;

/// A request as it arrives: the core's [`RequestSpec`] (what the book plans with), the blocks
/// the receiver already holds, and the lease (epoch) the receiver issued for its destination
/// blocks (0: none given).
#[pyclass(frozen, eq, hash, name = "RequestSpec", module = "kvferry")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyRequestSpec {
    pub spec: RequestSpec,
    pub held: Vec<BlockRange>,
    pub epoch: i64,
}

/// `epoch`: an integer in `[0, 2**63)`, never a bool.
fn epoch(obj: &Bound<'_, PyAny>) -> PyResult<i64> {
    if obj.cast::<PyBool>().is_ok() {
        return Err(type_error("epoch", "an integer", args::kind_and_value(obj)));
    }
    let value = args::int(obj, "epoch")?;
    if value < 0 {
        return Err(CoreError::invalid("epoch", value, "in [0, 2**63) (0: none issued)").into());
    }
    Ok(value)
}

#[pymethods]
impl PyRequestSpec {
    #[new]
    #[pyo3(signature = (prompt_len, *, reused_len=0, window=None, context_only=true, held=None, epoch=0))]
    fn new(
        #[pyo3(from_py_with = args::prompt_len)] prompt_len: i64,
        #[pyo3(from_py_with = args::reused_len)] reused_len: i64,
        #[pyo3(from_py_with = args::window)] window: Option<i64>,
        #[pyo3(from_py_with = args::context_only)] context_only: bool,
        held: Option<&Bound<'_, PyAny>>,
        #[pyo3(from_py_with = self::epoch)] epoch: i64,
    ) -> PyResult<Self> {
        let held = match held {
            None => Vec::new(),
            Some(obj) => held_ranges(obj, "held")?,
        };
        let spec = RequestSpec {
            prompt_len,
            reused_len,
            window,
            context_only,
        };
        Ok(Self { spec, held, epoch })
    }

    /// Prompt length in tokens.
    #[getter]
    fn prompt_len(&self) -> i64 {
        self.spec.prompt_len
    }

    /// Reused (prepopulated) prompt length in tokens.
    #[getter]
    fn reused_len(&self) -> i64 {
        self.spec.reused_len
    }

    /// Sliding window of the layer group, ``None`` for full attention.
    #[getter]
    fn window(&self) -> Option<i64> {
        self.spec.window
    }

    /// Whether the request only runs prefill on this worker.
    #[getter]
    fn context_only(&self) -> bool {
        self.spec.context_only
    }

    /// Blocks the receiver already holds: they count as sent and never cross.
    #[getter]
    fn held(&self) -> Vec<PyBlockRange> {
        self.held.iter().copied().map(PyBlockRange).collect()
    }

    /// The lease `KVReceiver.expect` issued for the destination blocks (0: none given).
    #[getter]
    fn epoch(&self) -> i64 {
        self.epoch
    }

    fn __repr__(&self) -> String {
        let window = self
            .spec
            .window
            .map_or_else(|| "None".to_string(), |w| w.to_string());
        let held: Vec<String> = self
            .held
            .iter()
            .map(|r| format!("BlockRange({}, {})", r.start, r.end))
            .collect();
        let context_only = if self.spec.context_only {
            "True"
        } else {
            "False"
        };
        format!(
            "RequestSpec({}, reused_len={}, window={window}, context_only={context_only}, held=[{}], epoch={})",
            self.spec.prompt_len,
            self.spec.reused_len,
            held.join(", "),
            self.epoch
        )
    }
}
