//! kvferry's planning core: which KV blocks of a request leave the context worker when.
//!
//! The complete blocks of a reused prefix leave before the first context forward; each
//! finished prefill chunk then sends the blocks it completed; the last chunk sends the rest.
//! A per-request bitmap makes every block leave exactly once.
//!
//! ```
//! use kvferry::{Ledger, Prompt};
//!
//! // 1000-token prompt, 700 tokens reused, 32 tokens per block, chunks of 128 tokens.
//! let mut ledger = Ledger::new(Prompt::new(32, 1000, 700, None)?)?;
//! let early = ledger.send_early()?.expect("21 complete reused blocks");
//! assert_eq!((early.start, early.end), (0, 21));
//! for (s, e) in [(700, 828), (828, 956), (956, 1000)] {
//!     ledger.send_chunk(s, e)?;
//! }
//! assert!(ledger.is_complete());
//! assert!(ledger.send_chunk(956, 1000).is_err()); // a resend is refused
//! # Ok::<(), kvferry::CoreError>(())
//! ```
//!
//! The Python bindings (`kvferry._core`) live in `py/` behind the `python` feature.

#![allow(clippy::struct_field_names)] // `Prompt::prompt_len` reads best as it is.

pub mod bitmap;
pub mod book;
pub mod checksum;
pub mod error;
pub mod ledger;
pub mod pairs;
pub mod plan;
pub mod range;
pub mod select;
pub mod wire;

#[cfg(feature = "python")]
mod py;

pub use book::{RequestSpec, SlicePlan, TransferBook};
pub use error::{CoreError, Result};
pub use ledger::{Ledger, MAX_LAYER_GROUPS, MAX_LEDGER_BLOCKS};
pub use pairs::{block_pairs, block_runs, pack_pairs, BlockPairs, BlockRuns, BlockTable};
pub use plan::{chunk_blocks, early_prefix_blocks, Prompt};
pub use range::BlockRange;
pub use select::{select_early, EarlyInputs, Flag};
