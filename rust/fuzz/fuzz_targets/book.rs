//! Fuzzes the batch API: a history of operations on one `TransferBook` (add, hold, cancel,
//! remove, `plan_early` / `plan_chunks` with or without block tables and pool sizes, checked
//! before the commit as the Python binding does, `pack_pairs` of the pairs a plan emitted),
//! valid and not, checked after every operation against a model of each request.
//!
//! Invariants:
//! - no panic, and every refusal is exactly the `CoreError` the oracle predicts for the first
//!   bad element (unknown or repeated id, chunk outside `[R, P]`, resend, a table that cannot
//!   serve the plan or an id outside its pool), naming the request at fault;
//! - a refused call changes nothing observable: `len`, `contains`, each ledger, `is_cancelled`;
//! - a plan is the oracle's, slice for slice: held blocks are skipped (a chunk's slice splits
//!   into runs, the last run of the last chunk carries `last`), and no block is claimed twice
//!   per request, by a slice or a hold;
//! - claims only grow, and a batch call leaves the ledgers outside its batch as they were;
//! - a request's slices never leave its needed blocks and, once its chunks have covered
//!   `[R, P)` in order, they and its held blocks cover the needed blocks;
//! - block pairs and runs are the tables' ids of exactly the planned blocks.

#![no_main]

use std::collections::{BTreeMap, BTreeSet};

use arbitrary::Arbitrary;
use kvferry::pairs::check_pools;
use kvferry::{
    block_pairs, BlockPairs, BlockRange, BlockTable, Ledger, RequestSpec, SlicePlan, TransferBook,
};
use kvferry_fuzz::pairs::{check_pack, check_pairs, pool_ids, table_refusal};
use kvferry_fuzz::{check_refusal, span, Int, Refusal, Reused, Shape, Span};
use libfuzzer_sys::fuzz_target;

/// Operations per input: longer histories reach no new state, they only slow the run down.
const MAX_OPS: usize = 64;
/// Block tables above this many ids are not built: at 64 Ki ids, filling them took two thirds
/// of the run, and a batch of a few requests of a few hundred blocks fits in 4 Ki.
const MAX_TABLE_IDS: usize = 1 << 12;
/// Ledgers above this many blocks skip the calls that walk their bitmap (`is_complete`,
/// `missing`) and are not copied whole into snapshots: a raw prompt length makes ledgers of up
/// to 2^24 blocks, and scanning those after every operation cut the run to a few hundred
/// inputs a second. For them the model's claims (disjoint, inside the needed blocks, summing to
/// the ledger's count) decide completion.
const MAX_SCANNED_BLOCKS: u64 = 1 << 12;

#[derive(Arbitrary, Debug)]
struct Input {
    tokens_per_block: Int,
    pipelined: bool,
    ops: Vec<Op>,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Add {
        id: Id,
        prompt_len: Int,
        reused: Reused,
        window: Option<Int>,
        context_only: bool,
    },
    Hold {
        id: Id,
        ranges: Vec<HoldRange>,
    },
    Cancel(Id),
    Remove(Id),
    Early {
        ids: Vec<Id>,
        tables: Option<Tables>,
    },
    Chunks {
        batch: Vec<(Id, Chunk)>,
        /// `Some(true)` gives `chunk_starts`, `Some(false)` `chunk_ends`, a wrong length.
        mismatch: Option<bool>,
        tables: Option<Tables>,
    },
    Pack {
        ids: PackIds,
        src_blocks: Int,
        dst_blocks: Int,
    },
    /// One scheduler step of every live request: `plan_early`, then the next `chunk` tokens
    /// of each unfinished one. Reaches long, valid histories that single ops rarely build.
    Step {
        chunk: u16,
        tables: Option<Tables>,
    },
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Id {
    /// The k-th live request (in id order), modulo their number.
    Live(u8),
    /// One of eight ids, so that batches repeat ids and name removed ones.
    Few(u8),
    Raw(i64),
}

/// Blocks the receiver already holds.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum HoldRange {
    /// `len` blocks from `start`.
    Blocks(u16, u8),
    /// Any bounds, reversed or past the prompt.
    Raw(u64, u64),
}

