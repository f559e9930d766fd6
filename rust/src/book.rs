//! The per-step batch API: every live request's ledger, keyed by request id, planned for a
//! whole scheduler step in one call.

use rustc_hash::FxHashMap;

use crate::error::{CoreError, Result};
use crate::ledger::{Ledger, MAX_LAYER_GROUPS};
use crate::plan::{check_tokens_per_block, Prompt};
use crate::range::BlockRange;

/// What the book needs to know about a request when it arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestSpec {
    /// Prompt length in tokens.
    pub prompt_len: i64,
    /// Reused (prepopulated) prompt length in tokens.
    pub reused_len: i64,
    /// Sliding window of the layer group, `None` for full attention.
    pub window: Option<i64>,
    /// The request only runs prefill on this worker (disaggregated context phase).
    pub context_only: bool,
}

#[derive(Debug, Clone)]
struct Entry {
    ledger: Ledger,
    context_only: bool,
    cancelled: bool,
    /// The step that last touched this entry; catches a request listed twice in one batch
    /// without a per-call hash set.
    stamp: u64,
}

/// The slices planned for one batch, as flat parallel arrays (one element per slice).
/// `request_index[k]` is the position in the batch the plan was made from, which is also the
/// row of that request in the block tables given to [`crate::pairs::block_pairs`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlicePlan {
    /// Number of requests in the batch the plan was made from.
    pub num_requests: usize,
    /// Batch position of each slice's request.
    pub request_index: Vec<i64>,
    /// Request id of each slice.
    pub request_id: Vec<i64>,
    /// First block of each slice.
    pub start: Vec<i64>,
    /// One past the last block of each slice.
    pub end: Vec<i64>,
    /// True for the slice that finishes its request's prompt.
    pub last: Vec<bool>,
}

impl SlicePlan {
    fn with_capacity(num_requests: usize) -> Self {
        Self {
            num_requests,
            request_index: Vec::with_capacity(num_requests),
            request_id: Vec::with_capacity(num_requests),
            start: Vec::with_capacity(num_requests),
            end: Vec::with_capacity(num_requests),
            last: Vec::with_capacity(num_requests),
        }
    }

    fn push(&mut self, index: usize, id: i64, range: BlockRange, last: bool) {
        self.request_index.push(index as i64);
        self.request_id.push(id);
        self.start.push(range.start as i64);
        self.end.push(range.end as i64);
        self.last.push(last);
    }

    /// Marks the final row pushed since `first_row` `last` when `chunk_end` ends the prompt:
    /// the last chunk's final run carries it (none at all when every block the chunk
    /// finished was skipped).
    fn mark_last(&mut self, first_row: usize, chunk_end: i64, ledger: &Ledger) {
        if chunk_end as u64 == ledger.prompt().prompt_len() && self.len() > first_row {
            if let Some(last) = self.last.last_mut() {
                *last = true;
            }
        }
    }

    /// Number of slices.
    pub fn len(&self) -> usize {
        self.start.len()
    }

    /// True when nothing is to be sent.
    pub fn is_empty(&self) -> bool {
        self.start.is_empty()
    }

    /// Total blocks over all slices.
    pub fn total_blocks(&self) -> u64 {
        self.start
            .iter()
            .zip(&self.end)
            .map(|(s, e)| (e - s) as u64)
            .sum()
    }
}

/// Adds the request id to an error raised while planning one request of a batch.
fn in_request(id: i64) -> impl Fn(CoreError) -> CoreError {
    move |err| match err {
        CoreError::DuplicateTransfer {
            block, start, end, ..
        } => CoreError::DuplicateTransfer {
            owner: format!("of request {id} "),
            block,
            start,
            end,
        },
        CoreError::InvalidArgument {
            name,
            value,
            expected,
        } => CoreError::InvalidArgument {
            name,
            value,
            expected: format!("{expected} (request_id={id})"),
        },
        other @ CoreError::UnknownRequest(_) => other,
    }
}

