//! Property tests of the pure planning core: the invariants the issue's "Semantics" section
//! promises, checked on random prompts, chunkings and batches.
//!
//! ```text
//! tokens:  |<------ reused R ------>|<-- chunk s..e -->| ... |P
//! blocks:  [0 ....... floor(R/tpb))[boundary][ ... floor(e/tpb)) ... ceil(P/tpb))
//! early:   [0, floor(R/tpb))        non-final chunk: [.., floor(e/tpb))  last: [.., ceil(P/tpb))
//! ```
//! Every test drives the public API only; where a test needs an oracle it restates the
//! issue's formulas here rather than calling back into the code under test.

use kvferry::{
    block_pairs, block_runs, chunk_blocks, early_prefix_blocks, select_early, BlockRange,
    BlockTable, CoreError, EarlyInputs, Flag, Ledger, Prompt, RequestSpec, SlicePlan, TransferBook,
};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A prompt shape: tokens per block, prompt length, reused length, and the chunk sizes that
/// the scheduler cycles through (one entry = fixed-size chunks).
#[derive(Debug, Clone)]
struct Shape {
    tpb: i64,
    prompt: i64,
    reused: i64,
    sizes: Vec<i64>,
}

/// tpb in 1..=64, P in 1..=5000, R in 0..P, chunk sizes in 1..=P.
fn shape(max_prompt: i64) -> impl Strategy<Value = Shape> {
    (1i64..=64, 1i64..=max_prompt).prop_flat_map(|(tpb, prompt)| {
        (0..prompt, prop::collection::vec(1..=prompt, 1..4)).prop_map(move |(reused, sizes)| {
            Shape {
                tpb,
                prompt,
                reused,
                sizes,
            }
        })
    })
}

/// The prefill chunks `[s, e)` that cover `[reused, prompt)`, cycling through `sizes`.
fn chunks(reused: i64, prompt: i64, sizes: &[i64]) -> Vec<(i64, i64)> {
    let mut out = Vec::new();
    let mut s = reused;
    let mut k = 0;
    while s < prompt {
        let e = (s + sizes[k % sizes.len()]).min(prompt);
        out.push((s, e));
        s = e;
        k += 1;
    }
    out
}

fn range(start: u64, end: u64) -> BlockRange {
    BlockRange { start, end }
}

/// The issue's chunk formula, restated independently of `plan.rs`.
fn expected_chunk(
    tpb: i64,
    prompt: i64,
    reused: i64,
    (s, e): (i64, i64),
    prefix_sent: bool,
) -> Option<BlockRange> {
    let (first, last) = (s == reused, e == prompt);
    let start = if first && !prefix_sent { 0 } else { s / tpb };
    let end = if last { (e + tpb - 1) / tpb } else { e / tpb };
    if !last && end <= start {
        return None;
    }
    Some(range(start as u64, end as u64))
}

/// Marks `r` in a per-block counter, failing on any block already covered.
fn cover(covered: &mut [u8], r: BlockRange) -> Result<(), TestCaseError> {
    for b in r.start..r.end {
        prop_assert!(
            (b as usize) < covered.len(),
            "block {b} past the end ({})",
            covered.len()
        );
        prop_assert_eq!(covered[b as usize], 0, "block {} covered twice", b);
        covered[b as usize] = 1;
    }
    Ok(())
}

/// A tiny deterministic generator for schedules, seeded by proptest so failures replay.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    /// A random subset of `items` in random order.
    fn subset(&mut self, items: &[i64]) -> Vec<i64> {
        let mut out: Vec<i64> = items.iter().copied().filter(|_| self.chance(60)).collect();
        for i in (1..out.len()).rev() {
            out.swap(i, self.below(i + 1));
        }
        out
    }
}

/// Everything observable about one ledger, for "nothing changed" comparisons.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LedgerState {
    claimed_blocks: u64,
    bits: Vec<bool>,
    prefix_sent: bool,
    forward_started: bool,
    is_complete: bool,
}

fn ledger_state(l: &Ledger) -> LedgerState {
    LedgerState {
        claimed_blocks: l.claimed_blocks(),
        bits: (0..l.num_blocks()).map(|b| l.is_claimed(b)).collect(),
        prefix_sent: l.prefix_sent(),
        forward_started: l.forward_started(),
        is_complete: l.is_complete(),
    }
}

// ---------------------------------------------------------------------------------------------
// One request: tiling, early prefix, unfinished blocks, sliding window, resends
// ---------------------------------------------------------------------------------------------

