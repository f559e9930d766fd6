//! Criterion benches of the pure planning core (no Python in the loop).
//!
//! The workload is the issue's scheduler step: 256 requests with 32k-token prompts at 32 tokens
//! per block (1024 blocks each). Half of them are about to run their first forward and leave a
//! 32000-token reused prefix early (1000 complete blocks); the other half finished a prefill
//! chunk and send the blocks it completed.
//!
//! ```text
//! early half:  |<------------ reused 32000 ------------>|<- 768 ->|P=32768
//!              [0 ........ 1000) leaves early           chunk later
//! chunk half:  |<-- reused 16384 -->|<- chunk 2048 ->| ....... |P=32768
//!                                   [512 ........ 576) leaves with the chunk
//! ```
//! Run with `cargo bench --bench planner`; figures go to docs/benchmarks.md.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvferry::{block_pairs, block_runs, BlockTable, Prompt, RequestSpec, SlicePlan, TransferBook};

const TOKENS_PER_BLOCK: i64 = 32;
const PROMPT: i64 = 32 * 1024;
const REQUESTS: usize = 256;
/// Reused prefix of the early half: 1000 complete blocks.
const EARLY_REUSED: i64 = 32_000;
/// Reused prefix and chunk of the chunk half.
const CHUNK_REUSED: i64 = 16_384;
const CHUNK: i64 = 2048;
const COLS: usize = (PROMPT / TOKENS_PER_BLOCK) as usize;

fn spec(reused_len: i64) -> RequestSpec {
    RequestSpec {
        prompt_len: PROMPT,
        reused_len,
        window: None,
        context_only: true,
    }
}

/// A book holding the 256 requests of one step: even ids leave early, odd ids finish a chunk.
/// Returns the book, the early ids and the chunk ids.
fn step_book() -> (TransferBook, Vec<i64>, Vec<i64>) {
    let mut book = TransferBook::new(TOKENS_PER_BLOCK, true).expect("valid tpb");
    let (mut early, mut chunk) = (Vec::new(), Vec::new());
    for id in 0..REQUESTS as i64 {
        if id % 2 == 0 {
            book.add(id, spec(EARLY_REUSED)).expect("fresh id");
            early.push(id);
        } else {
            book.add(id, spec(CHUNK_REUSED)).expect("fresh id");
            chunk.push(id);
        }
    }
    (book, early, chunk)
}

fn bench_prompt_chunk(c: &mut Criterion) {
    let prompt = Prompt::new(TOKENS_PER_BLOCK, PROMPT, 20_000, None).expect("valid prompt");
    c.bench_function("prompt_chunk/one_request", |b| {
        b.iter(|| {
            prompt.chunk(
                black_box(20_000 + 2048),
                black_box(20_000 + 4096),
                black_box(true),
            )
        });
    });
}

fn bench_book_step(c: &mut Criterion) {
    let (book, early_ids, chunk_ids) = step_book();
    let starts = vec![CHUNK_REUSED; chunk_ids.len()];
    let ends = vec![CHUNK_REUSED + CHUNK; chunk_ids.len()];
    let all_ids: Vec<i64> = (0..REQUESTS as i64).collect();
    let all_starts: Vec<i64> = all_ids
        .iter()
        .map(|id| {
            if id % 2 == 0 {
                EARLY_REUSED
            } else {
                CHUNK_REUSED
            }
        })
        .collect();
    let all_ends: Vec<i64> = all_starts.iter().map(|s| (s + CHUNK).min(PROMPT)).collect();

    let mut group = c.benchmark_group("book_step_256");
    group.throughput(Throughput::Elements(REQUESTS as u64));
    // A fresh clone per batch: every claim is a first claim, so nothing errors. The clone is
    // setup (untimed); the book is returned so its drop is untimed too.
    group.bench_function("mixed_early_and_chunks", |b| {
        b.iter_batched(
            || book.clone(),
            |mut book| {
                let early = book.plan_early(black_box(&early_ids)).expect("plannable");
                let chunks = book
                    .plan_chunks(black_box(&chunk_ids), &starts, &ends)
                    .expect("plannable");
                (early, chunks, book)
            },
            BatchSize::SmallInput,
        );
    });
    group.bench_function("plan_early_all", |b| {
        b.iter_batched(
            || book.clone(),
            |mut book| {
                let plan = book.plan_early(black_box(&all_ids)).expect("plannable");
                (plan, book)
            },
            BatchSize::SmallInput,
        );
    });
    group.bench_function("plan_chunks_all", |b| {
        b.iter_batched(
            || book.clone(),
            |mut book| {
                let plan = book
                    .plan_chunks(black_box(&all_ids), &all_starts, &all_ends)
                    .expect("plannable");
                (plan, book)
            },
            BatchSize::SmallInput,
        );
    });
    group.finish();
}

/// A permutation of `0..n` from a fixed seed (xorshift64* + Fisher-Yates): the block ids of a
/// fragmented pool, with no contiguous runs to coalesce.
fn permutation(n: usize, mut seed: u64) -> Vec<i64> {
    let mut ids: Vec<i64> = (0..n as i64).collect();
    for i in (1..n).rev() {
        seed ^= seed >> 12;
        seed ^= seed << 25;
        seed ^= seed >> 27;
        let r = seed.wrapping_mul(0x2545_F491_4F6C_DD1D);
        ids.swap(i, (r % (i as u64 + 1)) as usize);
    }
    ids
}

/// The early plan of 256 requests with a 32k-token reused prefix: 1000 blocks each.
fn early_plan() -> SlicePlan {
    let mut book = TransferBook::new(TOKENS_PER_BLOCK, true).expect("valid tpb");
    let ids: Vec<i64> = (0..REQUESTS as i64).collect();
    for &id in &ids {
        book.add(id, spec(EARLY_REUSED)).expect("fresh id");
    }
    let plan = book.plan_early(&ids).expect("plannable");
    assert_eq!(plan.total_blocks(), REQUESTS as u64 * 1000);
    plan
}

fn bench_pairs(c: &mut Criterion) {
    let plan = early_plan();
    let n = REQUESTS * COLS;
    let tables = [
        (
            "random",
            permutation(n, 0x9E37_79B9_7F4A_7C15),
            permutation(n, 0xD1B5_4A32_D192_ED03),
        ),
        (
            "contiguous",
            (0..n as i64).collect(),
            (0..n as i64).map(|i| i + n as i64).collect(),
        ),
    ];
    let mut group = c.benchmark_group("pairs_256x1000");
    group.throughput(Throughput::Elements(plan.total_blocks()));
    for (layout, src, dst) in &tables {
        let src = BlockTable::new("src_block_table", src, REQUESTS, COLS).expect("shape");
        let dst = BlockTable::new("dst_block_table", dst, REQUESTS, COLS).expect("shape");
        group.bench_function(format!("block_pairs/{layout}"), |b| {
            b.iter(|| block_pairs(black_box(&plan), src, dst).expect("valid ids"));
        });
        group.bench_function(format!("block_runs/{layout}"), |b| {
            b.iter(|| block_runs(black_box(&plan), src, dst).expect("valid ids"));
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    // Short measurement so the whole suite finishes in about a minute.
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = bench_prompt_chunk, bench_book_step, bench_pairs
}
criterion_main!(benches);
