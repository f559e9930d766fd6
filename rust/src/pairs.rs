//! From logical slices to physical block ids: what a copy kernel or a transport consumes.
//!
//! ```text
//! slice k:        request_index[k], blocks [start[k], end[k])
//! block table:    row = request_index[k], column = logical block -> physical block id
//! pairs:          (src_table[row, b], dst_table[row, b]) for b in start..end
//! runs:           maximal stretches where both src and dst ids advance by one
//! ```

use rustc_hash::{FxBuildHasher, FxHashSet};

use crate::book::SlicePlan;
use crate::error::{CoreError, Result};

/// A row-major `(rows, cols)` table of physical block ids, one row per request of the batch.
#[derive(Debug, Clone, Copy)]
pub struct BlockTable<'a> {
    /// The argument name used in error messages.
    pub name: &'static str,
    /// `rows * cols` ids, row-major.
    pub data: &'a [i64],
    /// Number of rows (requests).
    pub rows: usize,
    /// Number of columns (logical blocks per row).
    pub cols: usize,
}

impl<'a> BlockTable<'a> {
    /// Wraps a row-major slice; `data.len()` must be `rows * cols`.
    pub fn new(name: &'static str, data: &'a [i64], rows: usize, cols: usize) -> Result<Self> {
        if rows.checked_mul(cols) != Some(data.len()) {
            return Err(CoreError::invalid(
                name,
                format!("<{} ids>", data.len()),
                format!("a ({rows}, {cols}) table"),
            ));
        }
        Ok(Self {
            name,
            data,
            rows,
            cols,
        })
    }

    fn row(&self, row: usize) -> &'a [i64] {
        &self.data[row * self.cols..(row + 1) * self.cols]
    }
}

/// Per-block physical pairs of a plan; slice `k` owns `src[pair_offsets[k]..pair_offsets[k+1]]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockPairs {
    /// Source physical block ids.
    pub src: Vec<i64>,
    /// Destination physical block ids.
    pub dst: Vec<i64>,
    /// `len + 1` offsets into `src`/`dst`, one span per slice.
    pub offsets: Vec<i64>,
}

/// Coalesced runs of a plan; slice `k` owns runs `offsets[k]..offsets[k+1]`. Runs never
/// cross a slice, so each slice's completion notice maps to its own runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockRuns {
    /// First source block of each run.
    pub src: Vec<i64>,
    /// First destination block of each run.
    pub dst: Vec<i64>,
    /// Blocks in each run.
    pub len: Vec<i64>,
    /// `len + 1` offsets into the run arrays, one span per slice.
    pub offsets: Vec<i64>,
}

/// Checks the tables against the plan and yields each slice's `(src, dst)` id rows.
fn slice_rows<'a>(
    plan: &'a SlicePlan,
    src: BlockTable<'a>,
    dst: BlockTable<'a>,
) -> Result<impl Iterator<Item = (&'a [i64], &'a [i64])> + 'a> {
    for table in [src, dst] {
        if table.rows != plan.num_requests {
            return Err(CoreError::invalid(
                table.name,
                format!("<table with {} rows>", table.rows),
                format!(
                    "one row per request of the planned batch ({})",
                    plan.num_requests
                ),
            ));
        }
        if let Some(k) = (0..plan.len()).find(|&k| plan.end[k] as usize > table.cols) {
            return Err(CoreError::invalid(
                table.name,
                format!("<table with {} columns>", table.cols),
                format!(
                    "wide enough for block {} of request {}",
                    plan.end[k] - 1,
                    plan.request_id[k]
                ),
            ));
        }
    }
    Ok((0..plan.len()).map(move |k| {
        let (row, s, e) = (
            plan.request_index[k] as usize,
            plan.start[k] as usize,
            plan.end[k] as usize,
        );
        (&src.row(row)[s..e], &dst.row(row)[s..e])
    }))
}

/// Refuses negative ids, naming the table, request and logical block.
fn check_ids(plan: &SlicePlan, table: BlockTable<'_>) -> Result<()> {
    for k in 0..plan.len() {
        let row = table.row(plan.request_index[k] as usize);
        let (s, e) = (plan.start[k] as usize, plan.end[k] as usize);
        if let Some(b) = (s..e).find(|&b| row[b] < 0) {
            return Err(CoreError::invalid(
                table.name,
                format!(
                    "<id {} at block {b} of request {}>",
                    row[b], plan.request_id[k]
                ),
                "physical block ids >= 0",
            ));
        }
    }
    Ok(())
}