proptest! {
    /// The early slice plus the chunk slices cover `[0, ceil(P/tpb))` exactly once, every
    /// slice matches the issue's formula, and the ledger ends complete.
    #[test]
    fn early_and_chunks_tile_the_prompt_exactly_once(s in shape(5000), early in any::<bool>()) {
        let prompt = Prompt::new(s.tpb, s.prompt, s.reused, None).unwrap();
        let mut ledger = Ledger::new(prompt).unwrap();
        let num_blocks = ((s.prompt + s.tpb - 1) / s.tpb) as u64;
        prop_assert_eq!(ledger.num_blocks(), num_blocks);
        prop_assert_eq!(prompt.needed(), range(0, num_blocks));
        let mut covered = vec![0u8; num_blocks as usize];

        let reused_blocks = (s.reused / s.tpb) as u64;
        if early {
            let sent = ledger.send_early().unwrap();
            let want = (reused_blocks > 0).then(|| range(0, reused_blocks));
            prop_assert_eq!(sent, want);
            prop_assert_eq!(ledger.prefix_sent(), want.is_some());
            if let Some(r) = sent {
                cover(&mut covered, r)?;
            }
        }
        let prefix_sent = ledger.prefix_sent();

        let all = chunks(s.reused, s.prompt, &s.sizes);
        for (k, &(cs, ce)) in all.iter().enumerate() {
            let last = k + 1 == all.len();
            let got = ledger.send_chunk(cs, ce).unwrap();
            prop_assert_eq!(got, expected_chunk(s.tpb, s.prompt, s.reused, (cs, ce), prefix_sent));
            prop_assert_eq!(
                got,
                chunk_blocks(s.tpb, s.prompt, cs, ce, s.reused, prefix_sent, None).unwrap()
            );
            match got {
                Some(r) => {
                    prop_assert!(!r.is_empty(), "chunk ({cs}, {ce}) yielded an empty range");
                    if !last {
                        // A non-final slice never holds a block the chunk did not finish.
                        prop_assert!(
                            r.end as i64 * s.tpb <= ce,
                            "chunk ({cs}, {ce}) sends unfinished block {}", r.end - 1
                        );
                    }
                    cover(&mut covered, r)?;
                }
                None => prop_assert!(!last, "the last chunk ({cs}, {ce}) yielded nothing"),
            }
        }

        prop_assert!(covered.iter().all(|&c| c == 1), "uncovered blocks: {:?}", ledger.missing());
        prop_assert!(ledger.is_complete());
        prop_assert_eq!(ledger.claimed_blocks(), num_blocks);
        prop_assert!(ledger.missing().is_empty());
    }

    /// The early slice is the complete reused blocks: inside `[0, floor(R/tpb))`, never the
    /// partial boundary block, and the same through every entry point.
    #[test]
    fn early_slice_lies_inside_the_reused_prefix(s in shape(5000)) {
        let prompt = Prompt::new(s.tpb, s.prompt, s.reused, None).unwrap();
        let early = prompt.early();
        prop_assert_eq!(early, early_prefix_blocks(s.tpb, s.reused).unwrap());
        prop_assert_eq!(early, Ledger::new(prompt).unwrap().early_candidate());
        match early {
            Some(r) => {
                prop_assert_eq!(r.start, 0);
                prop_assert_eq!(r.end as i64, s.reused / s.tpb);
                prop_assert!(r.end as i64 * s.tpb <= s.reused);
            }
            None => prop_assert!(s.reused < s.tpb),
        }
    }

    /// Sliding window `W < P`: nothing early, nothing on non-final chunks, and the last chunk
    /// sends the live window `[floor((P+1-W)/tpb), ceil(P/tpb))`.
    #[test]
    fn sliding_window_sends_only_the_live_window(
        s in shape(5000).prop_filter("W < P needs P >= 2", |s| s.prompt >= 2),
        window_seed in any::<u64>(),
        early in any::<bool>(),
    ) {
        let window = 1 + (window_seed % (s.prompt as u64 - 1)) as i64; // 1..P
        let prompt = Prompt::new(s.tpb, s.prompt, s.reused, Some(window)).unwrap();
        prop_assert_eq!(prompt.window(), Some(window as u64));
        let live = range(
            ((s.prompt + 1 - window) / s.tpb).max(0) as u64,
            ((s.prompt + s.tpb - 1) / s.tpb) as u64,
        );
        prop_assert_eq!(prompt.needed(), live);

        let mut ledger = Ledger::new(prompt).unwrap();
        prop_assert_eq!(prompt.early(), None);
        if early {
            prop_assert_eq!(ledger.send_early().unwrap(), None);
            prop_assert!(!ledger.prefix_sent());
        }
        let all = chunks(s.reused, s.prompt, &s.sizes);
        for (k, &(cs, ce)) in all.iter().enumerate() {
            let got = ledger.send_chunk(cs, ce).unwrap();
            let free = chunk_blocks(s.tpb, s.prompt, cs, ce, s.reused, false, Some(window));
            prop_assert_eq!(got, free.unwrap());
            if k + 1 == all.len() {
                // An empty live window (W = 1 on a block boundary) sends nothing.
                let want = if live.is_empty() { None } else { Some(live) };
                prop_assert_eq!(got, want);
            } else {
                prop_assert_eq!(got, None, "non-final chunk ({}, {}) sent blocks", cs, ce);
                prop_assert!(!ledger.is_complete() || live.is_empty());
            }
        }
        prop_assert!(ledger.is_complete());
        prop_assert_eq!(ledger.claimed_blocks(), live.len());
        prop_assert!(ledger.missing().is_empty());
    }

    /// A window that covers the prompt is full attention: the same prompt as no window.
    #[test]
    fn window_at_least_the_prompt_is_full_attention(s in shape(5000), extra in 0i64..100) {
        let full = Prompt::new(s.tpb, s.prompt, s.reused, None).unwrap();
        let wide = Prompt::new(s.tpb, s.prompt, s.reused, Some(s.prompt + extra)).unwrap();
        prop_assert_eq!(wide, full);
    }

    /// A second send of the early slice or of any chunk that sent blocks is refused with
    /// `DuplicateTransfer` and leaves the ledger as it was; nothing ever leaves twice.
    #[test]
    fn resends_are_refused_and_change_nothing(s in shape(2000), early in any::<bool>()) {
        let mut ledger = Ledger::new(Prompt::new(s.tpb, s.prompt, s.reused, None).unwrap()).unwrap();
        let refused = |ledger: &Ledger, res: Result<Option<BlockRange>, CoreError>, r: BlockRange,
                       before: &LedgerState| -> Result<(), TestCaseError> {
            match res {
                Err(CoreError::DuplicateTransfer { block, start, end, .. }) => {
                    prop_assert_eq!((block, start, end), (r.start, r.start, r.end));
                }
                other => prop_assert!(false, "resend of {r} gave {other:?}"),
            }
            prop_assert_eq!(&ledger_state(ledger), before);
            Ok(())
        };

        if early {
            if let Some(r) = ledger.send_early().unwrap() {
                let before = ledger_state(&ledger);
                let again = ledger.send_early();
                refused(&ledger, again, r, &before)?;
                // An explicit claim of any early block is refused too.
                let again = ledger.claim(range(r.end - 1, r.end)).map(|()| None);
                refused(&ledger, again, range(r.end - 1, r.end), &before)?;
            }
        }
        let mut sent = Vec::new();
        for (cs, ce) in chunks(s.reused, s.prompt, &s.sizes) {
            if let Some(r) = ledger.send_chunk(cs, ce).unwrap() {
                let before = ledger_state(&ledger);
                let again = ledger.send_chunk(cs, ce);
                refused(&ledger, again, r, &before)?;
                sent.push((cs, ce, r));
            }
        }
        prop_assert!(ledger.is_complete());
        let done = ledger_state(&ledger);
        // Once complete, every earlier chunk is still refused, and nothing leaves early.
        for (cs, ce, r) in sent {
            let again = ledger.send_chunk(cs, ce);
            refused(&ledger, again, r, &done)?;
        }
        prop_assert!(!matches!(ledger.send_early(), Ok(Some(_))));
        prop_assert_eq!(ledger_state(&ledger), done);
    }

    /// `select_early` agrees with the per-request eligibility rule of the issue.
    #[test]
    fn select_early_matches_the_eligibility_rule(
        tpb in 1i64..=64,
        rows in prop::collection::vec(
            (0i64..300, any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()), 0..40),
    ) {
        let reused: Vec<i64> = rows.iter().map(|r| r.0).collect();
        let ctx: Vec<bool> = rows.iter().map(|r| r.1).collect();
        let cancelled: Vec<bool> = rows.iter().map(|r| r.2).collect();
        let first: Vec<bool> = rows.iter().map(|r| r.3).collect();
        let pipelined: Vec<bool> = rows.iter().map(|r| r.4).collect();
        let inputs = EarlyInputs {
            reused_len: &reused,
            context_only: &ctx,
            cancelled: &cancelled,
            first_chunk: &first,
            pipelined: Flag::PerRequest(&pipelined),
        };
        let (idx, blocks) = select_early(tpb, &inputs).unwrap();
        let mut want = (Vec::new(), Vec::new());
        for (i, r) in rows.iter().enumerate() {
            if r.1 && !r.2 && r.3 && r.4 && r.0 / tpb > 0 {
                want.0.push(i as i64);
                want.1.push(r.0 / tpb);
            }
        }
        prop_assert_eq!((idx, blocks), want);
    }
}