impl HoldRange {
    fn get(self) -> BlockRange {
        match self {
            Self::Blocks(start, len) => {
                let start = u64::from(start);
                BlockRange {
                    start,
                    end: start + u64::from(len),
                }
            }
            Self::Raw(start, end) => BlockRange { start, end },
        }
    }
}

/// The chunk a batch element offers, relative to what its request has run so far.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Chunk {
    /// The next `len` tokens (clamped to the prompt).
    Next(u16),
    /// The rest of the prompt.
    Rest,
    /// The chunk run `back` chunks ago, again: a resend.
    Again(u8),
    /// Any bounds.
    Raw(i64, i64),
}

/// A table dimension: the one the batch needs, or any other.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Extent {
    Fit,
    Other(u8),
}

#[derive(Arbitrary, Debug)]
struct Tables {
    rows: Extent,
    cols: Extent,
    /// Picks the id pattern (run length, gap, base near 0 or near `i64::MAX`).
    seed: u64,
    /// A negative id in the source (`true`) or destination table, at this position.
    negative: Option<(bool, u16)>,
    /// Pool sizes the planned ids must fit, each side checked only when given.
    src_blocks: Option<Int>,
    dst_blocks: Option<Int>,
}

#[derive(Arbitrary, Debug)]
enum PackIds {
    /// The pairs of the last plan made with tables.
    LastPairs,
    Raw(Vec<i64>, Vec<i64>),
}

fuzz_target!(|input: Input| {
    let tpb = input.tokens_per_block.get();
    let book = match TransferBook::new(tpb, input.pipelined) {
        Ok(book) => book,
        Err(err) => return check_refusal(&err, &Refusal::Invalid("tokens_per_block", None)),
    };
    assert!(tpb > 0, "a book with tokens_per_block={tpb}");
    let mut harness = Harness {
        book,
        tpb,
        pipelined: input.pipelined,
        live: BTreeMap::new(),
        seen: BTreeSet::new(),
        last_pairs: None,
    };
    for op in input.ops.into_iter().take(MAX_OPS) {
        harness.run(op);
    }
});

/// What the model knows of one live request.
#[allow(clippy::struct_excessive_bools)] // the book's flags, one for one
#[derive(Debug)]
struct Request {
    shape: Shape,
    context_only: bool,
    cancelled: bool,
    prefix_sent: bool,
    forward_started: bool,
    /// Every slice sent so far; disjoint.
    claims: Vec<Span>,
    /// Every range held (claimed without being sent); disjoint from each other and the slices.
    held: Vec<Span>,
    /// The chunks planned so far, for resends.
    history: Vec<(i64, i64)>,
    /// Where the next chunk starts: the end of the last one, or `R`.
    next: i64,
    /// Every chunk so far started where the previous one ended, the first at `R`.
    in_order: bool,
}

impl Request {
    /// The first block of `span` a slice already sent.
    fn first_sent(&self, span: Span) -> Option<u64> {
        first_in(&self.claims, span)
    }

    /// The first block of `span` already claimed, sent or held.
    fn first_claimed(&self, span: Span) -> Option<u64> {
        let sent_or_held = [first_in(&self.claims, span), first_in(&self.held, span)];
        sent_or_held.into_iter().flatten().min()
    }

    /// `span` less the held blocks, as maximal runs in order: what a slice of it sends.
    fn sendable(&self, span: Span) -> Vec<Span> {
        gaps(&self.held, span)
    }

    /// The needed blocks neither sent nor held, as maximal spans.
    fn missing(&self) -> Vec<Span> {
        gaps(
            &[&self.claims[..], &self.held[..]].concat(),
            self.shape.needed(),
        )
    }
}

/// Every observable of the book over the ids seen so far: its length and, per id, the ledger
/// (see `Kept`) and the cancelled flag of a live request. Stamps and the step counter are
/// bookkeeping a refused call may touch, so they are not part of it.
type Snapshot = (usize, Vec<Option<(Kept, bool)>>);

/// What a snapshot keeps of a ledger: its counts and flags, and the whole ledger when it is
/// small. Copying and comparing ledgers of megabytes around every operation took most of the
/// run once the bitmap scans were bounded.
#[derive(Debug, PartialEq)]
struct Kept {
    claimed: u64,
    held: u64,
    prefix_sent: bool,
    forward_started: bool,
    whole: Option<Ledger>,
}

