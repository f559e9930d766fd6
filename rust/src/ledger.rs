//! Per-request ownership: which blocks have been claimed by a slice, so none leaves twice.

use crate::bitmap::Bitmap;
use crate::error::{CoreError, Result};
use crate::plan::Prompt;
use crate::range::BlockRange;

/// Largest prompt, in blocks, that a ledger tracks (16 Mi blocks: a 2 MiB bitmap). Anything
/// larger is a caller bug, refused before a huge bitmap is allocated.
pub const MAX_LEDGER_BLOCKS: u64 = 1 << 24;

/// Most layer groups a book streams separately (layer-wise streaming). A group is a set of
/// consecutive layers whose forward finishes together; real models have at most a few hundred
/// layers, and the per-block group counters are `u16`.
pub const MAX_LAYER_GROUPS: i64 = 1024;

/// Claims per layer group, for layer-wise streaming: allocated when a request's first layer
/// slice is planned (most requests never stream by layer, and never pay for this).
#[derive(Debug, Clone, PartialEq, Eq)]
struct GroupClaims {
    /// One bitmap per layer group: the blocks that group's slices claimed.
    groups: Vec<Bitmap>,
    /// Per block, how many groups claimed it; at `groups.len()` the block is claimed whole.
    counts: Vec<u16>,
}

impl GroupClaims {
    fn new(num_groups: usize, num_blocks: u64) -> Self {
        Self {
            groups: (0..num_groups).map(|_| Bitmap::new(num_blocks)).collect(),
            counts: vec![0; num_blocks as usize],
        }
    }

    /// Some group claimed the block, but not every group.
    fn partial(&self, block: u64) -> bool {
        let n = usize::from(self.counts[block as usize]);
        n > 0 && n < self.groups.len()
    }
}