// ---------------------------------------------------------------------------------------------
// The batch API against per-request ledgers
// ---------------------------------------------------------------------------------------------

/// One request of a simulated worker, with the reference ledger driven alongside the book.
#[derive(Debug)]
struct Sim {
    id: i64,
    spec: RequestSpec,
    chunks: Vec<(i64, i64)>,
    next_chunk: usize,
    cancelled: bool,
    reference: Ledger,
}

fn request() -> impl Strategy<Value = (RequestSpec, Vec<i64>)> {
    (1i64..=3000).prop_flat_map(|prompt| {
        (
            0..prompt,
            prop::option::weighted(0.2, 1..=prompt + 10),
            prop::bool::weighted(0.9),
            prop::collection::vec(1..=prompt, 1..3),
        )
            .prop_map(move |(reused, window, context_only, sizes)| {
                (
                    RequestSpec {
                        prompt_len: prompt,
                        reused_len: reused,
                        window,
                        context_only,
                    },
                    sizes,
                )
            })
    })
}

fn book_case() -> impl Strategy<Value = (i64, bool, Vec<(RequestSpec, Vec<i64>)>, u64)> {
    (1i64..=64, prop::bool::weighted(0.8)).prop_flat_map(|(tpb, pipelined)| {
        (
            Just(tpb),
            Just(pipelined),
            prop::collection::vec(request(), 1..=12),
            any::<u64>(),
        )
    })
}

/// The reference answer of `plan_early` for one batch, applied to the reference ledgers.
fn reference_early(sims: &mut [Sim], ids: &[i64], pipelined: bool) -> SlicePlan {
    let mut plan = SlicePlan {
        num_requests: ids.len(),
        ..SlicePlan::default()
    };
    for (i, &id) in ids.iter().enumerate() {
        let sim = sims.iter_mut().find(|s| s.id == id).unwrap();
        let eligible =
            pipelined && sim.spec.context_only && !sim.cancelled && !sim.reference.prefix_sent();
        if !eligible {
            continue;
        }
        if let Some(r) = sim.reference.send_early().unwrap() {
            plan.request_index.push(i as i64);
            plan.request_id.push(id);
            plan.start.push(r.start as i64);
            plan.end.push(r.end as i64);
            plan.last.push(false);
        }
    }
    plan
}

/// The reference answer of `plan_chunks` for one batch, applied to the reference ledgers.
fn reference_chunks(sims: &mut [Sim], ids: &[i64]) -> SlicePlan {
    let mut plan = SlicePlan {
        num_requests: ids.len(),
        ..SlicePlan::default()
    };
    for (i, &id) in ids.iter().enumerate() {
        let sim = sims.iter_mut().find(|s| s.id == id).unwrap();
        let (cs, ce) = sim.chunks[sim.next_chunk];
        sim.next_chunk += 1;
        if let Some(r) = sim.reference.send_chunk(cs, ce).unwrap() {
            plan.request_index.push(i as i64);
            plan.request_id.push(id);
            plan.start.push(r.start as i64);
            plan.end.push(r.end as i64);
            plan.last.push(ce == sim.spec.prompt_len);
        }
    }
    plan
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// `TransferBook::plan_early` / `plan_chunks` over random multi-request schedules agree
    /// slice for slice with per-request ledgers driven the same way, and removed requests come
    /// back complete.
    #[test]
    fn book_agrees_with_per_request_ledgers((tpb, pipelined, reqs, seed) in book_case()) {
        let mut rng = SplitMix(seed);
        let mut book = TransferBook::new(tpb, pipelined).unwrap();
        let mut sims: Vec<Sim> = Vec::new();
        for (k, (spec, sizes)) in reqs.into_iter().enumerate() {
            // Sparse, unordered ids: the book is keyed by id, not by position.
            let id = (k as i64) * 7919 - 1000;
            book.add(id, spec).unwrap();
            let prompt = Prompt::new(tpb, spec.prompt_len, spec.reused_len, spec.window).unwrap();
            sims.push(Sim {
                id,
                spec,
                chunks: chunks(spec.reused_len, spec.prompt_len, &sizes),
                next_chunk: 0,
                cancelled: false,
                reference: Ledger::new(prompt).unwrap(),
            });
        }

        while !sims.is_empty() {
            let live: Vec<i64> = sims.iter().map(|s| s.id).collect();
            if rng.chance(5) {
                let id = live[rng.below(live.len())];
                book.cancel(id).unwrap();
                sims.iter_mut().find(|s| s.id == id).unwrap().cancelled = true;
            }

            let early_ids = rng.subset(&live);
            let got = book.plan_early(&early_ids).unwrap();
            let want = reference_early(&mut sims, &early_ids, pipelined);
            prop_assert_eq!(got, want);

            let chunk_ids = rng.subset(&live);
            let (starts, ends): (Vec<i64>, Vec<i64>) = chunk_ids
                .iter()
                .map(|&id| {
                    let sim = sims.iter().find(|s| s.id == id).unwrap();
                    sim.chunks[sim.next_chunk]
                })
                .unzip();
            let got = book.plan_chunks(&chunk_ids, &starts, &ends).unwrap();
            let want = reference_chunks(&mut sims, &chunk_ids);
            prop_assert_eq!(got, want);

            for sim in &sims {
                let held = book.ledger(sim.id).unwrap();
                prop_assert_eq!(held.claimed_blocks(), sim.reference.claimed_blocks());
                prop_assert_eq!(held.prefix_sent(), sim.reference.prefix_sent());
                prop_assert_eq!(held.forward_started(), sim.reference.forward_started());
            }

            // Finished requests leave the book complete and free their ledger.
            let mut k = 0;
            while k < sims.len() {
                if sims[k].next_chunk == sims[k].chunks.len() {
                    let sim = sims.swap_remove(k);
                    let ledger = book.remove(sim.id).unwrap();
                    prop_assert!(ledger.is_complete());
                    prop_assert!(ledger.missing().is_empty());
                    prop_assert_eq!(ledger_state(&ledger), ledger_state(&sim.reference));
                    prop_assert!(!book.contains(sim.id));
                    prop_assert!(matches!(book.remove(sim.id), Err(CoreError::UnknownRequest(_))));
                } else {
                    k += 1;
                }
            }
            prop_assert_eq!(book.len(), sims.len());
        }
        prop_assert!(book.is_empty());
    }
}