impl Kept {
    fn new(ledger: &Ledger) -> Self {
        Self {
            claimed: ledger.claimed_blocks(),
            held: ledger.held_blocks(),
            prefix_sent: ledger.prefix_sent(),
            forward_started: ledger.forward_started(),
            whole: (ledger.num_blocks() <= MAX_SCANNED_BLOCKS).then(|| ledger.clone()),
        }
    }
}

struct Harness {
    book: TransferBook,
    tpb: i64,
    pipelined: bool,
    live: BTreeMap<i64, Request>,
    /// Every id an operation named, live or not: the domain of the snapshots.
    seen: BTreeSet<i64>,
    last_pairs: Option<BlockPairs>,
}

impl Harness {
    fn run(&mut self, op: Op) {
        match op {
            Op::Add {
                id,
                prompt_len,
                reused,
                window,
                context_only,
            } => {
                let prompt_len = prompt_len.get();
                let id = self.id(id);
                self.add(
                    id,
                    RequestSpec {
                        prompt_len,
                        reused_len: reused.get(prompt_len),
                        window: window.map(Int::get),
                        context_only,
                    },
                );
            }
            Op::Hold { id, ranges } => {
                let ranges: Vec<BlockRange> = ranges.iter().map(|r| r.get()).collect();
                self.hold(self.id(id), &ranges);
            }
            Op::Cancel(id) => self.cancel(self.id(id)),
            Op::Remove(id) => self.remove(self.id(id)),
            Op::Early { ids, tables } => {
                let ids: Vec<i64> = ids.iter().map(|&id| self.id(id)).collect();
                self.plan(&ids, None, tables.as_ref());
            }
            Op::Chunks {
                batch,
                mismatch,
                tables,
            } => {
                let ids: Vec<i64> = batch.iter().map(|&(id, _)| self.id(id)).collect();
                let (mut starts, mut ends): (Vec<i64>, Vec<i64>) = batch
                    .iter()
                    .map(|&(id, chunk)| self.chunk_bounds(self.id(id), chunk))
                    .unzip();
                if let Some(which) = mismatch {
                    let v = if which { &mut starts } else { &mut ends };
                    if v.pop().is_none() {
                        v.push(0);
                    }
                }
                self.plan(&ids, Some((&starts, &ends)), tables.as_ref());
            }
            Op::Pack {
                ids,
                src_blocks,
                dst_blocks,
            } => {
                let (src, dst) = match ids {
                    PackIds::LastPairs => self
                        .last_pairs
                        .as_ref()
                        .map(|p| (p.src.clone(), p.dst.clone()))
                        .unwrap_or_default(),
                    PackIds::Raw(src, dst) => (src, dst),
                };
                check_pack(&src, &dst, src_blocks.get(), dst_blocks.get());
            }
            Op::Step { chunk, tables } => {
                let ids: Vec<i64> = self.live.keys().copied().collect();
                self.plan(&ids, None, tables.as_ref());
                let open = |r: &Request| r.next < r.shape.prompt_len();
                let ids: Vec<i64> = ids.into_iter().filter(|id| open(&self.live[id])).collect();
                let (starts, ends): (Vec<i64>, Vec<i64>) = ids
                    .iter()
                    .map(|&id| self.chunk_bounds(id, Chunk::Next(chunk.max(1))))
                    .unzip();
                self.plan(&ids, Some((&starts, &ends)), tables.as_ref());
            }
        }
    }

    fn id(&self, id: Id) -> i64 {
        match id {
            Id::Live(k) if !self.live.is_empty() => {
                let k = usize::from(k) % self.live.len();
                self.live.keys().nth(k).copied().unwrap_or_default()
            }
            Id::Live(b) | Id::Few(b) => i64::from(b % 8) - 2,
            Id::Raw(id) => id,
        }
    }

    fn snapshot(&self) -> Snapshot {
        let requests = self.seen.iter().map(|&id| {
            let ledger = Kept::new(self.book.ledger(id).ok()?);
            Some((ledger, self.book.is_cancelled(id) == Ok(true)))
        });
        (self.book.len(), requests.collect())
    }