/// Refuses chunk arrays whose length is not the batch's.
fn check_lengths(ids: &[i64], chunk_starts: &[i64], chunk_ends: &[i64]) -> Result<()> {
    for (name, len) in [
        ("chunk_starts", chunk_starts.len()),
        ("chunk_ends", chunk_ends.len()),
    ] {
        if len != ids.len() {
            return Err(CoreError::invalid(
                name,
                format!("<array of length {len}>"),
                format!("of length {} (the length of request_ids)", ids.len()),
            ));
        }
    }
    Ok(())
}

/// The ledgers of all live requests of one worker. Owned by the executor that drives the
/// scheduler loop; every batch call validates the whole batch before it changes anything.
#[derive(Debug, Clone)]
pub struct TransferBook {
    tokens_per_block: i64,
    pipelined: bool,
    /// Layer groups whose blocks may stream separately (see [`TransferBook::plan_layers`]).
    layer_groups: usize,
    entries: FxHashMap<i64, Entry>,
    step: u64,
}

impl TransferBook {
    /// A book for one KV cache geometry. `pipelined = false` disables early sends (the
    /// whole prompt then leaves with its chunks).
    pub fn new(tokens_per_block: i64, pipelined: bool) -> Result<Self> {
        Self::with_layer_groups(tokens_per_block, pipelined, 1)
    }

    /// [`TransferBook::new`] for a model whose layers form `layer_groups` groups (in
    /// `[1, 1024]`) that may stream separately with [`TransferBook::plan_layers`].
    pub fn with_layer_groups(
        tokens_per_block: i64,
        pipelined: bool,
        layer_groups: i64,
    ) -> Result<Self> {
        check_tokens_per_block(tokens_per_block)?;
        if !(1..=MAX_LAYER_GROUPS).contains(&layer_groups) {
            return Err(CoreError::invalid(
                "layer_groups",
                layer_groups,
                format!("in [1, {MAX_LAYER_GROUPS}]"),
            ));
        }
        Ok(Self {
            tokens_per_block,
            pipelined,
            layer_groups: layer_groups as usize,
            entries: FxHashMap::default(),
            step: 0,
        })
    }

    /// Tokens per block of every request in the book.
    pub const fn tokens_per_block(&self) -> i64 {
        self.tokens_per_block
    }

    /// Whether early sends are enabled.
    pub const fn pipelined(&self) -> bool {
        self.pipelined
    }

    /// Number of layer groups.
    pub const fn layer_groups(&self) -> usize {
        self.layer_groups
    }

    /// Number of live requests.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no request is live.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether `id` is live.
    pub fn contains(&self, id: i64) -> bool {
        self.entries.contains_key(&id)
    }

    /// Registers a new request.
    pub fn add(&mut self, id: i64, spec: RequestSpec) -> Result<()> {
        if self.entries.contains_key(&id) {
            return Err(CoreError::invalid(
                "request_id",
                id,
                "not already in the book",
            ));
        }
        let prompt = Prompt::new(
            self.tokens_per_block,
            spec.prompt_len,
            spec.reused_len,
            spec.window,
        )?;
        let entry = Entry {
            ledger: Ledger::new(prompt)?,
            context_only: spec.context_only,
            cancelled: false,
            stamp: 0,
        };
        self.entries.insert(id, entry);
        Ok(())
    }

    /// Records blocks the receiver already holds for a request (see [`Ledger::hold`]):
    /// claimed without being sent, skipped by every slice. All ranges or none: on error
    /// nothing changes.
    pub fn hold(&mut self, id: i64, ranges: &[BlockRange]) -> Result<()> {
        let entry = self.entry_mut(id)?;
        let mut ledger = entry.ledger.clone();
        for &range in ranges {
            ledger.hold(range).map_err(in_request(id))?;
        }
        entry.ledger = ledger;
        Ok(())
    }

    /// Forgets a request and frees its ledger, returning it (callers check `is_complete`).
    pub fn remove(&mut self, id: i64) -> Result<Ledger> {
        self.entries
            .remove(&id)
            .map(|e| e.ledger)
            .ok_or(CoreError::UnknownRequest(id))
    }

