//! The `PyO3` bindings: the only place that touches `pyo3` or `numpy`. Everything here converts,
//! releases the GIL around O(n) work and maps errors; the logic lives in the pure core.

use pyo3::prelude::*;

mod args;
mod arrays;
mod book;
mod errors;
mod ledger;
mod pairs;
mod planner;
mod range;

/// `kvferry._core`: the compiled planner. Import it through `kvferry`.
#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<range::PyBlockRange>()?;
    m.add_class::<ledger::PyTransferLedger>()?;
    m.add_class::<book::PyTransferBook>()?;
    m.add_class::<pairs::PySlicePlan>()?;
    m.add_class::<pairs::PyBlockPairs>()?;
    m.add_class::<pairs::PyBlockRuns>()?;
    m.add_function(wrap_pyfunction!(planner::early_prefix_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(planner::chunk_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(planner::select_early, m)?)?;
    m.add_function(wrap_pyfunction!(pairs::block_pairs, m)?)?;
    m.add_function(wrap_pyfunction!(pairs::block_runs, m)?)?;
    m.add_function(wrap_pyfunction!(pairs::pack_pairs, m)?)?;
    m.add("MAX_LEDGER_BLOCKS", crate::MAX_LEDGER_BLOCKS)?;
    Ok(())
}