    fn add(&mut self, id: i64, spec: RequestSpec) {
        self.seen.insert(id);
        let before = self.snapshot();
        let want = if self.live.contains_key(&id) {
            Err("request_id")
        } else {
            let shape = Shape::new(self.tpb, spec.prompt_len, spec.reused_len, spec.window);
            shape.and_then(|s| {
                if s.fits_ledger() {
                    Ok(s)
                } else {
                    Err("prompt_len")
                }
            })
        };
        match (self.book.add(id, spec), want) {
            (Ok(()), Ok(shape)) => {
                let request = Request {
                    shape,
                    context_only: spec.context_only,
                    cancelled: false,
                    prefix_sent: false,
                    forward_started: false,
                    claims: Vec::new(),
                    held: Vec::new(),
                    history: Vec::new(),
                    next: spec.reused_len,
                    in_order: true,
                };
                self.live.insert(id, request);
                assert_eq!(self.book.len(), before.0 + 1);
                assert_eq!(self.book.is_cancelled(id), Ok(false));
                self.check_request(id);
            }
            (Err(err), Err(name)) => {
                check_refusal(&err, &Refusal::Invalid(name, None));
                assert_eq!(self.snapshot(), before, "a refused add changed the book");
            }
            (got, want) => panic!("add({id}, {spec:?}): got {got:?}, expected {want:?}"),
        }
    }

    fn hold(&mut self, id: i64, ranges: &[BlockRange]) {
        self.seen.insert(id);
        let before = self.snapshot();
        let old = self.book.ledger(id).ok().map(Kept::new);
        match (self.book.hold(id, ranges), self.expect_hold(id, ranges)) {
            (Ok(()), Ok(())) => {
                let r = self.live.get_mut(&id).unwrap();
                let spans = ranges.iter().map(|&range| span(range));
                r.held.extend(spans.filter(|(s, e)| s < e));
                check_grew(&old.unwrap(), self.book.ledger(id).unwrap());
                self.check_request(id);
            }
            (Err(err), Err(want)) => {
                check_refusal(&err, &want);
                assert_eq!(self.snapshot(), before, "a refused hold changed the book");
            }
            (got, want) => panic!("hold({id}, {ranges:?}): got {got:?}, expected {want:?}"),
        }
    }

    /// All ranges or none: the first that is reversed, passes the prompt, or overlaps a block
    /// already claimed (sent, held, or held by an earlier range of the same call) is refused.
    fn expect_hold(&self, id: i64, ranges: &[BlockRange]) -> Result<(), Refusal> {
        let r = self.live.get(&id).ok_or(Refusal::Unknown(id))?;
        let mut taken = [&r.claims[..], &r.held[..]].concat();
        for &range in ranges {
            let claim = span(range);
            if claim.0 > claim.1 || claim.1 > r.shape.num_blocks() {
                return Err(Refusal::Invalid("range", Some(id)));
            }
            if let Some(block) = first_in(&taken, claim) {
                return Err(Refusal::Duplicate { id, block, claim });
            }
            taken.push(claim);
        }
        Ok(())
    }

    fn cancel(&mut self, id: i64) {
        self.seen.insert(id);
        let before = self.snapshot();
        match (self.book.cancel(id), self.live.contains_key(&id)) {
            (Ok(()), true) => {
                self.live.get_mut(&id).unwrap().cancelled = true;
                assert_eq!(self.book.is_cancelled(id), Ok(true));
            }
            (Err(err), false) => {
                check_refusal(&err, &Refusal::Unknown(id));
                assert_eq!(self.snapshot(), before, "a refused cancel changed the book");
            }
            (got, live) => panic!("cancel({id}) of a request live={live}: {got:?}"),
        }
    }

    fn remove(&mut self, id: i64) {
        self.seen.insert(id);
        let before = self.snapshot();
        let held = self.book.ledger(id).ok().cloned();
        match (self.book.remove(id), self.live.remove(&id)) {
            (Ok(ledger), Some(request)) => {
                assert_eq!(
                    Some(&ledger),
                    held.as_ref(),
                    "remove returned another ledger"
                );
                assert!(!self.book.contains(id));
                assert_eq!(self.book.len(), before.0 - 1);
                let small = ledger.num_blocks() <= MAX_SCANNED_BLOCKS;
                if small && request.in_order && request.next == request.shape.prompt_len() {
                    assert!(ledger.is_complete(), "request {id} removed incomplete");
                }
            }
            (Err(err), None) => {
                check_refusal(&err, &Refusal::Unknown(id));
                assert_eq!(self.snapshot(), before, "a refused remove changed the book");
            }
            (got, request) => panic!("remove({id}) of {request:?}: {got:?}"),
        }
    }