    /// Marks a request cancelled: it is no longer eligible for an early send.
    pub fn cancel(&mut self, id: i64) -> Result<()> {
        self.entry_mut(id)?.cancelled = true;
        Ok(())
    }

    /// Whether a request was cancelled.
    pub fn is_cancelled(&self, id: i64) -> Result<bool> {
        Ok(self.entry(id)?.cancelled)
    }

    /// The ledger of a live request.
    pub fn ledger(&self, id: i64) -> Result<&Ledger> {
        Ok(&self.entry(id)?.ledger)
    }

    fn entry(&self, id: i64) -> Result<&Entry> {
        self.entries.get(&id).ok_or(CoreError::UnknownRequest(id))
    }

    fn entry_mut(&mut self, id: i64) -> Result<&mut Entry> {
        self.entries
            .get_mut(&id)
            .ok_or(CoreError::UnknownRequest(id))
    }

    /// Looks up one id of the batch of step `step`, refusing unknown ids and ids listed twice
    /// in the batch (the stamp records the step that last saw the entry).
    fn stamped(&mut self, id: i64, step: u64) -> Result<&mut Entry> {
        let entry = self
            .entries
            .get_mut(&id)
            .ok_or(CoreError::UnknownRequest(id))?;
        if entry.stamp == step {
            return Err(CoreError::invalid(
                "request_ids",
                id,
                "listed once per batch",
            ));
        }
        entry.stamp = step;
        Ok(entry)
    }

    /// Plans and claims the early prefix slices of a batch about to run its context forward.
    /// Requests that are not eligible (not context-only, cancelled, a forward already ran,
    /// prefix already sent, no complete reused block, sliding window, or the book is not
    /// pipelined) are skipped; unknown or repeated ids fail the whole call, changing nothing.
    pub fn plan_early(&mut self, ids: &[i64]) -> Result<SlicePlan> {
        self.plan_early_then(ids, |_| Ok(())).map(|(plan, ())| plan)
    }

    /// [`TransferBook::plan_early`], committing the claims only if `check(&plan)` succeeds:
    /// whatever consumes the plan (block-id pairs from the block tables, say) can refuse it
    /// without a block being marked sent that never left.
    pub fn plan_early_then<T>(
        &mut self,
        ids: &[i64],
        check: impl FnOnce(&SlicePlan) -> Result<T>,
    ) -> Result<(SlicePlan, T)> {
        self.step += 1;
        let (step, pipelined) = (self.step, self.pipelined);
        let mut plan = SlicePlan::with_capacity(ids.len());
        // Pass 1 checks the whole batch and plans; pass 2 commits, so an error in pass 1
        // leaves every ledger as it was (stamps are bookkeeping, not state).
        for (i, &id) in ids.iter().enumerate() {
            let entry = self.stamped(id, step)?;
            if !pipelined || !entry.context_only || entry.cancelled || entry.ledger.prefix_sent() {
                continue;
            }
            if let Some(range) = entry.ledger.early_candidate() {
                entry.ledger.check_sendable(range).map_err(in_request(id))?;
                entry
                    .ledger
                    .sendable_runs(range, |run| plan.push(i, id, run, false));
            }
        }
        let checked = check(&plan)?;
        for (k, &id) in plan.request_id.iter().enumerate() {
            let range = BlockRange::from_bounds(plan.start[k] as u64, plan.end[k] as u64);
            // Every id was found in pass 1; `if let` keeps panics out of the core.
            if let Some(entry) = self.entries.get_mut(&id) {
                entry.ledger.commit_early(range);
            }
        }
        Ok((plan, checked))
    }

    /// Plans and claims the slices of a batch of finished prefill chunks
    /// `[chunk_starts[i], chunk_ends[i])`. Chunks that finish no block yield no slice. Any
    /// invalid chunk, unknown or repeated id, or duplicate claim fails the whole call,
    /// changing nothing.
    pub fn plan_chunks(
        &mut self,
        ids: &[i64],
        chunk_starts: &[i64],
        chunk_ends: &[i64],
    ) -> Result<SlicePlan> {
        self.plan_chunks_then(ids, chunk_starts, chunk_ends, |_| Ok(()))
            .map(|(plan, ())| plan)
    }

