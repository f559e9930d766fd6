//! The per-block checksum that travels with a notice: a 64-bit sum, over the 8-byte words a
//! write puts into one destination block, of each word mixed with its position.
//!
//! ```text
//! block (over layers [lo, hi)):  layer l, segment s, word w   (little-endian u64 words)
//! position:                      p = (l * segments + s) * segment_words + w
//! checksum:                      sum over (l, s, w) of mix(word, p)   (mod 2**64)
//! mix(x, p):                     z = (x ^ p * KEY) * M1;  z ^= z >> 32;  z * M2
//! ```
//! `mix` is a bijection of the word for each position, so a block whose words differ from
//! the sent ones in one place always sums differently; a sum is order-free, so a GPU adds
//! the words of a block in any order (one program per segment, an atomic add per program)
//! and a layer group's sum plus the other groups' is the whole block's. Positions count
//! from layer 0, not from the write's first layer, so both sides agree whatever their
//! strides, and a layer slice is the same bytes at the same positions. Not a MAC: it finds
//! corruption (a flipped bit, a stale or misplaced block), not a forger (docs/security.md).
//!
//! ```
//! use kvferry::checksum::{mix, words_checksum};
//!
//! let bytes = [7u8; 16];
//! let sum = words_checksum(&bytes, 0)?;
//! assert_eq!(sum, mix(0x0707_0707_0707_0707, 0).wrapping_add(mix(0x0707_0707_0707_0707, 1)));
//! let mut flipped = bytes;
//! flipped[9] ^= 0x10;
//! assert_ne!(words_checksum(&flipped, 0)?, sum);
//! # Ok::<(), kvferry::CoreError>(())
//! ```

use crate::error::{CoreError, Result};

/// Multiplies a word's position (the golden ratio in 64 bits): neighbouring positions get
/// keys that differ in many bits.
pub const KEY: u64 = 0x9E37_79B9_7F4A_7C15;
/// The mixing multipliers (splitmix64's).
pub const M1: u64 = 0xBF58_476D_1CE4_E5B9;
/// See [`M1`].
pub const M2: u64 = 0x94D0_49BB_1331_11EB;
/// Bytes in one word.
pub const WORD_BYTES: usize = 8;

/// One word mixed with its position: odd multiplies and an xor-shift, each a bijection.
#[inline]
pub fn mix(word: u64, position: u64) -> u64 {
    let mut z = (word ^ position.wrapping_mul(KEY)).wrapping_mul(M1);
    z ^= z >> 32;
    z.wrapping_mul(M2)
}

/// The checksum of `bytes` (a whole number of little-endian words) whose first word sits at
/// `first_position`.
pub fn words_checksum(bytes: &[u8], first_position: u64) -> Result<u64> {
    if bytes.len() % WORD_BYTES != 0 {
        return Err(CoreError::invalid(
            "bytes",
            format!("<{} bytes>", bytes.len()),
            "a whole number of 8-byte words",
        ));
    }
    Ok(sum_words(bytes, first_position))
}

/// [`words_checksum`] of a buffer known to hold whole words.
pub(crate) fn sum_words(bytes: &[u8], first_position: u64) -> u64 {
    // Four independent sums: the multiplies of neighbouring words then overlap.
    let mut acc = [0u64; 4];
    let mut chunks = bytes.chunks_exact(4 * WORD_BYTES);
    let mut p = first_position;
    for chunk in &mut chunks {
        for (k, a) in acc.iter_mut().enumerate() {
            let w = u64::from_le_bytes(chunk[k * 8..k * 8 + 8].try_into().unwrap_or_default());
            *a = a.wrapping_add(mix(w, p.wrapping_add(k as u64)));
        }
        p = p.wrapping_add(4);
    }
    let mut total = acc.iter().fold(0u64, |s, &a| s.wrapping_add(a));
    for word in chunks.remainder().chunks_exact(WORD_BYTES) {
        let w = u64::from_le_bytes(word.try_into().unwrap_or_default());
        total = total.wrapping_add(mix(w, p));
        p = p.wrapping_add(1);
    }
    total
}

/// The position of the first word of segment `segment` of layer `layer`.
pub fn segment_position(layer: u64, segment: u64, segments: u64, segment_words: u64) -> u64 {
    layer
        .wrapping_mul(segments)
        .wrapping_add(segment)
        .wrapping_mul(segment_words)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(bytes: &[u8], first: u64) -> u64 {
        bytes
            .chunks_exact(8)
            .enumerate()
            .map(|(i, c)| {
                mix(
                    u64::from_le_bytes(c.try_into().unwrap()),
                    first.wrapping_add(i as u64),
                )
            })
            .fold(0u64, u64::wrapping_add)
    }

    #[test]
    fn the_unrolled_sum_is_the_plain_one() {
        let bytes: Vec<u8> = (0..8 * 37).map(|i| (i * 31 % 251) as u8).collect();
        for first in [0, 5, u64::MAX - 3] {
            assert_eq!(words_checksum(&bytes, first), Ok(reference(&bytes, first)));
        }
    }

    #[test]
    fn every_single_bit_flip_changes_the_sum() {
        let bytes: Vec<u8> = (0..64).map(|i| i as u8).collect();
        let sum = words_checksum(&bytes, 3).unwrap();
        for bit in 0..bytes.len() * 8 {
            let mut flipped = bytes.clone();
            flipped[bit / 8] ^= 1 << (bit % 8);
            assert_ne!(words_checksum(&flipped, 3).unwrap(), sum, "bit {bit}");
        }
    }

    #[test]
    fn swapped_words_and_shifted_positions_change_the_sum() {
        let mut bytes: Vec<u8> = (0..32).collect();
        let sum = words_checksum(&bytes, 0).unwrap();
        assert_ne!(words_checksum(&bytes, 1).unwrap(), sum);
        bytes.rotate_left(8);
        assert_ne!(words_checksum(&bytes, 0).unwrap(), sum);
    }

    #[test]
    fn parts_add_up_to_the_whole() {
        let bytes: Vec<u8> = (0..8 * 10).map(|i| (i * 7) as u8).collect();
        let whole = words_checksum(&bytes, 0).unwrap();
        let parts = words_checksum(&bytes[..24], 0)
            .unwrap()
            .wrapping_add(words_checksum(&bytes[24..], 3).unwrap());
        assert_eq!(parts, whole);
    }

    #[test]
    fn a_partial_word_is_refused() {
        assert!(matches!(
            words_checksum(&[0; 12], 0),
            Err(CoreError::InvalidArgument { name: "bytes", .. })
        ));
    }

    #[test]
    fn mix_is_pinned() {
        // Sender and receiver may be different builds (and the GPU kernel another
        // implementation): the function itself must never drift.
        assert_eq!(mix(0, 0), 0);
        assert_eq!(mix(1, 0), 0x9364_9591_BB8D_8C9C);
        assert_eq!(mix(0x0123_4567_89AB_CDEF, 2), 0x973F_8D33_FF19_A120);
        let bytes: Vec<u8> = (0..64).collect();
        assert_eq!(words_checksum(&bytes, 0), Ok(0xCC5A_848B_5197_3461));
    }
}