    /// The bounds a batch element offers for request `id`.
    fn chunk_bounds(&self, id: i64, chunk: Chunk) -> (i64, i64) {
        let Some(r) = self.live.get(&id) else {
            return match chunk {
                Chunk::Raw(s, e) => (s, e),
                _ => (0, 1),
            };
        };
        let prompt_len = r.shape.prompt_len();
        match chunk {
            Chunk::Next(len) => (r.next, r.next.saturating_add(len.into()).min(prompt_len)),
            Chunk::Rest => (r.next, prompt_len),
            Chunk::Again(back) => {
                let back = usize::from(back) % r.history.len().max(1);
                let again = r.history.iter().rev().nth(back).copied();
                again.unwrap_or((r.next, prompt_len))
            }
            Chunk::Raw(s, e) => (s, e),
        }
    }

    /// Plans a batch, early slices when `chunks` is `None`, and checks the outcome against
    /// the oracle, then the model.
    fn plan(&mut self, ids: &[i64], chunks: Option<(&[i64], &[i64])>, tables: Option<&Tables>) {
        self.seen.extend(ids);
        let before = self.snapshot();
        let built = tables.and_then(|t| self.build_tables(ids, t));
        let pools = tables.map_or((None, None), |t| {
            (t.src_blocks.map(Int::get), t.dst_blocks.map(Int::get))
        });
        let views = built.as_ref().map(|(src, dst, rows, cols)| {
            (
                BlockTable::new("src_block_table", src, *rows, *cols).unwrap(),
                BlockTable::new("dst_block_table", dst, *rows, *cols).unwrap(),
            )
        });
        // What the binding runs before it commits a plan made with tables.
        let pairs_of = |plan: &SlicePlan| {
            let Some((src, dst)) = views else {
                return Ok(None);
            };
            let pairs = block_pairs(plan, src, dst)?;
            check_pools(plan, &pairs, pools.0, pools.1)?;
            Ok(Some(pairs))
        };
        let got = match chunks {
            None => self.book.plan_early_then(ids, pairs_of),
            Some((starts, ends)) => self.book.plan_chunks_then(ids, starts, ends, pairs_of),
        };
        let want = match chunks {
            None => self.expect_early(ids),
            Some((starts, ends)) => self.expect_chunks(ids, starts, ends),
        };
        let want = want.and_then(|plan| {
            let refusal = views.and_then(|v| table_refusal(&plan, v, pools));
            refusal.map_or(Ok(plan), Err)
        });
        match (got, want) {
            (Ok((plan, pairs)), Ok(want)) => {
                assert_eq!(plan, want, "plan of batch {ids:?}");
                if let (Some(pairs), Some((src, dst))) = (pairs, views) {
                    check_pairs(&plan, &pairs, src, dst);
                    self.last_pairs = Some(pairs);
                }
                self.commit(&plan, ids, chunks);
                self.check_batch(&before, ids);
            }
            (Err(err), Err(want)) => {
                check_refusal(&err, &want);
                assert_eq!(
                    self.snapshot(),
                    before,
                    "a refused batch {ids:?} changed the book"
                );
            }
            (got, want) => panic!("batch {ids:?} {chunks:?}: got {got:?}, expected {want:?}"),
        }
    }

    /// The live request `id`, refusing it as `stamped` does: unknown, or listed twice.
    fn listed(&self, id: i64, listed: &mut BTreeSet<i64>) -> Result<&Request, Refusal> {
        let request = self.live.get(&id).ok_or(Refusal::Unknown(id))?;
        if !listed.insert(id) {
            return Err(Refusal::Invalid("request_ids", None));
        }
        Ok(request)
    }

