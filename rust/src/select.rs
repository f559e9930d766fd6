//! Vectorised early-send eligibility over a whole batch, for executors that keep request state
//! in their own arrays rather than in a [`crate::book::TransferBook`].

use crate::error::{CoreError, Result};
use crate::plan::{check_reused_len, check_tokens_per_block};

/// A flag given once for the whole batch or once per request.
#[derive(Debug, Clone, Copy)]
pub enum Flag<'a> {
    /// The same value for every request.
    All(bool),
    /// One value per request.
    PerRequest(&'a [bool]),
}

impl Flag<'_> {
    fn get(&self, i: usize) -> bool {
        match self {
            Flag::All(v) => *v,
            Flag::PerRequest(v) => v[i],
        }
    }
}

/// The per-request inputs of [`select_early`], all of one length.
#[derive(Debug, Clone, Copy)]
pub struct EarlyInputs<'a> {
    /// Reused (prepopulated) prompt length per request, in tokens.
    pub reused_len: &'a [i64],
    /// The request only runs prefill here (disaggregated context phase).
    pub context_only: &'a [bool],
    /// The request was cancelled.
    pub cancelled: &'a [bool],
    /// The request is on its first context chunk: no forward has run yet.
    pub first_chunk: &'a [bool],
    /// Pipelined (chunk-wise) KV transfer is enabled.
    pub pipelined: Flag<'a>,
}

fn check_len(name: &'static str, len: usize, expected: usize) -> Result<()> {
    if len != expected {
        return Err(CoreError::invalid(
            name,
            format!("<array of length {len}>"),
            format!("of length {expected} (the length of reused_len)"),
        ));
    }
    Ok(())
}

/// Positions of the requests eligible for an early send and their early block counts
/// `floor(reused_len / tokens_per_block)`.
///
/// ```text
/// eligible = context_only & !cancelled & first_chunk & pipelined & reused_len >= tpb
/// ```
pub fn select_early(
    tokens_per_block: i64,
    inputs: &EarlyInputs<'_>,
) -> Result<(Vec<i64>, Vec<i64>)> {
    let tpb = check_tokens_per_block(tokens_per_block)?;
    let n = inputs.reused_len.len();
    check_len("context_only", inputs.context_only.len(), n)?;
    check_len("cancelled", inputs.cancelled.len(), n)?;
    check_len("first_chunk", inputs.first_chunk.len(), n)?;
    if let Flag::PerRequest(p) = inputs.pipelined {
        check_len("pipelined", p.len(), n)?;
    }
    if let Some(&bad) = inputs.reused_len.iter().find(|&&r| r < 0) {
        check_reused_len(bad)?;
    }
    let mut indices = Vec::new();
    let mut blocks = Vec::new();
    for (i, &reused) in inputs.reused_len.iter().enumerate() {
        let n_blocks = reused as u64 / tpb;
        let eligible = inputs.context_only[i]
            && !inputs.cancelled[i]
            && inputs.first_chunk[i]
            && inputs.pipelined.get(i)
            && n_blocks > 0;
        if eligible {
            indices.push(i as i64);
            blocks.push(n_blocks as i64);
        }
    }
    Ok((indices, blocks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issue_example() {
        let t = [true; 4];
        let inputs = EarlyInputs {
            reused_len: &[0, 0, 128, 128],
            context_only: &t,
            cancelled: &[false, false, false, true],
            first_chunk: &[false, true, true, true],
            pipelined: Flag::All(true),
        };
        assert_eq!(select_early(32, &inputs).unwrap(), (vec![2], vec![4]));
        let off = EarlyInputs {
            pipelined: Flag::All(false),
            ..inputs
        };
        assert_eq!(select_early(32, &off).unwrap(), (vec![], vec![]));
    }

    #[test]
    fn mismatched_lengths_name_the_argument() {
        let inputs = EarlyInputs {
            reused_len: &[0, 0],
            context_only: &[true],
            cancelled: &[false, false],
            first_chunk: &[true, true],
            pipelined: Flag::All(true),
        };
        let err = select_early(32, &inputs).unwrap_err().to_string();
        assert!(
            err.starts_with("invalid context_only=<array of length 1>"),
            "{err}"
        );
    }
}
