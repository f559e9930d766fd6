//! The one error type of the pure core. Every variant carries the numbers that went wrong so
//! that the message alone tells an operator what to fix.

use std::fmt::Display;

/// Everything the planner can refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// An argument is outside its domain; `name` is the argument's public name.
    #[error("invalid {name}={value}: must be {expected}")]
    InvalidArgument {
        /// The argument's name as the caller spells it.
        name: &'static str,
        /// The offending value, rendered.
        value: String,
        /// What the value must satisfy.
        expected: String,
    },
    /// A block was claimed a second time: sending it again would be a silent resend.
    #[error(
        "block {block} {owner}is already claimed (claim of blocks [{start}, {end})): \
         every block crosses exactly once"
    )]
    DuplicateTransfer {
        /// `"of request N "` when the ledger lives in a book, else empty.
        owner: String,
        /// First already-claimed block.
        block: u64,
        /// The claim that was refused.
        start: u64,
        /// The claim that was refused.
        end: u64,
    },
    /// A request id that the book does not hold.
    #[error("unknown request_id={0}: it was never added or was already removed")]
    UnknownRequest(i64),
}

/// Shorthand used across the core.
pub type Result<T> = std::result::Result<T, CoreError>;

impl CoreError {
    /// Builds an [`CoreError::InvalidArgument`].
    pub fn invalid(name: &'static str, value: impl Display, expected: impl Into<String>) -> Self {
        Self::InvalidArgument {
            name,
            value: value.to_string(),
            expected: expected.into(),
        }
    }
}
