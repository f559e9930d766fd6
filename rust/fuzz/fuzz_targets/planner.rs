//! Fuzzes the one-request planner (`Prompt::{new, needed, early, chunk}`, `chunk_blocks`,
//! `early_prefix_blocks`) and the vectorised `select_early` against the oracle of
//! `kvferry_fuzz`, on any integers.
//!
//! Invariants: no panic; a call succeeds exactly when its arguments are in their documented
//! domain, else it is refused naming the first bad one; every slice is the oracle's; a
//! chunking of `[R, P)`, after the early slice when one left, tiles the needed blocks exactly
//! once and in order, and no non-final slice holds a block its chunk did not finish.

#![no_main]

use arbitrary::Arbitrary;
use kvferry::{chunk_blocks, early_prefix_blocks, select_early, EarlyInputs, Flag, Prompt};
use kvferry_fuzz::{check_refusal, span, Int, Refusal, Reused, Shape};
use libfuzzer_sys::fuzz_target;

/// Chunkings longer than this skip the tiling check: a one-token chunk size over a long prompt
/// would otherwise spend seconds on one input.
const MAX_CHUNKS: usize = 4096;

#[derive(Arbitrary, Debug)]
struct Input {
    tpb: Int,
    prompt_len: Int,
    reused: Reused,
    window: Option<Int>,
    prefix_sent: bool,
    /// Chunk sizes, cycled through to cover `[R, P)`; none means one chunk.
    sizes: Vec<Int>,
    /// Chunks with any bounds, mostly refused.
    raw_chunks: Vec<(Int, Int)>,
    select: Select,
}

/// A `select_early` batch.
#[derive(Arbitrary, Debug)]
struct Select {
    /// (`reused_len`, `context_only`, `cancelled`, `first_chunk`, `pipelined`) per request.
    rows: Vec<(Int, bool, bool, bool, bool)>,
    /// `Some(flag)`: one `pipelined` flag for the whole batch.
    pipelined_all: Option<bool>,
    /// Drops the last element of one of the flag arrays (0..4), to be refused.
    shorten: Option<u8>,
}

fuzz_target!(|input: Input| {
    let tpb = input.tpb.get();
    let prompt_len = input.prompt_len.get();
    let reused = input.reused.get(prompt_len);
    let window = input.window.map(Int::get);
    check_early_prefix(tpb, reused);
    check_select_early(tpb, &input.select);

    let got = Prompt::new(tpb, prompt_len, reused, window);
    let shape = match (got, Shape::new(tpb, prompt_len, reused, window)) {
        (Ok(prompt), Ok(shape)) => {
            check_prompt(&prompt, &shape);
            Some((prompt, shape))
        }
        (Err(err), Err(name)) => {
            check_refusal(&err, &Refusal::Invalid(name, None));
            None
        }
        (got, want) => panic!("Prompt::new: got {got:?}, expected {want:?}"),
    };
    for &(s, e) in &input.raw_chunks {
        let (s, e) = (s.get(), e.get());
        let got = chunk_blocks(tpb, prompt_len, s, e, reused, input.prefix_sent, window);
        let Some((prompt, shape)) = &shape else {
            assert!(got.is_err(), "chunk of an invalid prompt: {got:?}");
            continue;
        };
        assert_eq!(got, prompt.chunk(s, e, input.prefix_sent));
        match (got, shape.chunk_error(s, e)) {
            (Ok(slice), None) => assert_eq!(
                slice.map(span),
                shape.chunk(s, e, input.prefix_sent),
                "chunk [{s}, {e})"
            ),
            (Err(err), Some(name)) => check_refusal(&err, &Refusal::Invalid(name, None)),
            (got, want) => panic!("chunk [{s}, {e}): got {got:?}, refusal expected: {want:?}"),
        }
    }
    if let Some((prompt, shape)) = &shape {
        // `prefix_sent` can only be true once an early slice left.
        let prefix_sent = input.prefix_sent && shape.early().is_some();
        check_tiling(prompt, shape, &input.sizes, prefix_sent);
    }
});

fn check_prompt(prompt: &Prompt, shape: &Shape) {
    assert_eq!(prompt.num_blocks(), shape.num_blocks());
    assert_eq!(span(prompt.needed()), shape.needed());
    assert_eq!(prompt.early().map(span), shape.early());
    assert_eq!(prompt.window().is_some(), shape.windowed());
    let (start, end) = shape.needed();
    assert!(start <= end && end == shape.num_blocks(), "{shape:?}");
}

