//! Token -> block range selection: which blocks leave early and which leave with each chunk.
//!
//! ```text
//! tokens:  |<------ reused R ------>|<-- chunk s..e -->| ... |P
//! blocks:  [0 ....... floor(R/tpb))[boundary][ ... floor(e/tpb)) ... ceil(P/tpb))
//! early:   [0, floor(R/tpb))        first chunk: [floor(R/tpb), end)
//! ```
//! Block `b` holds tokens `[b*tpb, (b+1)*tpb)`. A block cut by a chunk boundary belongs to the
//! chunk that finishes it, so the early slice and the chunk slices tile the prompt exactly once.

use crate::error::{CoreError, Result};
use crate::range::BlockRange;

/// The shape of one request's prompt, validated once. All later arithmetic is infallible.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prompt {
    tokens_per_block: u64,
    prompt_len: u64,
    reused_len: u64,
    /// `Some(w)` only for a sliding window that is shorter than the prompt; a window that
    /// covers the whole prompt is full attention and is normalised to `None`.
    window: Option<u64>,
}

pub(crate) fn check_tokens_per_block(tokens_per_block: i64) -> Result<u64> {
    if tokens_per_block <= 0 {
        return Err(CoreError::invalid(
            "tokens_per_block",
            tokens_per_block,
            "> 0",
        ));
    }
    Ok(tokens_per_block as u64)
}

pub(crate) fn check_reused_len(reused_len: i64) -> Result<u64> {
    if reused_len < 0 {
        return Err(CoreError::invalid("reused_len", reused_len, ">= 0"));
    }
    Ok(reused_len as u64)
}

impl Prompt {
    /// Validates `tokens_per_block > 0`, `prompt_len > 0`, `0 <= reused_len < prompt_len` and
    /// `window > 0`. At least one prompt token is always computed, so `reused_len == prompt_len`
    /// is refused: the last token's forward is what produces the first output.
    pub fn new(
        tokens_per_block: i64,
        prompt_len: i64,
        reused_len: i64,
        window: Option<i64>,
    ) -> Result<Self> {
        let tpb = check_tokens_per_block(tokens_per_block)?;
        if prompt_len <= 0 {
            return Err(CoreError::invalid("prompt_len", prompt_len, "> 0"));
        }
        let reused = check_reused_len(reused_len)?;
        if reused_len >= prompt_len {
            return Err(CoreError::invalid(
                "reused_len",
                reused_len,
                format!("< prompt_len ({prompt_len})"),
            ));
        }
        let window = match window {
            Some(w) if w <= 0 => return Err(CoreError::invalid("window", w, "> 0 or None")),
            Some(w) if w < prompt_len => Some(w as u64),
            _ => None,
        };
        Ok(Self {
            tokens_per_block: tpb,
            prompt_len: prompt_len as u64,
            reused_len: reused,
            window,
        })
    }

    /// Tokens per block.
    pub const fn tokens_per_block(&self) -> u64 {
        self.tokens_per_block
    }

    /// Prompt length in tokens.
    pub const fn prompt_len(&self) -> u64 {
        self.prompt_len
    }

    /// Reused (prepopulated) prompt length in tokens.
    pub const fn reused_len(&self) -> u64 {
        self.reused_len
    }

    /// The sliding window, when it is shorter than the prompt.
    pub const fn window(&self) -> Option<u64> {
        self.window
    }

    /// `ceil(prompt_len / tokens_per_block)`.
    pub const fn num_blocks(&self) -> u64 {
        self.prompt_len.div_ceil(self.tokens_per_block)
    }

    /// The blocks the generation worker needs: all of them under full attention, the live
    /// window under a sliding window.
    ///
    /// ```text
    /// tokens:  |0 .......... P+1-W |<---- W-1 tokens ---->|P
    /// blocks:  [dropped .. floor((P+1-W)/tpb))[ live .. ceil(P/tpb))
    /// ```
    pub const fn needed(&self) -> BlockRange {
        let start = match self.window {
            // The next token at position P attends to [P+1-W, P]; its KV lives in
            // [P+1-W, P), which starts in block floor((P+1-W)/tpb). W < P keeps this positive.
            Some(w) => (self.prompt_len + 1 - w) / self.tokens_per_block,
            None => 0,
        };
        BlockRange::from_bounds(start, self.num_blocks())
    }