    /// [`TransferBook::plan_chunks`], committing only if `check(&plan)` succeeds (see
    /// [`TransferBook::plan_early_then`]).
    pub fn plan_chunks_then<T>(
        &mut self,
        ids: &[i64],
        chunk_starts: &[i64],
        chunk_ends: &[i64],
        check: impl FnOnce(&SlicePlan) -> Result<T>,
    ) -> Result<(SlicePlan, T)> {
        check_lengths(ids, chunk_starts, chunk_ends)?;
        self.step += 1;
        let step = self.step;
        let mut plan = SlicePlan::with_capacity(ids.len());
        let mut ranges = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let ledger = &self.stamped(id, step)?.ledger;
            let range = ledger
                .chunk_candidate(chunk_starts[i], chunk_ends[i])
                .map_err(in_request(id))?;
            if let Some(range) = range {
                let first_row = plan.len();
                ledger.sendable_runs(range, |run| plan.push(i, id, run, false));
                plan.mark_last(first_row, chunk_ends[i], ledger);
            }
            ranges.push(range);
        }
        let checked = check(&plan)?;
        for (&id, range) in ids.iter().zip(ranges) {
            if let Some(entry) = self.entries.get_mut(&id) {
                entry.ledger.commit_chunk(range);
            }
        }
        Ok((plan, checked))
    }

    /// Plans and claims the layer slices of layer group `layer_group` for a batch of prefill
    /// chunks `[chunk_starts[i], chunk_ends[i])` whose forward finished that group's layers
    /// (layer-wise streaming, normally on the last chunk). Each request's slice is the range
    /// its chunk slice would have, minus held blocks and blocks that group already sent; a
    /// block counts as claimed once every group sent it.
    ///
    /// ```text
    /// chunk [s, e):   blocks [a ............ b)        (Prompt::chunk)
    /// plan_layers g:  [a ............ b) for group g    one call per finished group
    /// plan_chunks:    [a ............ b) minus blocks every group sent: nothing when all did
    /// ```
    /// It does not record the chunk's forward: the executor still calls
    /// [`TransferBook::plan_chunks`] for the chunk afterwards, which fails with
    /// [`CoreError::DuplicateTransfer`] if some groups, but not all, sent a block. Any
    /// invalid chunk or group, unknown or repeated id, or block a whole-block slice already
    /// claimed fails the whole call, changing nothing.
    pub fn plan_layers(
        &mut self,
        ids: &[i64],
        chunk_starts: &[i64],
        chunk_ends: &[i64],
        layer_group: i64,
    ) -> Result<SlicePlan> {
        self.plan_layers_then(ids, chunk_starts, chunk_ends, layer_group, |_| Ok(()))
            .map(|(plan, ())| plan)
    }

    /// [`TransferBook::plan_layers`], committing only if `check(&plan)` succeeds (see
    /// [`TransferBook::plan_early_then`]).
    pub fn plan_layers_then<T>(
        &mut self,
        ids: &[i64],
        chunk_starts: &[i64],
        chunk_ends: &[i64],
        layer_group: i64,
        check: impl FnOnce(&SlicePlan) -> Result<T>,
    ) -> Result<(SlicePlan, T)> {
        check_lengths(ids, chunk_starts, chunk_ends)?;
        let groups = self.layer_groups;
        let group = match usize::try_from(layer_group) {
            Ok(g) if g < groups => g,
            _ => {
                return Err(CoreError::invalid(
                    "layer_group",
                    layer_group,
                    format!("in [0, {groups}) (layer_groups={groups})"),
                ))
            }
        };
        self.step += 1;
        let step = self.step;
        let mut plan = SlicePlan::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let ledger = &self.stamped(id, step)?.ledger;
            let range = ledger
                .layer_candidate(chunk_starts[i], chunk_ends[i], group, groups)
                .map_err(in_request(id))?;
            if let Some(range) = range {
                let first_row = plan.len();
                ledger.layer_runs(range, group, |run| plan.push(i, id, run, false));
                plan.mark_last(first_row, chunk_ends[i], ledger);
            }
        }
        let checked = check(&plan)?;
        for (k, &id) in plan.request_id.iter().enumerate() {
            let run = BlockRange::from_bounds(plan.start[k] as u64, plan.end[k] as u64);
            if let Some(entry) = self.entries.get_mut(&id) {
                entry.ledger.commit_layer(run, group, groups);
            }
        }
        Ok((plan, checked))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(prompt_len: i64, reused_len: i64) -> RequestSpec {
        RequestSpec {
            prompt_len,
            reused_len,
            window: None,
            context_only: true,
        }
    }

    #[test]
    fn early_then_chunks_through_the_book() {
        let mut book = TransferBook::new(32, true).unwrap();
        book.add(7, spec(1000, 700)).unwrap();
        book.add(8, spec(100, 10)).unwrap();
        let early = book.plan_early(&[8, 7]).unwrap();
        assert_eq!(
            (
                early.request_index.clone(),
                early.start.clone(),
                early.end.clone()
            ),
            (vec![1], vec![0], vec![21])
        );
        // Next step: already sent, so nothing.
        assert!(book.plan_early(&[7, 8]).unwrap().is_empty());
        let chunks = book.plan_chunks(&[7, 8], &[700, 10], &[828, 100]).unwrap();
        assert_eq!(chunks.start, vec![21, 0]);
        assert_eq!(chunks.end, vec![25, 4]);
        assert_eq!(chunks.last, vec![false, true]);
        assert!(book.ledger(8).unwrap().is_complete());
        assert!(book.remove(8).unwrap().is_complete());
        assert!(!book.contains(8));
    }

    #[test]
    fn a_failing_batch_changes_nothing() {
        let mut book = TransferBook::new(4, true).unwrap();
        book.add(1, spec(32, 12)).unwrap();
        book.add(2, spec(32, 0)).unwrap();
        assert!(matches!(
            book.plan_early(&[1, 99]),
            Err(CoreError::UnknownRequest(99))
        ));
        assert!(!book.ledger(1).unwrap().prefix_sent());
        let err = book.plan_chunks(&[1, 2], &[12, 0], &[16, 40]).unwrap_err();
        assert!(err.to_string().contains("chunk_end=40"), "{err}");
        assert!(err.to_string().contains("request_id=2"), "{err}");
        assert_eq!(book.ledger(1).unwrap().claimed_blocks(), 0);
        let err = book.plan_chunks(&[1, 1], &[12, 12], &[16, 16]).unwrap_err();
        assert!(
            err.to_string().starts_with("invalid request_ids=1"),
            "{err}"
        );
    }

    #[test]
    fn cancelled_and_generation_requests_skip_early() {
        let mut book = TransferBook::new(4, true).unwrap();
        book.add(1, spec(32, 12)).unwrap();
        book.add(
            2,
            RequestSpec {
                context_only: false,
                ..spec(32, 12)
            },
        )
        .unwrap();
        book.cancel(1).unwrap();
        assert!(book.plan_early(&[1, 2]).unwrap().is_empty());
        let mut off = TransferBook::new(4, false).unwrap();
        off.add(1, spec(32, 12)).unwrap();
        assert!(off.plan_early(&[1]).unwrap().is_empty());
    }

    #[test]
    fn a_refused_check_commits_nothing() {
        let mut book = TransferBook::new(4, true).unwrap();
        book.add(1, spec(32, 12)).unwrap();
        let refuse =
            |_: &SlicePlan| -> Result<()> { Err(CoreError::invalid("dst_block_table", "x", "y")) };
        assert!(book.plan_early_then(&[1], refuse).is_err());
        assert!(!book.ledger(1).unwrap().prefix_sent());
        assert!(book.plan_chunks_then(&[1], &[12], &[20], refuse).is_err());
        assert_eq!(book.ledger(1).unwrap().claimed_blocks(), 0);
        assert!(!book.ledger(1).unwrap().forward_started());
        let (plan, n) = book
            .plan_early_then(&[1], |p| Ok(p.total_blocks()))
            .unwrap();
        assert_eq!((plan.len(), n), (1, 3));
        assert!(book.ledger(1).unwrap().prefix_sent());
    }

    #[test]
    fn duplicate_claim_names_the_request() {
        let mut book = TransferBook::new(4, true).unwrap();
        book.add(5, spec(32, 12)).unwrap();
        book.plan_chunks(&[5], &[12], &[20]).unwrap();
        let err = book.plan_chunks(&[5], &[12], &[20]).unwrap_err();
        assert!(matches!(err, CoreError::DuplicateTransfer { .. }));
        assert!(err.to_string().contains("of request 5"), "{err}");
    }

    #[test]
    fn layer_slices_then_an_empty_chunk_plan() {
        let mut book = TransferBook::with_layer_groups(4, true, 3).unwrap();
        assert_eq!(book.layer_groups(), 3);
        book.add(1, spec(32, 12)).unwrap();
        book.add(2, spec(20, 0)).unwrap();
        book.hold(2, &[BlockRange::from_bounds(4, 5)]).unwrap();
        book.plan_early(&[1, 2]).unwrap();
        book.plan_chunks(&[2], &[0], &[8]).unwrap(); // [0, 2)
        for group in [2, 0, 1] {
            let plan = book
                .plan_layers(&[1, 2], &[12, 8], &[32, 20], group)
                .unwrap();
            assert_eq!(plan.start, vec![3, 2]);
            assert_eq!(plan.end, vec![8, 4]);
            assert_eq!(plan.last, vec![true, true]);
            assert_eq!(plan.request_index, vec![0, 1]);
            // The same group again: it already has everything.
            assert!(book
                .plan_layers(&[1, 2], &[12, 8], &[32, 20], group)
                .unwrap()
                .is_empty());
        }
        assert!(book.ledger(1).unwrap().is_complete());
        assert!(book.ledger(2).unwrap().is_complete());
        let chunks = book.plan_chunks(&[1, 2], &[12, 8], &[32, 20]).unwrap();
        assert!(chunks.is_empty());
        assert!(book.ledger(1).unwrap().forward_started());
    }

    #[test]
    fn failing_layer_plans_change_nothing() {
        let mut book = TransferBook::with_layer_groups(4, true, 2).unwrap();
        book.add(1, spec(32, 12)).unwrap();
        book.add(2, spec(32, 0)).unwrap();
        let err = book.plan_layers(&[1], &[12], &[32], 2).unwrap_err();
        assert!(
            err.to_string().starts_with("invalid layer_group=2"),
            "{err}"
        );
        let err = book.plan_layers(&[1], &[12], &[32], -1).unwrap_err();
        assert!(
            err.to_string().starts_with("invalid layer_group=-1"),
            "{err}"
        );
        let err = book
            .plan_layers(&[1, 2], &[12, 0], &[32, 40], 0)
            .unwrap_err();
        assert!(err.to_string().contains("request_id=2"), "{err}");
        assert!(book.plan_layers(&[1, 1], &[12, 12], &[32, 32], 0).is_err());
        let refuse =
            |_: &SlicePlan| -> Result<()> { Err(CoreError::invalid("dst_block_table", "x", "y")) };
        assert!(book
            .plan_layers_then(&[1], &[12], &[32], 0, refuse)
            .is_err());
        assert!(!book.ledger(1).unwrap().is_group_claimed(3, 0));
        // One group went: a whole-block plan of the chunk is a duplicate naming the block.
        book.plan_layers(&[1], &[12], &[32], 0).unwrap();
        let before = book.ledger(1).unwrap().clone();
        let err = book.plan_chunks(&[1], &[12], &[32]).unwrap_err();
        assert!(
            matches!(err, CoreError::DuplicateTransfer { block: 0, .. }),
            "{err}"
        );
        assert_eq!(book.ledger(1).unwrap(), &before);
        for groups in [0, 1025] {
            let err = TransferBook::with_layer_groups(4, true, groups).unwrap_err();
            assert!(
                err.to_string()
                    .starts_with(&format!("invalid layer_groups={groups}")),
                "{err}"
            );
        }
    }
}