/// Bitwise OR of all ids: negative exactly when some id is.
fn or_all(ids: &[i64]) -> i64 {
    ids.iter().fold(0, |acc, &x| acc | x)
}

/// The physical `(src, dst)` id of every planned block, in slice order.
pub fn block_pairs(
    plan: &SlicePlan,
    src: BlockTable<'_>,
    dst: BlockTable<'_>,
) -> Result<BlockPairs> {
    let total = plan.total_blocks() as usize;
    let mut out = BlockPairs {
        src: Vec::with_capacity(total),
        dst: Vec::with_capacity(total),
        offsets: Vec::with_capacity(plan.len() + 1),
    };
    out.offsets.push(0);
    // Negative ids are rare: OR-ing every id and testing the sign bit once vectorises on
    // baseline x86-64 (an i64 `min` does not), and the slow path then names the culprit.
    let mut any_bits = 0i64;
    for (s, d) in slice_rows(plan, src, dst)? {
        out.src.extend_from_slice(s);
        out.dst.extend_from_slice(d);
        any_bits |= or_all(s) | or_all(d);
        out.offsets.push(out.src.len() as i64);
    }
    if any_bits < 0 {
        check_ids(plan, src)?;
        check_ids(plan, dst)?;
    }
    Ok(out)
}

/// The planned blocks as maximal runs where both sides are contiguous: the shape that needs
/// the fewest copy descriptors.
pub fn block_runs(plan: &SlicePlan, src: BlockTable<'_>, dst: BlockTable<'_>) -> Result<BlockRuns> {
    // At most one run per block; reserving that up front avoids regrowing three vectors
    // (untouched capacity costs address space, not memory).
    let total = plan.total_blocks() as usize;
    let mut out = BlockRuns {
        src: Vec::with_capacity(total),
        dst: Vec::with_capacity(total),
        len: Vec::with_capacity(total),
        offsets: Vec::with_capacity(plan.len() + 1),
    };
    out.offsets.push(0);
    let mut any_bits = 0i64;
    for (s, d) in slice_rows(plan, src, dst)? {
        any_bits |= or_all(s) | or_all(d);
        let mut i = 0;
        while i < s.len() {
            let mut j = i + 1;
            // `checked_add` so that an id of i64::MAX ends a run instead of wrapping into one.
            while j < s.len()
                && s[j - 1].checked_add(1) == Some(s[j])
                && d[j - 1].checked_add(1) == Some(d[j])
            {
                j += 1;
            }
            out.src.push(s[i]);
            out.dst.push(d[i]);
            out.len.push((j - i) as i64);
            i = j;
        }
        out.offsets.push(out.src.len() as i64);
    }
    if any_bits < 0 {
        check_ids(plan, src)?;
        check_ids(plan, dst)?;
    }
    Ok(out)
}

/// The first destination id that appears twice, in `dst` order. Ids are in `[0, pool)`, so
/// `lo..=hi` below is non-empty and cannot overflow.
///
/// ```text
/// ids:     3 9 4 9        span [lo, hi] = [3, 9]: 7 bits, at most 64 per id plus a KiB
/// dense:   one bit per id of the span, set as ids are seen: O(n), no hashing
/// sparse:  a hash set of the ids seen (the span would dwarf the ids)
/// ```
/// The bitmap is sized by the ids, never by the pool: sized by `dst_blocks`, a pool of 2^54
/// blocks asked for petabytes and aborted the process, which no panic fence can catch.
fn first_repeat(dst: &[i64]) -> Option<i64> {
    let (Some(&lo), Some(&hi)) = (dst.iter().min(), dst.iter().max()) else {
        return None;
    };
    let span = (hi - lo) as u64 + 1;
    if span <= 64 * (dst.len() as u64 + 128) {
        let mut seen = crate::bitmap::Bitmap::new(span);
        dst.iter().copied().find(|&b| {
            let bit = (b - lo) as u64;
            let repeat = seen.get(bit);
            seen.set_range(bit, bit + 1);
            repeat
        })
    } else {
        let mut seen = FxHashSet::with_capacity_and_hasher(dst.len(), FxBuildHasher);
        dst.iter().copied().find(|&b| !seen.insert(b))
    }
}

/// Refuses a negative pool size: a length computed wrongly upstream, not an empty pool.
fn check_pool_blocks(name: &'static str, blocks: i64) -> Result<()> {
    if blocks < 0 {
        return Err(CoreError::invalid(name, blocks, ">= 0"));
    }
    Ok(())
}