// ---------------------------------------------------------------------------------------------
// A batch with one invalid element changes nothing
// ---------------------------------------------------------------------------------------------

/// How the one bad element of a batch is bad.
#[derive(Debug, Clone, Copy)]
enum Bad {
    UnknownId,
    RepeatedId,
    ChunkPastPrompt,
    ChunkBeforeReuse,
    EmptyChunk,
    Resend,
    ShortArray,
}

fn book_snapshot(book: &TransferBook, ids: &[i64]) -> Vec<(LedgerState, bool)> {
    ids.iter()
        .map(|&id| {
            (
                ledger_state(book.ledger(id).unwrap()),
                book.is_cancelled(id).unwrap(),
            )
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any invalid element (unknown or repeated id, chunk outside `[R, P]`, empty chunk,
    /// resend of a claimed slice, mismatched array lengths) fails the whole `plan_chunks` /
    /// `plan_early` call and leaves every ledger of the book untouched.
    #[test]
    fn a_batch_with_an_invalid_element_changes_nothing(
        tpb in 1i64..=64,
        reqs in prop::collection::vec((2i64..=3000, 0u64..1000), 2..=10),
        bad in prop::sample::select(vec![
            Bad::UnknownId, Bad::RepeatedId, Bad::ChunkPastPrompt, Bad::ChunkBeforeReuse,
            Bad::EmptyChunk, Bad::Resend, Bad::ShortArray,
        ]),
        seed in any::<u64>(),
    ) {
        let mut rng = SplitMix(seed);
        let mut book = TransferBook::new(tpb, true).unwrap();
        let mut ids = Vec::new();
        // (reused, prompt, chunk size, first chunk already sent)
        let mut shapes = Vec::new();
        for (k, &(prompt, r)) in reqs.iter().enumerate() {
            let reused = (r as i64 * prompt / 1000).min(prompt - 1);
            let id = k as i64 + 100;
            book.add(id, RequestSpec { prompt_len: prompt, reused_len: reused, window: None,
                                       context_only: true }).unwrap();
            ids.push(id);
            shapes.push((reused, prompt));
        }
        // Half the requests leave early, then every request runs one chunk of a third of
        // what is left; the step under test offers each its next chunk.
        let early_ids: Vec<i64> = ids.iter().copied().filter(|_| rng.chance(50)).collect();
        book.plan_early(&early_ids).unwrap();
        let first: Vec<(i64, i64)> = shapes
            .iter()
            .map(|&(r, p)| (r, r + ((p - r) / 3).max(1)))
            .collect();
        let (s0, e0): (Vec<i64>, Vec<i64>) = first.iter().copied().unzip();
        let first_plan = book.plan_chunks(&ids, &s0, &e0).unwrap();
        // The valid step: every request that is not finished offers its next chunk.
        let open: Vec<usize> = (0..ids.len()).filter(|&i| e0[i] < shapes[i].1).collect();
        let valid_batch: Vec<i64> = open.iter().map(|&i| ids[i]).collect();
        let valid_starts: Vec<i64> = open.iter().map(|&i| e0[i]).collect();
        let valid_ends: Vec<i64> = open
            .iter()
            .map(|&i| (e0[i] + ((shapes[i].1 - e0[i]) / 2).max(1)).min(shapes[i].1))
            .collect();
        let (mut batch, mut starts, mut ends) =
            (valid_batch.clone(), valid_starts.clone(), valid_ends.clone());

        let before = book_snapshot(&book, &ids);
        let pos = if batch.is_empty() { 0 } else { rng.below(batch.len()) };
        match bad {
            Bad::UnknownId => {
                batch.insert(pos, 12_345);
                starts.insert(pos, 0);
                ends.insert(pos, 1);
            }
            Bad::RepeatedId => {
                let i = rng.below(ids.len());
                batch.insert(pos, ids[i]);
                starts.insert(pos, first[i].0);
                ends.insert(pos, first[i].1);
                if batch.iter().filter(|&&id| id == ids[i]).count() < 2 {
                    batch.push(ids[i]);
                    starts.push(first[i].0);
                    ends.push(first[i].1);
                }
            }
            Bad::ChunkPastPrompt | Bad::ChunkBeforeReuse | Bad::EmptyChunk => {
                prop_assume!(!batch.is_empty());
                let i = (batch[pos] - 100) as usize;
                let (r, p) = shapes[i];
                match bad {
                    Bad::ChunkPastPrompt => ends[pos] = p + 1,
                    Bad::ChunkBeforeReuse => {
                        prop_assume!(r > 0);
                        starts[pos] = r - 1;
                    }
                    _ => ends[pos] = starts[pos],
                }
            }
            Bad::Resend => {
                // Offer again a first chunk that did send blocks.
                prop_assume!(!first_plan.is_empty());
                let k = rng.below(first_plan.len());
                let id = first_plan.request_id[k];
                let i = (id - 100) as usize;
                if let Some(j) = batch.iter().position(|&b| b == id) {
                    starts[j] = first[i].0;
                    ends[j] = first[i].1;
                } else {
                    batch.insert(pos, id);
                    starts.insert(pos, first[i].0);
                    ends.insert(pos, first[i].1);
                }
            }
            Bad::ShortArray => {
                prop_assume!(!batch.is_empty());
                ends.pop();
            }
        }

        let err = book.plan_chunks(&batch, &starts, &ends).unwrap_err();
        match bad {
            Bad::UnknownId => prop_assert_eq!(&err, &CoreError::UnknownRequest(12_345)),
            Bad::Resend => prop_assert!(
                matches!(err, CoreError::DuplicateTransfer { .. }), "{err}"),
            // The repeated entry re-offers an already-sent first chunk, so the call may stop
            // at that resend before it reaches the repeat: either refusal is right.
            Bad::RepeatedId => prop_assert!(
                matches!(err, CoreError::InvalidArgument { name: "request_ids", .. }
                    | CoreError::DuplicateTransfer { .. }), "{err}"),
            Bad::ChunkBeforeReuse => prop_assert!(
                matches!(err, CoreError::InvalidArgument { name: "chunk_start", .. }), "{err}"),
            Bad::ChunkPastPrompt | Bad::EmptyChunk => prop_assert!(
                matches!(err, CoreError::InvalidArgument { name: "chunk_end", .. }), "{err}"),
            Bad::ShortArray => prop_assert!(
                matches!(err, CoreError::InvalidArgument { name: "chunk_ends", .. }), "{err}"),
        }
        prop_assert_eq!(&book_snapshot(&book, &ids), &before);

        // plan_early with the same kind of bad id list is refused the same way.
        if matches!(bad, Bad::UnknownId | Bad::RepeatedId) {
            prop_assert!(book.plan_early(&batch).is_err());
            prop_assert_eq!(&book_snapshot(&book, &ids), &before);
        }

        // The failed call left no trace: the valid step still goes through, and the book then
        // matches per-request ledgers driven through the same history without the bad call.
        book.plan_chunks(&valid_batch, &valid_starts, &valid_ends).unwrap();
        for (i, &id) in ids.iter().enumerate() {
            let (r, p) = shapes[i];
            let mut l = Ledger::new(Prompt::new(tpb, p, r, None).unwrap()).unwrap();
            if early_ids.contains(&id) {
                l.send_early().unwrap();
            }
            l.send_chunk(first[i].0, first[i].1).unwrap();
            if let Some(j) = valid_batch.iter().position(|&b| b == id) {
                l.send_chunk(valid_starts[j], valid_ends[j]).unwrap();
            }
            prop_assert_eq!(ledger_state(book.ledger(id).unwrap()), ledger_state(&l));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Physical block ids: pairs and coalesced runs
// ---------------------------------------------------------------------------------------------

/// A row of `cols` physical ids made of contiguous stretches with random jumps, so that runs
/// of every length appear.
fn id_row(cols: usize) -> impl Strategy<Value = Vec<i64>> {
    prop::collection::vec((0i64..5000, prop::bool::weighted(0.3)), cols).prop_map(|steps| {
        let mut row = Vec::with_capacity(steps.len());
        let mut prev: Option<i64> = None;
        for (fresh, jump) in steps {
            let id = match prev {
                Some(p) if !jump => p + 1,
                _ => fresh,
            };
            row.push(id);
            prev = Some(id);
        }
        row
    })
}

/// A plan over `rows` requests of `cols` blocks, with its two tables.
fn pairs_case() -> impl Strategy<Value = (SlicePlan, Vec<i64>, Vec<i64>, usize, usize)> {
    (1usize..=8, 1usize..=64).prop_flat_map(|(rows, cols)| {
        let slice = (0..rows, 0..cols)
            .prop_flat_map(move |(row, start)| (Just(row), Just(start), start + 1..=cols));
        (
            prop::collection::vec(slice, 0..12),
            prop::collection::vec(id_row(cols), rows),
            prop::collection::vec(id_row(cols), rows),
        )
            .prop_map(move |(slices, src, dst)| {
                let mut plan = SlicePlan {
                    num_requests: rows,
                    ..SlicePlan::default()
                };
                for (row, start, end) in slices {
                    plan.request_index.push(row as i64);
                    plan.request_id.push(row as i64 + 1000);
                    plan.start.push(start as i64);
                    plan.end.push(end as i64);
                    plan.last.push(false);
                }
                (plan, src.concat(), dst.concat(), rows, cols)
            })
    })
}

/// Checks pairs and runs of one plan against the tables.
fn check_pairs_and_runs(
    plan: &SlicePlan,
    src: &[i64],
    dst: &[i64],
    rows: usize,
    cols: usize,
) -> Result<(), TestCaseError> {
    let st = BlockTable::new("src_block_table", src, rows, cols).unwrap();
    let dt = BlockTable::new("dst_block_table", dst, rows, cols).unwrap();
    let pairs = block_pairs(plan, st, dt).unwrap();
    let runs = block_runs(plan, st, dt).unwrap();
    prop_assert_eq!(pairs.offsets.len(), plan.len() + 1);
    prop_assert_eq!(runs.offsets.len(), plan.len() + 1);
    prop_assert_eq!(pairs.offsets[0], 0);
    prop_assert_eq!(runs.offsets[0], 0);
    prop_assert_eq!(pairs.src.len() as u64, plan.total_blocks());
    prop_assert_eq!(runs.len.iter().sum::<i64>() as u64, plan.total_blocks());
    prop_assert_eq!(runs.src.len(), runs.len.len());
    prop_assert_eq!(runs.dst.len(), runs.len.len());
    for k in 0..plan.len() {
        let row = plan.request_index[k] as usize;
        let (s, e) = (plan.start[k] as usize, plan.end[k] as usize);
        let want_src = &src[row * cols + s..row * cols + e];
        let want_dst = &dst[row * cols + s..row * cols + e];
        let (p0, p1) = (pairs.offsets[k] as usize, pairs.offsets[k + 1] as usize);
        prop_assert_eq!(&pairs.src[p0..p1], want_src, "pairs of slice {}", k);
        prop_assert_eq!(&pairs.dst[p0..p1], want_dst, "pairs of slice {}", k);
        // The runs of slice k, expanded, are exactly its pairs: they cover it, never spill into
        // a neighbour slice, and within a run both sides advance by one.
        let (r0, r1) = (runs.offsets[k] as usize, runs.offsets[k + 1] as usize);
        let mut exp_src = Vec::new();
        let mut exp_dst = Vec::new();
        for r in r0..r1 {
            prop_assert!(runs.len[r] >= 1, "empty run {}", r);
            exp_src.extend((0..runs.len[r]).map(|i| runs.src[r] + i));
            exp_dst.extend((0..runs.len[r]).map(|i| runs.dst[r] + i));
            if r + 1 < r1 {
                // Maximal: the next run of the slice could not have extended this one.
                let joinable = runs.src[r + 1] == runs.src[r] + runs.len[r]
                    && runs.dst[r + 1] == runs.dst[r] + runs.len[r];
                prop_assert!(
                    !joinable,
                    "runs {} and {} of slice {} should be one",
                    r,
                    r + 1,
                    k
                );
            }
        }
        prop_assert_eq!(&exp_src[..], want_src, "runs of slice {}", k);
        prop_assert_eq!(&exp_dst[..], want_dst, "runs of slice {}", k);
    }
    Ok(())
}

proptest! {
    /// Runs expand to exactly the pairs, slice by slice, and are maximal.
    #[test]
    fn runs_expand_to_exactly_the_pairs((plan, src, dst, rows, cols) in pairs_case()) {
        check_pairs_and_runs(&plan, &src, &dst, rows, cols)?;
    }

    /// The same on plans that a book actually produced (early slices then chunk slices).
    #[test]
    fn runs_of_book_plans_expand_to_the_pairs(
        tpb in 1i64..=16,
        reqs in prop::collection::vec((2i64..=400, 0u64..1000), 1..=8),
        seed in any::<u64>(),
    ) {
        let mut rng = SplitMix(seed);
        let mut book = TransferBook::new(tpb, true).unwrap();
        let mut ids = Vec::new();
        let mut spans = Vec::new();
        for (k, &(prompt, r)) in reqs.iter().enumerate() {
            let reused = (r as i64 * prompt / 1000).min(prompt - 1);
            book.add(k as i64, RequestSpec { prompt_len: prompt, reused_len: reused,
                                             window: None, context_only: true }).unwrap();
            ids.push(k as i64);
            spans.push((reused, prompt));
        }
        let rows = ids.len();
        let cols = spans.iter().map(|&(_, p)| ((p + tpb - 1) / tpb) as usize).max().unwrap();
        // Contiguous tables with a few random breaks, the realistic shape of a paged pool.
        let mut table = |base: i64| -> Vec<i64> {
            let mut next = base;
            (0..rows * cols)
                .map(|_| {
                    if rng.chance(10) {
                        next += 1 + rng.below(50) as i64;
                    }
                    next += 1;
                    next
                })
                .collect()
        };
        let (src, dst) = (table(0), table(1_000_000));
        let early = book.plan_early(&ids).unwrap();
        check_pairs_and_runs(&early, &src, &dst, rows, cols)?;
        let (starts, ends): (Vec<i64>, Vec<i64>) = spans.iter().copied().unzip();
        let chunks = book.plan_chunks(&ids, &starts, &ends).unwrap();
        check_pairs_and_runs(&chunks, &src, &dst, rows, cols)?;
        prop_assert_eq!(
            early.total_blocks() + chunks.total_blocks(),
            spans.iter().map(|&(_, p)| ((p + tpb - 1) / tpb) as u64).sum::<u64>()
        );
    }
}

/// Contiguous tables coalesce each slice into a single run.
#[test]
fn contiguous_tables_give_one_run_per_slice() {
    let (rows, cols) = (4, 100);
    let src: Vec<i64> = (0..(rows * cols) as i64).collect();
    let dst: Vec<i64> = (0..(rows * cols) as i64).map(|i| i + 7).collect();
    let plan = SlicePlan {
        num_requests: rows,
        request_index: vec![3, 0, 2],
        request_id: vec![30, 0, 20],
        start: vec![0, 10, 50],
        end: vec![100, 11, 99],
        last: vec![true, false, false],
    };
    let st = BlockTable::new("src", &src, rows, cols).unwrap();
    let dt = BlockTable::new("dst", &dst, rows, cols).unwrap();
    let runs = block_runs(&plan, st, dt).unwrap();
    assert_eq!(runs.len, vec![100, 1, 49]);
    assert_eq!(runs.src, vec![300, 10, 250]);
    assert_eq!(runs.offsets, vec![0, 1, 2, 3]);
    // Two slices that touch in the same row still get separate runs.
    let touching = SlicePlan {
        num_requests: rows,
        request_index: vec![1, 1],
        request_id: vec![1, 1],
        start: vec![0, 5],
        end: vec![5, 9],
        last: vec![false, true],
    };
    let runs = block_runs(&touching, st, dt).unwrap();
    assert_eq!(runs.len, vec![5, 4]);
    assert_eq!(runs.offsets, vec![0, 1, 2]);
}

/// The whole of one request's table row `[start, end)` as its last slice.
fn one_slice(request_id: i64, start: i64, end: i64) -> SlicePlan {
    SlicePlan {
        num_requests: 1,
        request_index: vec![0],
        request_id: vec![request_id],
        start: vec![start],
        end: vec![end],
        last: vec![true],
    }
}

/// A physical id of `i64::MAX` is a valid (non-negative) id; coalescing must not overflow.
#[test]
fn runs_at_the_top_of_the_id_space() {
    let src = [i64::MAX, 0];
    let dst = [0, 1];
    let plan = one_slice(9, 0, 2);
    let st = BlockTable::new("src_block_table", &src, 1, 2).unwrap();
    let dt = BlockTable::new("dst_block_table", &dst, 1, 2).unwrap();
    let runs = block_runs(&plan, st, dt).unwrap();
    assert_eq!(runs.len, vec![1, 1]);
}

/// A negative id right after `i64::MAX` must be refused, not hidden inside a wrapped run.
#[test]
fn negative_id_after_the_top_id_is_refused() {
    let src = [i64::MAX, i64::MIN];
    let dst = [0, 1];
    let plan = one_slice(9, 0, 2);
    let st = BlockTable::new("src_block_table", &src, 1, 2).unwrap();
    let dt = BlockTable::new("dst_block_table", &dst, 1, 2).unwrap();
    assert!(block_pairs(&plan, st, dt).is_err());
    let err = block_runs(&plan, st, dt).unwrap_err().to_string();
    assert!(err.contains("at block 1 of request 9"), "{err}");
}

/// Negative ids anywhere in a slice are refused, naming the table, request and block.
#[test]
fn negative_ids_are_refused_by_both() {
    let src = [5, 6, 7, -3, 9];
    let dst = [0, 1, 2, 3, 4];
    let plan = one_slice(42, 1, 5);
    let st = BlockTable::new("src_block_table", &src, 1, 5).unwrap();
    let dt = BlockTable::new("dst_block_table", &dst, 1, 5).unwrap();
    for err in [
        block_pairs(&plan, st, dt).unwrap_err(),
        block_runs(&plan, st, dt).unwrap_err(),
    ] {
        let msg = err.to_string();
        assert!(
            msg.starts_with("invalid src_block_table=<id -3 at block 3 of request 42>"),
            "{msg}"
        );
    }
}

/// The issue's worked examples, through the public API.
#[test]
fn issue_examples() {
    let r = |s, e| Some(range(s, e));
    let p = Prompt::new(4, 32, 0, None).unwrap();
    assert_eq!(p.chunk(0, 6, false).unwrap(), r(0, 1));
    assert_eq!(p.chunk(6, 12, false).unwrap(), r(1, 3));
    assert_eq!(p.chunk(12, 32, false).unwrap(), r(3, 8));
    let p = Prompt::new(4, 32, 12, None).unwrap();
    assert_eq!(p.chunk(12, 24, false).unwrap(), r(0, 6));
    assert_eq!(p.chunk(12, 24, true).unwrap(), r(3, 6));
    let mut l = Ledger::new(Prompt::new(32, 1000, 700, None).unwrap()).unwrap();
    assert_eq!(l.send_early().unwrap(), r(0, 21));
    let got: Vec<_> = [(700, 828), (828, 956), (956, 1000)]
        .into_iter()
        .map(|(s, e)| l.send_chunk(s, e).unwrap())
        .collect();
    assert_eq!(got, vec![r(21, 25), r(25, 29), r(29, 32)]);
    let p = Prompt::new(4, 32, 0, Some(16)).unwrap();
    assert_eq!(p.chunk(0, 16, false).unwrap(), None);
    assert_eq!(p.chunk(16, 32, false).unwrap(), r(4, 8));
}

// ---------------------------------------------------------------------------------------------
// Blocks the receiver already holds
// ---------------------------------------------------------------------------------------------

/// Random disjoint held ranges inside `[0, num_blocks)`: a mask drawn block by block.
fn held_ranges(num_blocks: u64, mask: &[bool]) -> Vec<BlockRange> {
    let mut out = Vec::new();
    let mut start = None;
    for b in 0..num_blocks {
        let held = mask[b as usize % mask.len()];
        match (held, start) {
            (true, None) => start = Some(b),
            (false, Some(s)) => {
                out.push(range(s, b));
                start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = start {
        out.push(range(s, num_blocks));
    }
    out
}

proptest! {
    /// With holes held by the receiver, the planned slices and the held blocks tile the
    /// prompt exactly once, no slice touches a held block, only the final row of the last
    /// chunk is marked last, and the request ends complete with every block claimed.
    #[test]
    fn held_blocks_never_leave_and_the_rest_leaves_once(
        s in shape(3000),
        mask in prop::collection::vec(any::<bool>(), 1..40),
        pipelined in any::<bool>(),
    ) {
        let mut book = TransferBook::new(s.tpb, pipelined).unwrap();
        let spec = RequestSpec { prompt_len: s.prompt, reused_len: s.reused, window: None, context_only: true };
        book.add(1, spec).unwrap();
        let num_blocks = ((s.prompt + s.tpb - 1) / s.tpb) as u64;
        let held = held_ranges(num_blocks, &mask);
        book.hold(1, &held).unwrap();
        let held_count: u64 = held.iter().map(BlockRange::len).sum();
        prop_assert_eq!(book.ledger(1).unwrap().held_blocks(), held_count);
        let mut covered = vec![0u8; num_blocks as usize];
        for r in &held {
            cover(&mut covered, *r)?;
        }
        let early = book.plan_early(&[1]).unwrap();
        let mut rows: Vec<(u64, u64, bool)> = (0..early.len())
            .map(|k| (early.start[k] as u64, early.end[k] as u64, early.last[k]))
            .collect();
        let all = chunks(s.reused, s.prompt, &s.sizes);
        for &(cs, ce) in &all {
            let plan = book.plan_chunks(&[1], &[cs], &[ce]).unwrap();
            rows.extend((0..plan.len()).map(|k| (plan.start[k] as u64, plan.end[k] as u64, plan.last[k])));
        }
        for &(start, end, _) in &rows {
            prop_assert!(start < end, "empty row {}..{}", start, end);
            cover(&mut covered, range(start, end))?;
        }
        prop_assert!(covered.iter().all(|&c| c == 1), "uncovered blocks: {:?}", book.ledger(1).unwrap().missing());
        let lasts: Vec<usize> = rows.iter().enumerate().filter(|(_, r)| r.2).map(|(k, _)| k).collect();
        prop_assert!(lasts.len() <= 1 && lasts.iter().all(|&k| k + 1 == rows.len()), "last flags {:?}", rows);
        let ledger = book.ledger(1).unwrap();
        prop_assert!(ledger.is_complete());
        prop_assert_eq!(ledger.claimed_blocks(), num_blocks);
    }

    /// A hold that overlaps an earlier claim or leaves the prompt fails and changes nothing.
    #[test]
    fn a_failing_hold_changes_nothing(s in shape(2000), extra in 1u64..5) {
        let mut book = TransferBook::new(s.tpb, true).unwrap();
        let spec = RequestSpec { prompt_len: s.prompt, reused_len: s.reused, window: None, context_only: true };
        book.add(1, spec).unwrap();
        let num_blocks = ((s.prompt + s.tpb - 1) / s.tpb) as u64;
        book.plan_early(&[1]).unwrap();
        let before = book.ledger(1).unwrap().clone();
        // A valid first range, then one past the end: neither is applied.
        let bad = [range(num_blocks - 1, num_blocks), range(num_blocks, num_blocks + extra)];
        prop_assert!(book.hold(1, &bad).is_err());
        prop_assert_eq!(book.ledger(1).unwrap(), &before);
        if before.claimed_blocks() > 0 {
            let duplicate = matches!(book.hold(1, &[range(0, 1)]), Err(CoreError::DuplicateTransfer { .. }));
            prop_assert!(duplicate, "holding a claimed block must be a duplicate");
            prop_assert_eq!(book.ledger(1).unwrap(), &before);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Layer-wise streaming: per-(layer group, block) claims
// ---------------------------------------------------------------------------------------------

/// Marks the rows of `plan` in `covered[g][b]` for the groups in `groups`, failing on any
/// (group, block) already covered, and returns the rows as `(start, end, last)`.
fn cover_groups(
    covered: &mut [Vec<u8>],
    plan: &SlicePlan,
    groups: std::ops::Range<usize>,
) -> Result<Vec<(u64, u64, bool)>, TestCaseError> {
    let mut rows = Vec::new();
    for k in 0..plan.len() {
        let (start, end) = (plan.start[k] as u64, plan.end[k] as u64);
        prop_assert!(start < end, "empty row {}..{}", start, end);
        for g in groups.clone() {
            cover(&mut covered[g], range(start, end))?;
        }
        rows.push((start, end, plan.last[k]));
    }
    Ok(rows)
}

proptest! {
    /// Early slice, then each chunk either as a chunk slice, or (the last chunk, at random) as
    /// one layer slice per group in random order followed by its chunk slice: every
    /// (group, block) crosses exactly once (a whole-block slice covers every group), held
    /// blocks never, each group's `last` is its final row of the last chunk, and the ledger
    /// ends complete. On the way, a whole-block plan over partially streamed blocks and a
    /// group out of range are refused and change nothing.
    #[test]
    fn layer_slices_cover_each_group_block_exactly_once(
        s in shape(3000),
        groups in 1usize..=5,
        mask in prop::collection::vec(any::<bool>(), 1..40),
        hold in any::<bool>(),
        early in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let mut rng = SplitMix(seed);
        let mut book = TransferBook::with_layer_groups(s.tpb, true, groups as i64).unwrap();
        let spec = RequestSpec { prompt_len: s.prompt, reused_len: s.reused, window: None, context_only: true };
        book.add(1, spec).unwrap();
        let num_blocks = ((s.prompt + s.tpb - 1) / s.tpb) as u64;
        let held = if hold { held_ranges(num_blocks, &mask) } else { Vec::new() };
        book.hold(1, &held).unwrap();
        // The receiver's ledger takes every row the sender planned, each once: a layer row
        // with `claim_layer`, a whole-block row with `claim`; a repeat is refused.
        let mut receiver = Ledger::new(Prompt::new(s.tpb, s.prompt, s.reused, None).unwrap()).unwrap();
        for r in &held {
            receiver.hold(*r).unwrap();
        }
        let mut covered = vec![vec![0u8; num_blocks as usize]; groups];
        if early {
            let plan = book.plan_early(&[1]).unwrap();
            for (start, end, _) in cover_groups(&mut covered, &plan, 0..groups)? {
                receiver.claim(range(start, end)).unwrap();
            }
        }
        let all = chunks(s.reused, s.prompt, &s.sizes);
        let mut layered = false;
        for (k, &(cs, ce)) in all.iter().enumerate() {
            if k + 1 == all.len() && rng.chance(50) {
                layered = true;
                let mut order: Vec<usize> = (0..groups).collect();
                for i in (1..order.len()).rev() {
                    order.swap(i, rng.below(i + 1));
                }
                for (n, &g) in order.iter().enumerate() {
                    let before = book.ledger(1).unwrap().clone();
                    let bad = book.plan_layers(&[1], &[cs], &[ce], groups as i64);
                    let named = matches!(bad, Err(CoreError::InvalidArgument { name: "layer_group", .. }));
                    prop_assert!(named, "group out of range gave {:?}", bad);
                    prop_assert_eq!(book.ledger(1).unwrap(), &before);
                    if n > 0 {
                        // Some groups went: a whole-block plan over a partial block is refused.
                        let partial: Vec<u64> = (0..num_blocks)
                            .filter(|&b| {
                                let n = covered.iter().filter(|c| c[b as usize] == 1).count();
                                n > 0 && n < groups
                            })
                            .collect();
                        match book.plan_chunks(&[1], &[cs], &[ce]) {
                            Err(CoreError::DuplicateTransfer { block, .. }) => {
                                prop_assert!(partial.contains(&block), "block {} is not partial", block);
                            }
                            Ok(_) => prop_assert!(partial.is_empty(), "partial blocks {:?} planned", partial),
                            Err(other) => prop_assert!(false, "unexpected {other:?}"),
                        }
                        if partial.is_empty() {
                            // Nothing was partial (the chunk had no sendable block): the
                            // chunk plan was empty and recorded only the forward.
                            prop_assert_eq!(book.ledger(1).unwrap().claimed_blocks(), before.claimed_blocks());
                        } else {
                            prop_assert_eq!(book.ledger(1).unwrap(), &before);
                        }
                    }
                    let plan = book.plan_layers(&[1], &[cs], &[ce], g as i64).unwrap();
                    let rows = cover_groups(&mut covered, &plan, g..g + 1)?;
                    for &(start, end, _) in &rows {
                        let before = receiver.clone();
                        receiver.claim_layer(range(start, end), g as i64, groups as i64).unwrap();
                        prop_assert!(receiver.claim_layer(range(start, end), g as i64, groups as i64).is_err());
                        if groups > 1 && n + 1 < groups {
                            // Partly arrived: a whole-block claim of it is refused.
                            prop_assert!(receiver.claim(range(start, end)).is_err());
                        }
                        prop_assert!(before.claimed_blocks() <= receiver.claimed_blocks());
                    }
                    let lasts: Vec<usize> = rows.iter().enumerate().filter(|(_, r)| r.2).map(|(i, _)| i).collect();
                    prop_assert!(lasts.len() <= 1 && lasts.iter().all(|&i| i + 1 == rows.len()), "last flags {:?}", rows);
                    prop_assert_eq!(lasts.len(), usize::from(!rows.is_empty()));
                    // The same group again sends nothing.
                    prop_assert!(book.plan_layers(&[1], &[cs], &[ce], g as i64).unwrap().is_empty());
                }
            }
            let plan = book.plan_chunks(&[1], &[cs], &[ce]).unwrap();
            if layered {
                prop_assert!(plan.is_empty(), "chunk plan after every group: {:?}", plan);
            }
            for (start, end, _) in cover_groups(&mut covered, &plan, 0..groups)? {
                receiver.claim(range(start, end)).unwrap();
                prop_assert!(receiver.claim_layer(range(start, end), 0, groups as i64).is_err());
            }
        }
        prop_assert!(receiver.is_complete(), "receiver missing {:?}", receiver.missing());
        prop_assert_eq!(receiver.claimed_blocks(), num_blocks);
        for r in &held {
            for b in r.start..r.end {
                for c in &covered {
                    prop_assert_eq!(c[b as usize], 0, "held block {} crossed", b);
                }
            }
        }
        let held_mask: Vec<bool> = (0..num_blocks).map(|b| held.iter().any(|r| r.start <= b && b < r.end)).collect();
        for (g, c) in covered.iter().enumerate() {
            for b in 0..num_blocks as usize {
                prop_assert_eq!(c[b] == 1, !held_mask[b], "group {} block {}", g, b);
            }
        }
        let ledger = book.ledger(1).unwrap();
        prop_assert!(ledger.is_complete());
        prop_assert_eq!(ledger.claimed_blocks(), num_blocks);
        prop_assert!(ledger.forward_started());
    }
}
