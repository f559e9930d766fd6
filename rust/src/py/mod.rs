//! The `PyO3` bindings: the only place that touches `pyo3` or `numpy`. Everything here converts,
//! releases the GIL around O(n) work and maps errors; the logic lives in the pure core.

use pyo3::prelude::*;

mod args;
mod arrays;
mod book;
mod checksum;
mod errors;
mod ledger;
mod pairs;
mod planner;
mod range;
mod spec;
pub(crate) mod wire;

/// `kvferry._core`: the compiled planner. Import it through `kvferry`.
#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<range::PyBlockRange>()?;
    m.add_class::<ledger::PyTransferLedger>()?;
    m.add_class::<book::PyTransferBook>()?;
    m.add_class::<spec::PyRequestSpec>()?;
    m.add_class::<pairs::PySlicePlan>()?;
    m.add_class::<pairs::PyBlockPairs>()?;
    m.add_class::<pairs::PyBlockRuns>()?;
    m.add_function(wrap_pyfunction!(planner::early_prefix_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(planner::chunk_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(planner::select_early, m)?)?;
    m.add_function(wrap_pyfunction!(pairs::block_pairs, m)?)?;
    m.add_function(wrap_pyfunction!(pairs::block_runs, m)?)?;
    m.add_function(wrap_pyfunction!(pairs::pack_pairs, m)?)?;
    m.add_function(wrap_pyfunction!(checksum::block_checksums, m)?)?;
    m.add("MAX_LEDGER_BLOCKS", crate::MAX_LEDGER_BLOCKS)?;
    m.add_function(wrap_pyfunction!(wire::wire_header, m)?)?;
    m.add_function(wrap_pyfunction!(wire::wire_decode, m)?)?;
    m.add_function(wrap_pyfunction!(wire::wire_encode, m)?)?;
    m.add_function(wrap_pyfunction!(wire::rendezvous_decode, m)?)?;
    m.add_function(wrap_pyfunction!(wire::rendezvous_encode, m)?)?;
    m.add("WIRE_FIELDS", wire::frame_fields(m.py())?)?;
    m.add("WIRE_VERSION", crate::wire::VERSION)?;
    m.add("WIRE_HEADER_BYTES", crate::wire::HEADER_BYTES)?;
    m.add("WIRE_MAX_FRAME_BYTES", crate::wire::MAX_FRAME_BYTES)?;
    m.add("WIRE_MAX_IDS", crate::wire::MAX_IDS)?;
    Ok(())
}
