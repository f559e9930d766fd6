//! The oracle of physical block ids: block tables in a paged pool's shape, the refusal a plan
//! is owed by `block_pairs` and `pairs::check_pools`, and checks of pairs, runs and
//! `pack_pairs` against the tables they came from.
//!
//! ```text
//! slice k:  request_index[k], blocks [start[k], end[k])
//! table:    row request_index[k], column b -> physical id
//! pairs:    (src[row, b], dst[row, b]) for b in start..end, slice after slice
//! runs:     maximal stretches where both ids advance by one, never across a slice
//! ```

use std::collections::BTreeSet;

use kvferry::{block_runs, pack_pairs, BlockPairs, BlockTable, SlicePlan};

use crate::{check_refusal, Refusal};

/// `n` physical ids in stretches of consecutive ones separated by gaps (backwards too, and
/// into negative ids), from a base near 0 or near `i64::MAX`: a paged pool's shape, with runs
/// of every length and the top of the id space.
pub fn pool_ids(n: usize, seed: u64) -> Vec<i64> {
    let run = 1 + (seed % 7) as usize;
    let gap = ((seed >> 3) % 5) as i64 - 2;
    let base = if seed >> 63 == 1 {
        i64::MAX - 3 * n as i64
    } else {
        ((seed >> 8) % 1000) as i64
    };
    (0..n)
        .map(|i| base + i as i64 + gap * (i / run) as i64)
        .collect()
}

/// The ids a table holds for the planned blocks, in slice order.
pub fn planned_ids<'a>(
    plan: &'a SlicePlan,
    t: &'a BlockTable<'a>,
) -> impl Iterator<Item = i64> + 'a {
    (0..plan.len()).flat_map(move |k| {
        let row = plan.request_index[k] as usize * t.cols;
        t.data[row + plan.start[k] as usize..row + plan.end[k] as usize]
            .iter()
            .copied()
    })
}

/// The refusal owed to a plan whose tables cannot serve it (`block_pairs`: shape, negative
/// ids) or whose ids do not fit the pools given (`check_pools`: size, range, a destination
/// planned twice).
pub fn table_refusal(
    plan: &SlicePlan,
    (src, dst): (BlockTable<'_>, BlockTable<'_>),
    pools: (Option<i64>, Option<i64>),
) -> Option<Refusal> {
    let narrow = |t: &BlockTable<'_>| plan.end.iter().any(|&e| e as usize > t.cols);
    let bad = [src, dst]
        .into_iter()
        .find(|t| t.rows != plan.num_requests || narrow(t))
        .or_else(|| {
            [src, dst]
                .into_iter()
                .find(|t| planned_ids(plan, t).any(|id| id < 0))
        });
    if let Some(t) = bad {
        return Some(Refusal::Invalid(t.name, None));
    }
    for (t, bound, blocks) in [(src, "src_blocks", pools.0), (dst, "dst_blocks", pools.1)] {
        let Some(blocks) = blocks else { continue };
        if blocks < 0 {
            return Some(Refusal::Invalid(bound, None));
        }
        if planned_ids(plan, &t).any(|id| id >= blocks) {
            return Some(Refusal::Invalid(t.name, None));
        }
    }
    let mut written = BTreeSet::new();
    let twice = pools.1.is_some() && !planned_ids(plan, &dst).all(|id| written.insert(id));
    twice.then_some(Refusal::Invalid(dst.name, None))
}

/// Pairs are the tables' ids of exactly the planned blocks, slice by slice; runs expand to
/// the pairs without crossing a slice, and are maximal.
pub fn check_pairs(plan: &SlicePlan, pairs: &BlockPairs, src: BlockTable<'_>, dst: BlockTable<'_>) {
    let runs = block_runs(plan, src, dst).expect("runs of a plan whose pairs were emitted");
    assert_eq!(pairs.offsets.len(), plan.len() + 1);
    assert_eq!(runs.offsets.len(), plan.len() + 1);
    assert_eq!(
        pairs.offsets.last().map(|&o| o as usize),
        Some(pairs.src.len())
    );
    let mut at = 0;
    for k in 0..plan.len() {
        let row = plan.request_index[k] as usize * src.cols;
        let blocks = row + plan.start[k] as usize..row + plan.end[k] as usize;
        let (p0, p1) = (pairs.offsets[k] as usize, pairs.offsets[k + 1] as usize);
        assert_eq!(
            (p0, &pairs.src[p0..p1]),
            (at, &src.data[blocks.clone()]),
            "slice {k}"
        );
        assert_eq!(&pairs.dst[p0..p1], &dst.data[blocks], "slice {k}");
        for r in runs.offsets[k] as usize..runs.offsets[k + 1] as usize {
            let len = runs.len[r];
            assert!(
                len > 0 && at + len as usize <= p1,
                "run {r} of slice {k}: {len} blocks"
            );
            for i in 0..len {
                let pair = (pairs.src[at], pairs.dst[at]);
                let expanded = (runs.src[r].checked_add(i), runs.dst[r].checked_add(i));
                assert_eq!((Some(pair.0), Some(pair.1)), expanded, "run {r}, block {i}");
                at += 1;
            }
            let joinable = at < p1
                && pairs.src[at - 1].checked_add(1) == Some(pairs.src[at])
                && pairs.dst[at - 1].checked_add(1) == Some(pairs.dst[at]);
            assert!(!joinable, "run {r} of slice {k} stops inside a run");
        }
        assert_eq!(at, p1, "the runs of slice {k} stop short");
    }
}

/// `pack_pairs` against its contract: pool sizes `>= 0`, equal lengths, ids inside their
/// pools, no destination twice; packed as sources then destinations.
pub fn check_pack(src: &[i64], dst: &[i64], src_blocks: i64, dst_blocks: i64) {
    let outside = |ids: &[i64], blocks: i64| ids.iter().any(|&b| b < 0 || b >= blocks);
    let mut written = BTreeSet::new();
    let want = if src_blocks < 0 {
        Err("src_blocks")
    } else if dst_blocks < 0 {
        Err("dst_blocks")
    } else if src.len() != dst.len() {
        Err("dst_ids")
    } else if outside(src, src_blocks) {
        Err("src_ids")
    } else if outside(dst, dst_blocks) || !dst.iter().all(|&b| written.insert(b)) {
        Err("dst_ids")
    } else {
        Ok([src, dst].concat())
    };
    match (pack_pairs(src, dst, src_blocks, dst_blocks), want) {
        (Ok(got), Ok(want)) => assert_eq!(got, want),
        (Err(err), Err(name)) => check_refusal(&err, &Refusal::Invalid(name, None)),
        (got, want) => panic!(
            "pack_pairs({src:?}, {dst:?}, {src_blocks}, {dst_blocks}): {got:?}, expected {want:?}"
        ),
    }
}
