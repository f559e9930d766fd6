//! Per-request ownership: which blocks have been claimed by a slice, so none leaves twice.

use crate::bitmap::Bitmap;
use crate::error::{CoreError, Result};
use crate::plan::Prompt;
use crate::range::BlockRange;

/// Largest prompt, in blocks, that a ledger tracks (16 Mi blocks: a 2 MiB bitmap). Anything
/// larger is a caller bug, refused before a huge bitmap is allocated.
pub const MAX_LEDGER_BLOCKS: u64 = 1 << 24;

/// The ownership state of one request: one bit per block, set once the block is claimed by an
/// early, chunk or explicit slice. A second claim of any block is refused, never resent.
/// Two ledgers are equal when they track the same prompt with the same claims and flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ledger {
    prompt: Prompt,
    claimed: Bitmap,
    /// Number of set bits in `claimed`, kept so the common first claim skips the bitmap scan.
    num_claimed: u64,
    /// Blocks the receiver already holds (claimed without being sent; slices skip them).
    /// Allocated on the first hold: most requests have none.
    held: Option<Bitmap>,
    num_held: u64,
    prefix_sent: bool,
    /// Set by the first chunk slice: after a forward has run, nothing may leave "early".
    forward_started: bool,
}

impl Ledger {
    /// An empty ledger for `prompt`.
    pub fn new(prompt: Prompt) -> Result<Self> {
        if prompt.num_blocks() > MAX_LEDGER_BLOCKS {
            return Err(CoreError::invalid(
                "prompt_len",
                prompt.prompt_len(),
                format!(
                    "at most {} tokens ({MAX_LEDGER_BLOCKS} blocks of {})",
                    MAX_LEDGER_BLOCKS * prompt.tokens_per_block(),
                    prompt.tokens_per_block()
                ),
            ));
        }
        Ok(Self {
            claimed: Bitmap::new(prompt.num_blocks()),
            num_claimed: 0,
            held: None,
            num_held: 0,
            prompt,
            prefix_sent: false,
            forward_started: false,
        })
    }

    /// The prompt this ledger tracks.
    pub const fn prompt(&self) -> &Prompt {
        &self.prompt
    }

    /// Number of blocks of the prompt.
    pub const fn num_blocks(&self) -> u64 {
        self.claimed.len()
    }

    /// True once the early prefix slice was claimed.
    pub const fn prefix_sent(&self) -> bool {
        self.prefix_sent
    }

    /// True once a chunk slice was planned (a forward has run).
    pub const fn forward_started(&self) -> bool {
        self.forward_started
    }

    /// Blocks claimed so far.
    pub const fn claimed_blocks(&self) -> u64 {
        self.num_claimed
    }

    /// Whether a given block is claimed.
    pub fn is_claimed(&self, block: u64) -> bool {
        block < self.num_blocks() && self.claimed.get(block)
    }

    /// Refuses `range` if it passes the last block or overlaps a claimed block.
    pub fn check_claim(&self, range: BlockRange) -> Result<()> {
        self.check_bounds(range)?;
        if self.num_claimed == 0 {
            return Ok(());
        }
        match self.claimed.first_set(range.start, range.end) {
            Some(block) => Err(CoreError::DuplicateTransfer {
                owner: String::new(),
                block,
                start: range.start,
                end: range.end,
            }),
            None => Ok(()),
        }
    }

    fn check_bounds(&self, range: BlockRange) -> Result<()> {
        // `BlockRange`'s fields are public, so a reversed range can reach here from Rust; its
        // `len()` would underflow when the claim is counted (found by the `book` fuzz target).
        if range.start > range.end || range.end > self.num_blocks() {
            return Err(CoreError::invalid(
                "range",
                range,
                format!("within the request's {} blocks", self.num_blocks()),
            ));
        }
        Ok(())
    }

    /// Claims `range`; on error nothing changes.
    pub fn claim(&mut self, range: BlockRange) -> Result<()> {
        self.check_claim(range)?;
        self.set_claimed(range);
        Ok(())
    }

