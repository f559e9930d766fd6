//! Half-open block ranges, the unit every plan speaks in.

use crate::error::{CoreError, Result};

/// Blocks `[start, end)` of one request's KV cache. Empty ranges are valid values;
/// planners return `None` instead of an empty range when there is nothing to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockRange {
    /// First block.
    pub start: u64,
    /// One past the last block.
    pub end: u64,
}

impl BlockRange {
    /// Checked constructor for values that come from outside the core.
    pub fn new(start: i64, end: i64) -> Result<Self> {
        if start < 0 {
            return Err(CoreError::invalid("start", start, ">= 0"));
        }
        if end < start {
            return Err(CoreError::invalid(
                "end",
                end,
                format!(">= start ({start})"),
            ));
        }
        Ok(Self::from_bounds(start as u64, end as u64))
    }

    /// Unchecked constructor for the core's own arithmetic (`start <= end` holds there).
    pub(crate) const fn from_bounds(start: u64, end: u64) -> Self {
        Self { start, end }
    }

    /// Number of blocks.
    pub const fn len(&self) -> u64 {
        self.end - self.start
    }

    /// True when the range holds no block.
    pub const fn is_empty(&self) -> bool {
        self.end == self.start
    }

    /// `Some(self)` unless empty.
    pub(crate) const fn non_empty(self) -> Option<Self> {
        if self.is_empty() {
            None
        } else {
            Some(self)
        }
    }
}

impl std::fmt::Display for BlockRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}, {})", self.start, self.end)
    }
}