/// Validates a copy's block ids and packs them as one row-major `(2, n)` array (sources,
/// then destinations): every id inside its pool, as many sources as destinations, and no
/// destination written twice.
pub fn pack_pairs(src: &[i64], dst: &[i64], src_blocks: i64, dst_blocks: i64) -> Result<Vec<i64>> {
    check_pool_blocks("src_blocks", src_blocks)?;
    check_pool_blocks("dst_blocks", dst_blocks)?;
    if dst.len() != src.len() {
        return Err(CoreError::invalid(
            "dst_ids",
            format!("<{} ids>", dst.len()),
            format!("as many as src_ids ({})", src.len()),
        ));
    }
    for (name, ids, blocks) in [("src_ids", src, src_blocks), ("dst_ids", dst, dst_blocks)] {
        if let Some(&bad) = ids.iter().find(|&&b| b < 0 || b >= blocks) {
            return Err(CoreError::invalid(
                name,
                format!("<block id {bad}>"),
                format!("in [0, {blocks})"),
            ));
        }
    }
    if let Some(b) = first_repeat(dst) {
        return Err(CoreError::invalid(
            "dst_ids",
            format!("<block {b} twice>"),
            "each destination written once",
        ));
    }
    let mut out = Vec::with_capacity(2 * src.len());
    out.extend_from_slice(src);
    out.extend_from_slice(dst);
    Ok(out)
}

/// The request id and logical block of pair `j` of a plan's pairs.
fn locate(plan: &SlicePlan, pairs: &BlockPairs, j: usize) -> (i64, i64) {
    let k = pairs.offsets.partition_point(|&o| o <= j as i64) - 1;
    (
        plan.request_id[k],
        plan.start[k] + (j as i64 - pairs.offsets[k]),
    )
}