    /// Marks a range that `check_claim` or `check_sendable` accepted: its only claimed blocks,
    /// if any, are held ones, which are not counted twice.
    fn set_claimed(&mut self, range: BlockRange) {
        let already = if self.num_held == 0 {
            0
        } else {
            self.claimed.count_range(range.start, range.end)
        };
        self.claimed.set_range(range.start, range.end);
        self.num_claimed += range.len() - already;
    }

    /// Blocks the receiver already holds.
    pub const fn held_blocks(&self) -> u64 {
        self.num_held
    }

    /// Records that the receiver already holds `range` (by block hash, say): those blocks
    /// count as claimed and every later slice skips them. On error (a block out of range or
    /// already claimed) nothing changes.
    pub fn hold(&mut self, range: BlockRange) -> Result<()> {
        self.check_claim(range)?;
        self.set_claimed(range);
        let blocks = self.num_blocks();
        self.held
            .get_or_insert_with(|| Bitmap::new(blocks))
            .set_range(range.start, range.end);
        self.num_held += range.len();
        Ok(())
    }

    /// [`Ledger::check_claim`] for a slice about to be planned: held blocks inside `range`
    /// are allowed (they will be skipped), blocks an earlier slice claimed are not.
    pub fn check_sendable(&self, range: BlockRange) -> Result<()> {
        let Some(held) = &self.held else {
            return self.check_claim(range);
        };
        self.check_bounds(range)?;
        // Held blocks are claimed too: the range is clean when it claims nothing else.
        if self.claimed.count_range(range.start, range.end)
            == held.count_range(range.start, range.end)
        {
            return Ok(());
        }
        let block = (range.start..range.end)
            .find(|&b| self.claimed.get(b) && !held.get(b))
            .unwrap_or(range.start);
        Err(CoreError::DuplicateTransfer {
            owner: String::new(),
            block,
            start: range.start,
            end: range.end,
        })
    }

    /// Calls `emit` with the parts of `range` that must cross: `range` minus held blocks, as
    /// maximal runs in order (just `range` when nothing is held).
    pub fn sendable_runs(&self, range: BlockRange, mut emit: impl FnMut(BlockRange)) {
        match &self.held {
            None => emit(range),
            Some(held) => {
                for (start, end) in held.clear_runs(range.start, range.end) {
                    emit(BlockRange::from_bounds(start, end));
                }
            }
        }
    }

    /// The early slice this ledger would send now: `None` when the prompt has no complete
    /// reused block, uses a sliding window, or a forward has already run.
    pub fn early_candidate(&self) -> Option<BlockRange> {
        if self.forward_started {
            return None;
        }
        self.prompt.early()
    }

    /// Claims and returns the early prefix slice (see [`Ledger::early_candidate`]). A second
    /// call is a [`CoreError::DuplicateTransfer`].
    pub fn send_early(&mut self) -> Result<Option<BlockRange>> {
        let Some(range) = self.early_candidate() else {
            return Ok(None);
        };
        self.check_sendable(range)?;
        self.commit_early(range);
        Ok(Some(range))
    }

    /// The slice of chunk `[chunk_start, chunk_end)` given what has left so far, checked
    /// against the claims but not claimed.
    pub fn chunk_candidate(&self, chunk_start: i64, chunk_end: i64) -> Result<Option<BlockRange>> {
        let range = self
            .prompt
            .chunk(chunk_start, chunk_end, self.prefix_sent)?;
        if let Some(range) = range {
            self.check_sendable(range)?;
        }
        Ok(range)
    }

    /// Records a finished chunk: claims and returns its slice (`None` when a non-final chunk
    /// finished no block). On error nothing changes.
    pub fn send_chunk(&mut self, chunk_start: i64, chunk_end: i64) -> Result<Option<BlockRange>> {
        let range = self.chunk_candidate(chunk_start, chunk_end)?;
        self.commit_chunk(range);
        Ok(range)
    }

    /// Applies a slice that [`Ledger::chunk_candidate`] accepted.
    pub(crate) fn commit_chunk(&mut self, range: Option<BlockRange>) {
        if let Some(range) = range {
            self.set_claimed(range);
        }
        self.forward_started = true;
    }

