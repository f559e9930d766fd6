//! A fixed-size bitset with range operations, one bit per KV block.

/// One bit per block; range operations touch whole 64-bit words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bitmap {
    words: Vec<u64>,
    len: u64,
}

/// The mask of bits `[lo, hi)` inside one word, `0 <= lo < hi <= 64`.
const fn word_mask(lo: u64, hi: u64) -> u64 {
    let upper = if hi == 64 { u64::MAX } else { (1u64 << hi) - 1 };
    upper & !((1u64 << lo) - 1)
}

impl Bitmap {
    /// All-clear bitmap of `len` bits.
    pub fn new(len: u64) -> Self {
        Self {
            words: vec![0; len.div_ceil(64) as usize],
            len,
        }
    }

    /// Number of bits.
    pub const fn len(&self) -> u64 {
        self.len
    }

    /// True for a zero-length bitmap.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Calls `f(word_index, mask)` for each word that `[start, end)` touches.
    fn for_words(start: u64, end: u64, mut f: impl FnMut(usize, u64)) {
        let mut bit = start;
        while bit < end {
            let word = bit / 64;
            let hi = end.min((word + 1) * 64);
            f(word as usize, word_mask(bit % 64, hi - word * 64));
            bit = hi;
        }
    }

    /// The first set bit in `[start, end)`, if any. `end <= len` is the caller's contract.
    pub fn first_set(&self, start: u64, end: u64) -> Option<u64> {
        let mut bit = start;
        while bit < end {
            let word = bit / 64;
            let hi = end.min((word + 1) * 64);
            let hit = self.words[word as usize] & word_mask(bit % 64, hi - word * 64);
            if hit != 0 {
                return Some(word * 64 + u64::from(hit.trailing_zeros()));
            }
            bit = hi;
        }
        None
    }

    /// Sets bits `[start, end)`.
    pub fn set_range(&mut self, start: u64, end: u64) {
        Self::for_words(start, end, |w, mask| self.words[w] |= mask);
    }

    /// Number of set bits in `[start, end)`.
    pub fn count_range(&self, start: u64, end: u64) -> u64 {
        let mut n = 0;
        Self::for_words(start, end, |w, mask| {
            n += u64::from((self.words[w] & mask).count_ones());
        });
        n
    }

    /// Value of one bit.
    pub fn get(&self, bit: u64) -> bool {
        self.words[(bit / 64) as usize] >> (bit % 64) & 1 == 1
    }

    /// The maximal runs of clear bits inside `[start, end)`.
    pub fn clear_runs(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        let mut run_start = None;
        for bit in start..end {
            match (self.get(bit), run_start) {
                (false, None) => run_start = Some(bit),
                (true, Some(s)) => {
                    runs.push((s, bit));
                    run_start = None;
                }
                _ => {}
            }
        }
        if let Some(s) = run_start {
            runs.push((s, end));
        }
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_across_word_edges() {
        let mut b = Bitmap::new(200);
        assert_eq!(b.first_set(0, 200), None);
        b.set_range(60, 130);
        assert_eq!(b.count_range(0, 200), 70);
        assert_eq!(b.first_set(0, 60), None);
        assert_eq!(b.first_set(0, 61), Some(60));
        assert_eq!(b.first_set(129, 200), Some(129));
        assert_eq!(b.first_set(130, 200), None);
        assert_eq!(b.clear_runs(0, 200), vec![(0, 60), (130, 200)]);
        b.set_range(0, 200);
        assert_eq!(b.count_range(0, 200), 200);
        assert!(b.clear_runs(0, 200).is_empty());
    }

    #[test]
    fn full_word_mask() {
        assert_eq!(word_mask(0, 64), u64::MAX);
        assert_eq!(word_mask(63, 64), 1 << 63);
        assert_eq!(word_mask(3, 5), 0b11000);
    }
}