    fn expect_early(&self, ids: &[i64]) -> Result<SlicePlan, Refusal> {
        let mut plan = SlicePlan {
            num_requests: ids.len(),
            ..SlicePlan::default()
        };
        let mut listed = BTreeSet::new();
        for (i, &id) in ids.iter().enumerate() {
            let r = self.listed(id, &mut listed)?;
            let eligible = self.pipelined
                && r.context_only
                && !r.cancelled
                && !r.prefix_sent
                && !r.forward_started;
            if let Some(claim) = r.shape.early().filter(|_| eligible) {
                if let Some(block) = r.first_sent(claim) {
                    return Err(Refusal::Duplicate { id, block, claim });
                }
                for run in r.sendable(claim) {
                    push(&mut plan, i, id, run, false);
                }
            }
        }
        Ok(plan)
    }

    fn expect_chunks(
        &self,
        ids: &[i64],
        starts: &[i64],
        ends: &[i64],
    ) -> Result<SlicePlan, Refusal> {
        for (name, len) in [("chunk_starts", starts.len()), ("chunk_ends", ends.len())] {
            if len != ids.len() {
                return Err(Refusal::Invalid(name, None));
            }
        }
        let mut plan = SlicePlan {
            num_requests: ids.len(),
            ..SlicePlan::default()
        };
        let mut listed = BTreeSet::new();
        for (i, (&id, (&s, &e))) in ids.iter().zip(starts.iter().zip(ends)).enumerate() {
            let r = self.listed(id, &mut listed)?;
            if let Some(name) = r.shape.chunk_error(s, e) {
                return Err(Refusal::Invalid(name, Some(id)));
            }
            if let Some(claim) = r.shape.chunk(s, e, r.prefix_sent) {
                if let Some(block) = r.first_sent(claim) {
                    return Err(Refusal::Duplicate { id, block, claim });
                }
                let runs = r.sendable(claim);
                for (k, &run) in runs.iter().enumerate() {
                    let last = e == r.shape.prompt_len() && k + 1 == runs.len();
                    push(&mut plan, i, id, run, last);
                }
            }
        }
        Ok(plan)
    }

    /// Applies an accepted plan to the model, checking each slice against the claims so far.
    fn commit(&mut self, plan: &SlicePlan, ids: &[i64], chunks: Option<(&[i64], &[i64])>) {
        for k in 0..plan.len() {
            let id = plan.request_id[k];
            let r = self.live.get_mut(&id).unwrap();
            let claim = (plan.start[k] as u64, plan.end[k] as u64);
            let (first, end) = r.shape.needed();
            assert!(
                first <= claim.0 && claim.0 < claim.1 && claim.1 <= end,
                "slice {claim:?} of request {id} outside its needed blocks [{first}, {end})"
            );
            assert_eq!(
                r.first_claimed(claim),
                None,
                "request {id} claims {claim:?} twice"
            );
            r.claims.push(claim);
            r.prefix_sent |= chunks.is_none();
        }
        if let Some((starts, ends)) = chunks {
            for (i, id) in ids.iter().enumerate() {
                let r = self.live.get_mut(id).unwrap();
                r.forward_started = true;
                r.in_order &= starts[i] == r.next;
                r.next = ends[i];
                r.history.push((starts[i], ends[i]));
            }
        }
    }

    /// After an accepted batch: the ledgers of the batch only grew and match the model; every
    /// other ledger is as it was.
    fn check_batch(&self, before: &Snapshot, ids: &[i64]) {
        assert_eq!(self.book.len(), before.0);
        for (&id, old) in self.seen.iter().zip(&before.1) {
            let now = self.book.ledger(id).ok();
            match (old, now) {
                (None, None) => {}
                (Some((old, cancelled)), Some(now)) => {
                    assert_eq!(self.book.is_cancelled(id), Ok(*cancelled));
                    if ids.contains(&id) {
                        check_grew(old, now);
                        self.check_request(id);
                    } else {
                        assert_eq!(
                            old,
                            &Kept::new(now),
                            "request {id} changed outside its batch"
                        );
                    }
                }
                (old, now) => panic!("request {id} went from {old:?} to {now:?} in a plan"),
            }
        }
    }