    /// Applies an early slice that [`Ledger::early_candidate`] produced and that was checked.
    pub(crate) fn commit_early(&mut self, range: BlockRange) {
        self.set_claimed(range);
        self.prefix_sent = true;
    }

    /// The needed blocks (see [`Prompt::needed`]) not yet claimed, as maximal ranges.
    pub fn missing(&self) -> Vec<BlockRange> {
        let needed = self.prompt.needed();
        self.claimed
            .clear_runs(needed.start, needed.end)
            .into_iter()
            .map(|(s, e)| BlockRange::from_bounds(s, e))
            .collect()
    }

    /// True when every needed block has been claimed.
    pub fn is_complete(&self) -> bool {
        let needed = self.prompt.needed();
        self.claimed.count_range(needed.start, needed.end) == needed.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ledger(tpb: i64, p: i64, r: i64, w: Option<i64>) -> Ledger {
        Ledger::new(Prompt::new(tpb, p, r, w).unwrap()).unwrap()
    }

    #[test]
    fn early_then_chunks_complete_exactly_once() {
        let mut l = ledger(32, 1000, 700, None);
        assert_eq!(
            l.send_early().unwrap(),
            Some(BlockRange::from_bounds(0, 21))
        );
        assert!(l.prefix_sent());
        for (s, e) in [(700, 828), (828, 956), (956, 1000)] {
            assert!(l.send_chunk(s, e).unwrap().is_some());
        }
        assert!(l.is_complete());
        assert_eq!(l.claimed_blocks(), 32);
        assert!(l.missing().is_empty());
    }

    #[test]
    fn second_claim_is_refused_and_changes_nothing() {
        let mut l = ledger(4, 32, 12, None);
        l.send_early().unwrap();
        let err = l.send_early().unwrap_err();
        assert!(matches!(err, CoreError::DuplicateTransfer { block: 0, .. }));
        assert!(l.claim(BlockRange::from_bounds(2, 5)).is_err());
        assert_eq!(l.claimed_blocks(), 3);
        assert_eq!(l.missing(), vec![BlockRange::from_bounds(3, 8)]);
    }

    #[test]
    fn no_early_after_a_forward() {
        let mut l = ledger(4, 32, 12, None);
        l.send_chunk(12, 16).unwrap();
        assert_eq!(l.send_early().unwrap(), None);
    }

    #[test]
    fn claim_past_last_block_is_invalid() {
        let mut l = ledger(4, 30, 0, None);
        let err = l.claim(BlockRange::from_bounds(7, 9)).unwrap_err();
        assert!(err.to_string().starts_with("invalid range=[7, 9)"), "{err}");
    }

    #[test]
    fn reversed_range_is_invalid_not_a_panic() {
        let mut l = ledger(4, 30, 0, None);
        let reversed = BlockRange { start: 5, end: 2 };
        for err in [
            l.hold(reversed).unwrap_err(),
            l.claim(reversed).unwrap_err(),
        ] {
            assert!(err.to_string().starts_with("invalid range=[5, 2)"), "{err}");
        }
        assert!(l.check_sendable(reversed).is_err());
        assert_eq!((l.claimed_blocks(), l.held_blocks()), (0, 0));
    }

    #[test]
    fn huge_prompt_is_refused_before_allocation() {
        let err = Ledger::new(Prompt::new(1, i64::MAX, 0, None).unwrap()).unwrap_err();
        assert!(err.to_string().starts_with("invalid prompt_len="), "{err}");
    }

    #[test]
    fn windowed_ledger_needs_only_the_window() {
        let mut l = ledger(4, 32, 0, Some(16));
        assert_eq!(l.missing(), vec![BlockRange::from_bounds(4, 8)]);
        assert_eq!(l.send_chunk(0, 16).unwrap(), None);
        assert_eq!(
            l.send_chunk(16, 32).unwrap(),
            Some(BlockRange::from_bounds(4, 8))
        );
        assert!(l.is_complete());
    }
}