    /// The early prefix slice: the complete reused blocks, or `None` when there is not one
    /// complete block or the layer group uses a sliding window (its live window is only known
    /// once the prompt is complete).
    pub const fn early(&self) -> Option<BlockRange> {
        if self.window.is_some() {
            return None;
        }
        BlockRange::from_bounds(0, self.reused_len / self.tokens_per_block).non_empty()
    }

    /// Checks that `[chunk_start, chunk_end)` is a non-empty chunk inside
    /// `[reused_len, prompt_len]`.
    pub fn check_chunk(&self, chunk_start: i64, chunk_end: i64) -> Result<(u64, u64)> {
        let (r, p) = (self.reused_len as i64, self.prompt_len as i64);
        if chunk_start < r || chunk_start >= p {
            return Err(CoreError::invalid(
                "chunk_start",
                chunk_start,
                format!("in [reused_len ({r}), prompt_len ({p}))"),
            ));
        }
        if chunk_end <= chunk_start || chunk_end > p {
            return Err(CoreError::invalid(
                "chunk_end",
                chunk_end,
                format!("in (chunk_start ({chunk_start}), prompt_len ({p})]"),
            ));
        }
        Ok((chunk_start as u64, chunk_end as u64))
    }

    /// The slice a finished prefill chunk sends.
    ///
    /// ```text
    /// tokens:  |<- reused R ->|<-- chunk s..e -->|
    /// first:   s == R          last: e == P
    /// start:   0 if first and the prefix did not leave early, else floor(s/tpb)
    /// end:     ceil(e/tpb) if last, else floor(e/tpb)   (a cut block waits for its finisher)
    /// ```
    /// A non-final chunk whose range is empty sends nothing; the last chunk always sends,
    /// except under a window of one token that ends on a block boundary (no KV is needed).
    pub fn chunk(
        &self,
        chunk_start: i64,
        chunk_end: i64,
        prefix_sent: bool,
    ) -> Result<Option<BlockRange>> {
        let (s, e) = self.check_chunk(chunk_start, chunk_end)?;
        Ok(self.chunk_unchecked(s, e, prefix_sent))
    }

    pub(crate) const fn chunk_unchecked(
        &self,
        s: u64,
        e: u64,
        prefix_sent: bool,
    ) -> Option<BlockRange> {
        let tpb = self.tokens_per_block;
        let last = e == self.prompt_len;
        if self.window.is_some() {
            // Nothing of a windowed group is final before the prompt is: blocks may still
            // slide out of the window.
            // W = 1 on a block boundary needs no prompt KV at all: nothing to send.
            return if last {
                self.needed().non_empty()
            } else {
                None
            };
        }
        let first = s == self.reused_len;
        let start = if first && !prefix_sent { 0 } else { s / tpb };
        let end = if last { e.div_ceil(tpb) } else { e / tpb };
        if end <= start {
            return None;
        }
        Some(BlockRange::from_bounds(start, end))
    }
}

/// The early prefix slice `[0, floor(reused_len / tokens_per_block))`, or `None` when the
/// reused prefix holds no complete block.
pub fn early_prefix_blocks(tokens_per_block: i64, reused_len: i64) -> Result<Option<BlockRange>> {
    let tpb = check_tokens_per_block(tokens_per_block)?;
    let reused = check_reused_len(reused_len)?;
    Ok(BlockRange::from_bounds(0, reused / tpb).non_empty())
}

