//! From logical slices to physical block ids: what a copy kernel or a transport consumes.
//!
//! ```text
//! slice k:        request_index[k], blocks [start[k], end[k])
//! block table:    row = request_index[k], column = logical block -> physical block id
//! pairs:          (src_table[row, b], dst_table[row, b]) for b in start..end
//! runs:           maximal stretches where both src and dst ids advance by one
//! ```

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

/// Validates a copy's block ids and packs them as one row-major `(2, n)` array (sources,
/// then destinations): every id inside its pool, as many sources as destinations, and no
/// destination written twice (one bit per destination block finds repeats in O(n)).
pub fn pack_pairs(src: &[i64], dst: &[i64], src_blocks: i64, dst_blocks: i64) -> Result<Vec<i64>> {
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
    let mut seen = crate::bitmap::Bitmap::new(dst_blocks.max(0) as u64);
    for &b in dst {
        let b = b as u64;
        if seen.get(b) {
            return Err(CoreError::invalid(
                "dst_ids",
                format!("<block {b} twice>"),
                "each destination written once",
            ));
        }
        seen.set_range(b, b + 1);
    }
    let mut out = Vec::with_capacity(2 * src.len());
    out.extend_from_slice(src);
    out.extend_from_slice(dst);
    Ok(out)
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