fn check_early_prefix(tpb: i64, reused: i64) {
    let want = if tpb <= 0 {
        Err("tokens_per_block")
    } else if reused < 0 {
        Err("reused_len")
    } else {
        let end = (reused / tpb) as u64;
        Ok((end > 0).then_some((0, end)))
    };
    match (early_prefix_blocks(tpb, reused), want) {
        (Ok(got), Ok(want)) => assert_eq!(got.map(span), want),
        (Err(err), Err(name)) => check_refusal(&err, &Refusal::Invalid(name, None)),
        (got, want) => panic!("early_prefix_blocks({tpb}, {reused}): {got:?}, expected {want:?}"),
    }
}

/// Chunks `[R, P)` by cycling through `sizes` and checks that the slices, after the early
/// one, tile the needed blocks exactly once in order.
fn check_tiling(prompt: &Prompt, shape: &Shape, sizes: &[Int], prefix_sent: bool) {
    let (reused, prompt_len) = (shape.reused_len(), shape.prompt_len());
    let mut slices: Vec<(u64, u64)> = shape.early().filter(|_| prefix_sent).into_iter().collect();
    let mut start = reused;
    let mut k = 0;
    while start < prompt_len {
        if k == MAX_CHUNKS {
            return;
        }
        let size = sizes
            .get(k % sizes.len().max(1))
            .map_or(prompt_len - start, |n| n.get().max(1));
        let end = start.saturating_add(size).min(prompt_len);
        let got = prompt.chunk(start, end, prefix_sent).map(|s| s.map(span));
        assert_eq!(
            got,
            Ok(shape.chunk(start, end, prefix_sent)),
            "chunk [{start}, {end})"
        );
        if let Ok(Some((block_start, block_end))) = got {
            if end < prompt_len {
                let finished = u128::from(block_end) * u128::from(prompt.tokens_per_block());
                assert!(
                    finished <= end as u128,
                    "chunk [{start}, {end}) sends an unfinished block"
                );
            }
            slices.push((block_start, block_end));
        }
        start = end;
        k += 1;
    }
    let (first, last) = shape.needed();
    let mut at = first;
    for (s, e) in slices {
        assert!(
            s == at && s < e,
            "slice [{s}, {e}) after block {at}: a gap or an overlap"
        );
        at = e;
    }
    assert_eq!(
        at, last,
        "the slices stop at block {at}, the prompt needs up to {last}"
    );
}

fn check_select_early(tpb: i64, select: &Select) {
    let n = select.rows.len();
    let column = |f: fn(&(Int, bool, bool, bool, bool)) -> bool, k: u8| -> Vec<bool> {
        let mut v: Vec<bool> = select.rows.iter().map(f).collect();
        if select.shorten.map(|s| s % 4) == Some(k) {
            v.pop();
        }
        v
    };
    let reused: Vec<i64> = select.rows.iter().map(|r| r.0.get()).collect();
    let (context_only, cancelled) = (column(|r| r.1, 0), column(|r| r.2, 1));
    let (first_chunk, pipelined) = (column(|r| r.3, 2), column(|r| r.4, 3));
    let inputs = EarlyInputs {
        reused_len: &reused,
        context_only: &context_only,
        cancelled: &cancelled,
        first_chunk: &first_chunk,
        pipelined: select
            .pipelined_all
            .map_or(Flag::PerRequest(&pipelined), Flag::All),
    };
    let short = [
        ("context_only", context_only.len()),
        ("cancelled", cancelled.len()),
        ("first_chunk", first_chunk.len()),
        (
            "pipelined",
            if select.pipelined_all.is_some() {
                n
            } else {
                pipelined.len()
            },
        ),
    ]
    .into_iter()
    .find(|&(_, len)| len != n);
    let want = if tpb <= 0 {
        Err("tokens_per_block")
    } else if let Some((name, _)) = short {
        Err(name)
    } else if reused.iter().any(|&r| r < 0) {
        Err("reused_len")
    } else {
        let eligible = (0..n).filter(|&i| {
            let pipelined = select.pipelined_all.unwrap_or_else(|| pipelined[i]);
            context_only[i] && !cancelled[i] && first_chunk[i] && pipelined && reused[i] >= tpb
        });
        Ok(eligible.map(|i| (i as i64, reused[i] / tpb)).unzip())
    };
    match (select_early(tpb, &inputs), want) {
        (Ok(got), Ok(want)) => assert_eq!(got, want),
        (Err(err), Err(name)) => check_refusal(&err, &Refusal::Invalid(name, None)),
        (got, want) => panic!("select_early: got {got:?}, expected {want:?}"),
    }
}