    /// The book's ledger of `id` against the model.
    fn check_request(&self, id: i64) {
        let r = &self.live[&id];
        let ledger = self.book.ledger(id).unwrap();
        assert_eq!(ledger.num_blocks(), r.shape.num_blocks());
        assert_eq!(
            (ledger.prefix_sent(), ledger.forward_started()),
            (r.prefix_sent, r.forward_started)
        );
        let blocks = |spans: &[Span]| spans.iter().map(|c| c.1 - c.0).sum::<u64>();
        assert_eq!(ledger.held_blocks(), blocks(&r.held), "request {id}");
        let claimed = blocks(&r.claims) + blocks(&r.held);
        assert_eq!(ledger.claimed_blocks(), claimed, "request {id}");
        for &(s, e) in r.claims.iter().chain(&r.held) {
            assert!(
                ledger.is_claimed(s) && ledger.is_claimed(e - 1),
                "[{s}, {e}) of {id}"
            );
        }
        let missing = r.missing();
        if ledger.num_blocks() <= MAX_SCANNED_BLOCKS {
            assert_eq!(ledger.is_complete(), missing.is_empty(), "request {id}");
            let got: Vec<Span> = ledger.missing().into_iter().map(span).collect();
            assert_eq!(got, missing, "missing blocks of request {id}");
        }
        if r.in_order && r.next == r.shape.prompt_len() {
            assert!(
                missing.is_empty(),
                "request {id} ran [R, P) in order but misses {missing:?}"
            );
        }
    }

    /// Tables of physical ids for a batch, or `None` when they would be too large.
    fn build_tables(&self, ids: &[i64], t: &Tables) -> Option<(Vec<i64>, Vec<i64>, usize, usize)> {
        let rows = match t.rows {
            Extent::Fit => ids.len(),
            Extent::Other(n) => n.into(),
        };
        let cols = match t.cols {
            Extent::Fit => {
                let widest = ids.iter().filter_map(|id| self.live.get(id));
                usize::try_from(widest.map(|r| r.shape.num_blocks()).max().unwrap_or(0)).ok()?
            }
            Extent::Other(n) => n.into(),
        };
        let n = rows.checked_mul(cols).filter(|&n| n <= MAX_TABLE_IDS)?;
        let mut src = pool_ids(n, t.seed);
        let mut dst = pool_ids(n, t.seed.rotate_left(23) ^ 0x5555);
        if let Some((in_src, pos)) = t.negative.filter(|_| n > 0) {
            let table = if in_src { &mut src } else { &mut dst };
            // `i64::MIN` as well as -1: the fast path ORs ids together and tests the sign bit.
            table[usize::from(pos) % n] = if pos % 2 == 0 { i64::MIN } else { -1 };
        }
        if n > 0 {
            let err = BlockTable::new("src_block_table", &src[1..], rows, cols).unwrap_err();
            check_refusal(&err, &Refusal::Invalid("src_block_table", None));
        }
        Some((src, dst, rows, cols))
    }
}

/// The first block of `span` inside one of `spans` (an empty span holds no block).
fn first_in(spans: &[Span], (start, end): Span) -> Option<u64> {
    let overlapping = spans.iter().filter(|c| c.0.max(start) < c.1.min(end));
    overlapping.map(|c| c.0.max(start)).min()
}

/// `span` less `spans`, as maximal runs in order.
fn gaps(spans: &[Span], (start, end): Span) -> Vec<Span> {
    let mut inside: Vec<Span> = spans
        .iter()
        .map(|&(s, e)| (s.max(start), e.min(end)))
        .filter(|(s, e)| s < e)
        .collect();
    inside.sort_unstable();
    let mut out = Vec::new();
    let mut at = start;
    for (s, e) in inside {
        if s > at {
            out.push((at, s));
        }
        at = at.max(e);
    }
    if at < end {
        out.push((at, end));
    }
    out
}

fn push(plan: &mut SlicePlan, index: usize, id: i64, (start, end): Span, last: bool) {
    plan.request_index.push(index as i64);
    plan.request_id.push(id);
    plan.start.push(start as i64);
    plan.end.push(end as i64);
    plan.last.push(last);
}

/// A ledger of the batch after an accepted call: no count or flag went back. Block by block,
/// `check_request` compares the unclaimed blocks with the model's, whose claims only grow.
fn check_grew(old: &Kept, now: &Ledger) {
    assert!(now.claimed_blocks() >= old.claimed);
    assert!(now.held_blocks() >= old.held);
    assert!(now.prefix_sent() || !old.prefix_sent);
    assert!(now.forward_started() || !old.forward_started);
}