/// The ownership state of one request: one bit per block, set once the block is claimed by an
/// early, chunk or explicit slice, held, or claimed in every layer group by layer slices. A
/// second claim of any block (of any (group, block) for layer slices) is refused, never
/// resent. Two ledgers are equal when they track the same prompt with the same claims and
/// flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ledger {
    prompt: Prompt,
    claimed: Bitmap,
    /// Number of set bits in `claimed`, kept so the common first claim skips the bitmap scan.
    num_claimed: u64,
    /// Blocks claimed without a whole-block slice: held by the receiver, or claimed in every
    /// layer group. Whole-block slices skip them. Allocated on the first such block: most
    /// requests have none.
    settled: Option<Box<Bitmap>>,
    num_held: u64,
    /// Per-(layer group, block) claims of layer slices; `None` until the first one.
    groups: Option<Box<GroupClaims>>,
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
            settled: None,
            num_held: 0,
            groups: None,
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

    /// Refuses `range` if it passes the last block, overlaps a claimed block, or overlaps a
    /// block that some layer group, but not every one, has claimed.
    pub fn check_claim(&self, range: BlockRange) -> Result<()> {
        self.check_bounds(range)?;
        if self.num_claimed > 0 {
            if let Some(block) = self.claimed.first_set(range.start, range.end) {
                return Err(duplicate(block, range));
            }
        }
        self.check_partial(range)
    }

    /// Refuses `range` if a layer group claimed one of its blocks without every group having
    /// claimed it: a whole-block slice would send that group's part a second time.
    fn check_partial(&self, range: BlockRange) -> Result<()> {
        let Some(claims) = &self.groups else {
            return Ok(());
        };
        match (range.start..range.end).find(|&b| claims.partial(b)) {
            Some(block) => Err(duplicate(block, range)),
            None => Ok(()),
        }
    }

    /// Refuses `range` if it passes the last block or overlaps a block that a whole-block
    /// slice claimed; settled blocks (held, or claimed in every group) are allowed.
    fn check_unsettled(&self, range: BlockRange) -> Result<()> {
        self.check_bounds(range)?;
        if self.num_claimed == 0 {
            return Ok(());
        }
        let block = match &self.settled {
            None => self.claimed.first_set(range.start, range.end),
            // Settled blocks are claimed too: the range is clean when it claims nothing else.
            Some(settled)
                if self.claimed.count_range(range.start, range.end)
                    == settled.count_range(range.start, range.end) =>
            {
                None
            }
            Some(settled) => Some(
                (range.start..range.end)
                    .find(|&b| self.claimed.get(b) && !settled.get(b))
                    .unwrap_or(range.start),
            ),
        };
        block.map_or(Ok(()), |block| Err(duplicate(block, range)))
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
    /// if any, are settled ones, which are not counted twice.
    fn set_claimed(&mut self, range: BlockRange) {
        let already = if self.settled.is_none() {
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
        self.settled
            .get_or_insert_with(|| Box::new(Bitmap::new(blocks)))
            .set_range(range.start, range.end);
        self.num_held += range.len();
        Ok(())
    }

    /// [`Ledger::check_claim`] for a whole-block slice about to be planned: settled blocks
    /// inside `range` (held, or claimed in every layer group) are allowed, as they will be
    /// skipped; blocks an earlier slice claimed, or that only some layer groups claimed, are
    /// not.
    pub fn check_sendable(&self, range: BlockRange) -> Result<()> {
        self.check_unsettled(range)?;
        self.check_partial(range)
    }

    /// Calls `emit` with the parts of `range` that must cross: `range` minus settled blocks,
    /// as maximal runs in order (just `range` when nothing is settled).
    pub fn sendable_runs(&self, range: BlockRange, emit: impl FnMut(BlockRange)) {
        self.runs_skipping(range, None, emit);
    }

    /// The maximal runs of `range` outside the settled blocks and, for `Some(group)`, outside
    /// the blocks that group claimed.
    fn runs_skipping(
        &self,
        range: BlockRange,
        group: Option<usize>,
        mut emit: impl FnMut(BlockRange),
    ) {
        let group = group.and_then(|g| self.groups.as_ref().map(|c| &c.groups[g]));
        let runs = match (self.settled.as_deref(), group) {
            (None, None) => return emit(range),
            (Some(skip), None) | (None, Some(skip)) => skip.clear_runs(range.start, range.end),
            (Some(settled), Some(group)) => {
                let mut runs = Vec::new();
                let mut run_start = None;
                for b in range.start..range.end {
                    match (settled.get(b) || group.get(b), run_start) {
                        (false, None) => run_start = Some(b),
                        (true, Some(s)) => {
                            runs.push((s, b));
                            run_start = None;
                        }
                        _ => {}
                    }
                }
                runs.extend(run_start.map(|s| (s, range.end)));
                runs
            }
        };
        for (start, end) in runs {
            emit(BlockRange::from_bounds(start, end));
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

    /// Whether layer group `group` has claimed `block` (through a layer slice).
    pub fn is_group_claimed(&self, block: u64, group: usize) -> bool {
        block < self.num_blocks()
            && self
                .groups
                .as_ref()
                .and_then(|c| c.groups.get(group))
                .is_some_and(|bits| bits.get(block))
    }

    /// The block range of a layer slice of chunk `[chunk_start, chunk_end)` for layer group
    /// `group` of `num_groups`: the range a chunk slice of that chunk would have (see
    /// [`Prompt::chunk`]), checked against whole-block claims but not claimed. Its sendable
    /// parts are given by [`Ledger::layer_runs`].
    ///
    /// ```text
    /// chunk slice:   [s ........................ e)   one claim covers every group
    /// group g:       [s ........................ e)   minus settled blocks and g's blocks
    /// block b is claimed whole once every group 0..G claimed it (then chunk slices skip it)
    /// ```
    pub fn layer_candidate(
        &self,
        chunk_start: i64,
        chunk_end: i64,
        group: usize,
        num_groups: usize,
    ) -> Result<Option<BlockRange>> {
        self.check_group(group, num_groups)?;
        let range = self
            .prompt
            .chunk(chunk_start, chunk_end, self.prefix_sent)?;
        if let Some(range) = range {
            // Blocks other groups claimed are fine; blocks a whole-block slice claimed are not.
            self.check_unsettled(range)?;
        }
        Ok(range)
    }

    fn check_group(&self, group: usize, num_groups: usize) -> Result<()> {
        if num_groups == 0 || num_groups as i64 > MAX_LAYER_GROUPS {
            return Err(CoreError::invalid(
                "layer_groups",
                num_groups,
                format!("in [1, {MAX_LAYER_GROUPS}]"),
            ));
        }
        if let Some(claims) = &self.groups {
            if claims.groups.len() != num_groups {
                return Err(CoreError::invalid(
                    "layer_groups",
                    num_groups,
                    format!(
                        "{} (as in this ledger's earlier layer slices)",
                        claims.groups.len()
                    ),
                ));
            }
        }
        if group >= num_groups {
            return Err(CoreError::invalid(
                "layer_group",
                group,
                format!("in [0, {num_groups}) (layer_groups={num_groups})"),
            ));
        }
        Ok(())
    }

    /// Calls `emit` with the parts of a [`Ledger::layer_candidate`] range that group `group`
    /// must still send: minus settled blocks and the blocks that group already claimed.
    pub fn layer_runs(&self, range: BlockRange, group: usize, emit: impl FnMut(BlockRange)) {
        self.runs_skipping(range, Some(group), emit);
    }

    /// Claims `run` (a run from [`Ledger::layer_runs`]) for layer group `group` of
    /// `num_groups`; a block that every group has now claimed becomes claimed whole.
    pub(crate) fn commit_layer(&mut self, run: BlockRange, group: usize, num_groups: usize) {
        let num_blocks = self.num_blocks();
        let claims = self
            .groups
            .get_or_insert_with(|| Box::new(GroupClaims::new(num_groups, num_blocks)));
        claims.groups[group].set_range(run.start, run.end);
        for b in run.start..run.end {
            let count = &mut claims.counts[b as usize];
            *count += 1;
            if usize::from(*count) == num_groups {
                self.settled
                    .get_or_insert_with(|| Box::new(Bitmap::new(num_blocks)))
                    .set_range(b, b + 1);
                self.claimed.set_range(b, b + 1);
                self.num_claimed += 1;
            }
        }
    }

    /// Claims `range` for layer group `group` of `num_groups`: the receiver's side of a
    /// layer slice (the sender plans with [`Ledger::send_layer`]). Refused, changing nothing,
    /// if the range passes the last block, if any of its blocks is claimed whole (by a
    /// whole-block slice, held, or already claimed in every group), or if `group` claimed any
    /// of them before; a block becomes claimed whole once every group claimed it.
    pub fn claim_layer(&mut self, range: BlockRange, group: i64, num_groups: i64) -> Result<()> {
        let (group, num_groups) = layer_args(group, num_groups)?;
        self.check_group(group, num_groups)?;
        self.check_bounds(range)?;
        if self.num_claimed > 0 {
            if let Some(block) = self.claimed.first_set(range.start, range.end) {
                return Err(duplicate(block, range));
            }
        }
        if let Some(bits) = self.groups.as_ref().map(|c| &c.groups[group]) {
            if let Some(block) = bits.first_set(range.start, range.end) {
                return Err(duplicate(block, range));
            }
        }
        self.commit_layer(range, group, num_groups);
        Ok(())
    }

    /// Claims and returns the runs of the layer slice of chunk `[chunk_start, chunk_end)` for
    /// layer group `group` of `num_groups` (see [`Ledger::layer_candidate`]). On error nothing
    /// changes.
    pub fn send_layer(
        &mut self,
        chunk_start: i64,
        chunk_end: i64,
        group: usize,
        num_groups: usize,
    ) -> Result<Vec<BlockRange>> {
        let mut runs = Vec::new();
        if let Some(range) = self.layer_candidate(chunk_start, chunk_end, group, num_groups)? {
            self.layer_runs(range, group, |run| runs.push(run));
        }
        for &run in &runs {
            self.commit_layer(run, group, num_groups);
        }
        Ok(runs)
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

/// `(group, num_groups)` as indices; a negative value is refused by name.
fn layer_args(group: i64, num_groups: i64) -> Result<(usize, usize)> {
    let num = usize::try_from(num_groups).map_err(|_| {
        CoreError::invalid(
            "layer_groups",
            num_groups,
            format!("in [1, {MAX_LAYER_GROUPS}]"),
        )
    })?;
    let g = usize::try_from(group).map_err(|_| {
        CoreError::invalid(
            "layer_group",
            group,
            format!("in [0, {num_groups}) (layer_groups={num_groups})"),
        )
    })?;
    Ok((g, num))
}

fn duplicate(block: u64, range: BlockRange) -> CoreError {
    CoreError::DuplicateTransfer {
        owner: String::new(),
        block,
        start: range.start,
        end: range.end,
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

    #[test]
    fn layer_slices_claim_a_block_once_every_group_has_it() {
        // tpb 4, P 32, R 12: early [0, 3), last chunk [12, 32) -> [3, 8).
        let mut l = ledger(4, 32, 12, None);
        l.send_early().unwrap();
        assert_eq!(
            l.send_layer(12, 32, 1, 2).unwrap(),
            vec![BlockRange::from_bounds(3, 8)]
        );
        assert!(l.is_group_claimed(3, 1) && !l.is_group_claimed(3, 0));
        assert_eq!(l.claimed_blocks(), 3);
        // Group 1 again: it already has every block, nothing crosses twice.
        assert!(l.send_layer(12, 32, 1, 2).unwrap().is_empty());
        // A whole-block claim of a partially streamed block is a duplicate.
        let err = l.send_chunk(12, 32).unwrap_err();
        assert!(
            matches!(err, CoreError::DuplicateTransfer { block: 3, .. }),
            "{err}"
        );
        assert!(l.claim(BlockRange::from_bounds(5, 6)).is_err());
        assert!(l.hold(BlockRange::from_bounds(7, 8)).is_err());
        assert_eq!(
            l.send_layer(12, 32, 0, 2).unwrap(),
            vec![BlockRange::from_bounds(3, 8)]
        );
        assert!(l.is_complete());
        // The chunk slice after every group went: nothing left, and the forward is recorded.
        assert_eq!(
            l.send_chunk(12, 32).unwrap(),
            Some(BlockRange::from_bounds(3, 8))
        );
        assert!(l.forward_started());
        assert_eq!(l.claimed_blocks(), 8);
    }

    #[test]
    fn layer_slices_skip_held_blocks_and_refuse_sent_ones() {
        let mut l = ledger(4, 32, 0, None);
        l.hold(BlockRange::from_bounds(2, 3)).unwrap();
        l.send_chunk(0, 8).unwrap(); // [0, 2)
        let err = l.send_layer(0, 12, 0, 3).unwrap_err();
        assert!(
            matches!(err, CoreError::DuplicateTransfer { block: 0, .. }),
            "{err}"
        );
        assert_eq!(
            l.send_layer(8, 32, 2, 3).unwrap(),
            vec![BlockRange::from_bounds(3, 8)]
        );
        let before = l.clone();
        for (group, groups, name) in [
            (3, 3, "layer_group=3"),
            (0, 4, "layer_groups=4"),
            (0, 0, "layer_groups=0"),
        ] {
            let err = l.send_layer(8, 32, group, groups).unwrap_err();
            assert!(
                err.to_string().starts_with(&format!("invalid {name}")),
                "{err}"
            );
        }
        assert_eq!(l, before);
    }
}