/// The slice of chunk `[chunk_start, chunk_end)`; see [`Prompt::chunk`].
pub fn chunk_blocks(
    tokens_per_block: i64,
    prompt_len: i64,
    chunk_start: i64,
    chunk_end: i64,
    reused_len: i64,
    prefix_sent: bool,
    window: Option<i64>,
) -> Result<Option<BlockRange>> {
    Prompt::new(tokens_per_block, prompt_len, reused_len, window)?.chunk(
        chunk_start,
        chunk_end,
        prefix_sent,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(clippy::unnecessary_wraps)] // reads like the expected value of a planner call
    fn r(start: u64, end: u64) -> Option<BlockRange> {
        Some(BlockRange::from_bounds(start, end))
    }

    #[test]
    fn chunks_without_reuse_tile_the_prompt() {
        let p = Prompt::new(4, 32, 0, None).unwrap();
        assert_eq!(p.chunk(0, 6, false).unwrap(), r(0, 1));
        assert_eq!(p.chunk(6, 12, false).unwrap(), r(1, 3));
        assert_eq!(p.chunk(12, 32, false).unwrap(), r(3, 8));
    }

    #[test]
    fn first_chunk_starts_at_reuse_boundary_after_early_send() {
        let p = Prompt::new(4, 32, 12, None).unwrap();
        assert_eq!(p.chunk(12, 24, false).unwrap(), r(0, 6));
        assert_eq!(p.chunk(12, 24, true).unwrap(), r(3, 6));
        assert_eq!(p.early(), r(0, 3));
    }

    #[test]
    fn unaligned_reuse_with_chunks() {
        let p = Prompt::new(32, 1000, 700, None).unwrap();
        assert_eq!(p.early(), r(0, 21));
        assert_eq!(p.chunk(700, 828, true).unwrap(), r(21, 25));
        assert_eq!(p.chunk(828, 956, true).unwrap(), r(25, 29));
        assert_eq!(p.chunk(956, 1000, true).unwrap(), r(29, 32));
    }

    #[test]
    fn sliding_window_sends_only_the_live_window_at_the_end() {
        let p = Prompt::new(4, 32, 0, Some(16)).unwrap();
        assert_eq!(p.early(), None);
        assert_eq!(p.chunk(0, 16, false).unwrap(), None);
        assert_eq!(p.chunk(16, 32, false).unwrap(), r(4, 8));
        // A window that covers the prompt is full attention.
        assert_eq!(Prompt::new(4, 32, 0, Some(32)).unwrap().window(), None);
        // W = 1 on a block boundary: no prompt KV is live, so nothing is sent.
        assert_eq!(
            Prompt::new(4, 32, 0, Some(1))
                .unwrap()
                .chunk(0, 32, false)
                .unwrap(),
            None
        );
        assert_eq!(
            Prompt::new(4, 30, 0, Some(1))
                .unwrap()
                .chunk(0, 30, false)
                .unwrap(),
            r(7, 8)
        );
    }

    #[test]
    fn sub_block_prefix_sends_nothing_early() {
        assert_eq!(early_prefix_blocks(32, 31).unwrap(), None);
        assert_eq!(early_prefix_blocks(32, 32).unwrap(), r(0, 1));
    }

    #[test]
    fn bad_arguments_name_themselves() {
        let msg = |e: CoreError| e.to_string();
        assert_eq!(
            msg(Prompt::new(0, 8, 0, None).unwrap_err()),
            "invalid tokens_per_block=0: must be > 0"
        );
        assert!(msg(Prompt::new(4, 8, 8, None).unwrap_err()).starts_with("invalid reused_len=8"));
        assert!(msg(Prompt::new(4, 8, -1, None).unwrap_err()).starts_with("invalid reused_len=-1"));
        assert!(msg(Prompt::new(4, 0, 0, None).unwrap_err()).starts_with("invalid prompt_len=0"));
        assert!(msg(Prompt::new(4, 8, 0, Some(0)).unwrap_err()).starts_with("invalid window=0"));
        let p = Prompt::new(4, 32, 12, None).unwrap();
        assert!(msg(p.chunk(8, 16, false).unwrap_err()).starts_with("invalid chunk_start=8"));
        assert!(msg(p.chunk(12, 12, false).unwrap_err()).starts_with("invalid chunk_end=12"));
        assert!(msg(p.chunk(12, 33, false).unwrap_err()).starts_with("invalid chunk_end=33"));
    }
}