/// Refuses a plan's pairs that a copy would refuse: an id outside its pool (`src_blocks`,
/// `dst_blocks` blocks; `None` skips that side) or a destination planned twice. Checked
/// before the plan is committed, so a bad table never leaves blocks claimed that cannot
/// leave. Ids are `>= 0` here ([`block_pairs`] refused negative ones).
pub fn check_pools(
    plan: &SlicePlan,
    pairs: &BlockPairs,
    src_blocks: Option<i64>,
    dst_blocks: Option<i64>,
) -> Result<()> {
    let sides = [
        ("src_block_table", "src_blocks", &pairs.src, src_blocks),
        ("dst_block_table", "dst_blocks", &pairs.dst, dst_blocks),
    ];
    for (table, bound, ids, blocks) in sides {
        let Some(blocks) = blocks else { continue };
        check_pool_blocks(bound, blocks)?;
        if let Some(j) = ids.iter().position(|&b| b >= blocks) {
            let (request, block) = locate(plan, pairs, j);
            return Err(CoreError::invalid(
                table,
                format!("<id {} at block {block} of request {request}>", ids[j]),
                format!("in [0, {bound}={blocks})"),
            ));
        }
    }
    if dst_blocks.is_some() {
        if let Some(id) = first_repeat(&pairs.dst) {
            // The error path only: find both places the id was planned, to name them.
            let mut at = pairs.dst.iter().enumerate().filter(|&(_, &b)| b == id);
            let (first, second) = (at.next().map_or(0, |p| p.0), at.next().map_or(0, |p| p.0));
            let (r1, b1) = locate(plan, pairs, first);
            let (r2, b2) = locate(plan, pairs, second);
            return Err(CoreError::invalid(
                "dst_block_table",
                format!("<id {id} at block {b1} of request {r1} and block {b2} of request {r2}>"),
                "each destination written once per plan",
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> SlicePlan {
        SlicePlan {
            num_requests: 2,
            request_index: vec![1, 0],
            request_id: vec![11, 10],
            start: vec![0, 2],
            end: vec![3, 4],
            last: vec![false, true],
        }
    }

    #[test]
    fn pairs_and_runs() {
        let src = [100, 101, 102, 103, 5, 6, 9, 7];
        let dst = [0, 1, 2, 3, 40, 41, 42, 50];
        let (s, d) = (
            BlockTable::new("src", &src, 2, 4).unwrap(),
            BlockTable::new("dst", &dst, 2, 4).unwrap(),
        );
        let pairs = block_pairs(&plan(), s, d).unwrap();
        assert_eq!(pairs.src, vec![5, 6, 9, 102, 103]);
        assert_eq!(pairs.dst, vec![40, 41, 42, 2, 3]);
        assert_eq!(pairs.offsets, vec![0, 3, 5]);
        let runs = block_runs(&plan(), s, d).unwrap();
        assert_eq!(runs.src, vec![5, 9, 102]);
        assert_eq!(runs.dst, vec![40, 42, 2]);
        assert_eq!(runs.len, vec![2, 1, 2]);
        assert_eq!(runs.offsets, vec![0, 2, 3]);
    }

    #[test]
    fn pack_pairs_checks_and_packs() {
        assert_eq!(
            pack_pairs(&[3, 0], &[1, 2], 4, 3).unwrap(),
            vec![3, 0, 1, 2]
        );
        let msg = |e: CoreError| e.to_string();
        assert!(msg(pack_pairs(&[0, 1], &[0], 4, 4).unwrap_err())
            .starts_with("invalid dst_ids=<1 ids>"));
        assert!(msg(pack_pairs(&[4], &[0], 4, 4).unwrap_err())
            .starts_with("invalid src_ids=<block id 4>"));
        assert!(msg(pack_pairs(&[0], &[-1], 4, 4).unwrap_err())
            .starts_with("invalid dst_ids=<block id -1>"));
        assert!(msg(pack_pairs(&[0, 1], &[2, 2], 4, 4).unwrap_err())
            .starts_with("invalid dst_ids=<block 2 twice>"));
        assert!(pack_pairs(&[], &[], 0, 0).unwrap().is_empty());
        assert!(msg(pack_pairs(&[], &[], -1, 0).unwrap_err()).starts_with("invalid src_blocks=-1"));
    }

    #[test]
    fn check_pools_names_request_and_block() {
        let src = [100, 101, 102, 103, 5, 6, 9, 7];
        let dst = [0, 1, 2, 3, 40, 41, 3, 50];
        let (s, d) = (
            BlockTable::new("src_block_table", &src, 2, 4).unwrap(),
            BlockTable::new("dst_block_table", &dst, 2, 4).unwrap(),
        );
        let plan = plan();
        let pairs = block_pairs(&plan, s, d).unwrap();
        check_pools(&plan, &pairs, None, None).unwrap();
        let err = check_pools(&plan, &pairs, Some(100), None)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("invalid src_block_table=<id 102 at block 2 of request 10>"),
            "{err}"
        );
        let err = check_pools(&plan, &pairs, None, Some(64))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("<id 3 at block 2 of request 11 and block 3 of request 10>"),
            "{err}"
        );
        let err = check_pools(&plan, &pairs, None, Some(-2))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("invalid dst_blocks=-2"), "{err}");
    }

    #[test]
    fn pack_pairs_memory_follows_the_ids_not_the_pool() {
        // Found by the `book` fuzz target: the duplicate check allocated one bit per block of
        // the declared pool, so a huge pool aborted the process on allocation failure.
        assert!(pack_pairs(&[], &[], 1, i64::MAX).unwrap().is_empty());
        let top = i64::MAX - 1;
        assert_eq!(
            pack_pairs(&[0, 1], &[top, 1 << 50], 2, i64::MAX).unwrap(),
            vec![0, 1, top, 1 << 50]
        );
        let err = pack_pairs(&[0, 1, 0], &[7, top, top], 2, i64::MAX).unwrap_err();
        assert!(err
            .to_string()
            .starts_with(&format!("invalid dst_ids=<block {top} twice>")));
        // Dense ids far from 0 take the bitmap path; the first repeat in order is named.
        let err = pack_pairs(&[0, 0, 0, 0], &[900, 905, 901, 905], 1, 1000).unwrap_err();
        assert!(err
            .to_string()
            .starts_with("invalid dst_ids=<block 905 twice>"));
    }

    #[test]
    fn bad_tables_are_named() {
        let ids = [0i64; 6];
        let narrow = BlockTable::new("dst_block_table", &ids, 2, 3).unwrap();
        let wide = [0i64; 8];
        let ok = BlockTable::new("src_block_table", &wide, 2, 4).unwrap();
        let err = block_pairs(&plan(), ok, narrow).unwrap_err().to_string();
        assert!(
            err.starts_with("invalid dst_block_table=<table with 3 columns>"),
            "{err}"
        );
        let mut neg = [1i64; 8];
        neg[6] = -1;
        let neg = BlockTable::new("src_block_table", &neg, 2, 4).unwrap();
        let err = block_runs(&plan(), neg, ok).unwrap_err().to_string();
        assert!(err.contains("<id -1 at block 2 of request 11>"), "{err}");
        assert!(BlockTable::new("x", &wide, 3, 3).is_err());
    }
}
