//! The field codecs a `record!` table names: each `Reader` method reads one field (checking
//! its size against the bytes left and its bound before allocating), and the `Writer`
//! method of the same name writes it back, byte for byte.

use super::check::{bound, check_name};
use super::{
    Record, Result, WireError, HEADER_BYTES, MAGIC, MAX_DIMS, MAX_FRAME_BYTES, MAX_IDS,
    MAX_NAME_BYTES, VERSION,
};

pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, at: 0 }
    }

    pub(crate) fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn take(&mut self, what: &'static str, n: usize) -> Result<&'a [u8]> {
        let left = self.left();
        if n > left {
            return Err(WireError::Truncated {
                what,
                need: n,
                left,
            });
        }
        let out = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(out)
    }

    pub(crate) fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(what, N)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8> {
        Ok(self.take(what, 1)?[0])
    }

    /// A bool as one byte, 0 or 1.
    pub(crate) fn flag(&mut self, what: &'static str) -> Result<bool> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(WireError::field(what, other, "0 or 1")),
        }
    }

    /// A bool as an `i64`, 0 or 1 (a notice is eight `i64`).
    pub(crate) fn last(&mut self, what: &'static str) -> Result<bool> {
        match self.i64(what)? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(WireError::field(what, other, "0 or 1")),
        }
    }

    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn i64(&mut self, what: &'static str) -> Result<i64> {
        Ok(i64::from_le_bytes(self.array(what)?))
    }

    /// A count of items of `item_bytes` each, checked against `max` and against the bytes
    /// left before anything is allocated for them.
    pub(crate) fn count(
        &mut self,
        what: &'static str,
        max: usize,
        item_bytes: usize,
    ) -> Result<usize> {
        let n = self.u32(what)? as usize;
        bound(what, n, max)?;
        let left = self.left();
        if n.saturating_mul(item_bytes) > left {
            return Err(WireError::Truncated {
                what,
                need: n.saturating_mul(item_bytes),
                left,
            });
        }
        Ok(n)
    }

    pub(crate) fn bytes(&mut self, what: &'static str, max: usize) -> Result<Vec<u8>> {
        let n = self.count(what, max, 1)?;
        Ok(self.take(what, n)?.to_vec())
    }

    /// UTF-8 text of at most `max` bytes.
    pub(crate) fn text(&mut self, what: &'static str, max: usize) -> Result<String> {
        let raw = self.bytes(what, max)?;
        String::from_utf8(raw).map_err(|_| WireError::field(what, "<not UTF-8>", "UTF-8 text"))
    }

    /// A name: 1 to [`MAX_NAME_BYTES`] of `[A-Za-z0-9._-]`.
    pub(crate) fn name(&mut self, what: &'static str) -> Result<String> {
        let name = self.text(what, MAX_NAME_BYTES)?;
        check_name(what, &name)?;
        Ok(name)
    }

    /// Block ids: a count, then `i64`s.
    pub(crate) fn ids(&mut self, what: &'static str) -> Result<Vec<i64>> {
        let n = self.count(what, MAX_IDS, 8)?;
        let raw = self.take(what, n * 8)?;
        Ok(raw
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect())
    }

    /// Block ids behind a flag byte (0: none).
    pub(crate) fn opt_ids(&mut self, what: &'static str) -> Result<Option<Vec<i64>>> {
        Ok(if self.flag(what)? {
            Some(self.ids(what)?)
        } else {
            None
        })
    }

    /// Per-block checksums behind a flag byte (0: none): a count, then `u64`s.
    pub(crate) fn opt_sums(&mut self, what: &'static str) -> Result<Option<Vec<u64>>> {
        Ok(if self.flag(what)? {
            let n = self.count(what, MAX_IDS, 8)?;
            let raw = self.take(what, n * 8)?;
            Some(
                raw.chunks_exact(8)
                    .map(|c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                    .collect(),
            )
        } else {
            None
        })
    }

    /// A tensor shape or stride: at most [`MAX_DIMS`] `u64`s.
    pub(crate) fn dims(&mut self, what: &'static str) -> Result<Vec<u64>> {
        self.u64s(what, MAX_DIMS)
    }

    pub(crate) fn u64s(&mut self, what: &'static str, max: usize) -> Result<Vec<u64>> {
        let n = self.count(what, max, 8)?;
        (0..n).map(|_| self.u64(what)).collect()
    }

    /// `(request_id, epoch)` pairs.
    pub(crate) fn leases(&mut self, what: &'static str, max: usize) -> Result<Vec<(i64, i64)>> {
        let n = self.count(what, max, 16)?;
        (0..n)
            .map(|_| Ok((self.i64("request_id")?, self.i64("epoch")?)))
            .collect()
    }

    pub(crate) fn record<T: Record>(&mut self, _what: &'static str) -> Result<T> {
        T::read(self)
    }

    /// A count (at most `max`, each at least `item_bytes` long), then records.
    pub(crate) fn records<T: Record>(
        &mut self,
        what: &'static str,
        max: usize,
        item_bytes: usize,
    ) -> Result<Vec<T>> {
        let n = self.count(what, max, item_bytes)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(T::read(self)?);
        }
        Ok(out)
    }
}

/// The encoder's side; every method takes its field by reference, as `record!` hands it.
pub(crate) struct Writer(Vec<u8>);

#[allow(clippy::trivially_copy_pass_by_ref, clippy::ref_option)] // one signature for every field codec
impl Writer {
    /// A frame of type `kind` whose length `finish` fills in.
    pub(crate) fn header(kind: u16) -> Self {
        let mut w = Self(Vec::with_capacity(HEADER_BYTES + 64));
        w.0.extend_from_slice(&MAGIC);
        w.0.extend_from_slice(&VERSION.to_le_bytes());
        w.0.extend_from_slice(&kind.to_le_bytes());
        w.0.extend_from_slice(&0u32.to_le_bytes()); // the length, patched by `finish`
        w
    }

    pub(crate) fn finish(mut self) -> Result<Vec<u8>> {
        let length = self.0.len() - HEADER_BYTES;
        if length > MAX_FRAME_BYTES as usize {
            return Err(WireError::TooLong {
                length: length as u64,
                limit: u64::from(MAX_FRAME_BYTES),
            });
        }
        self.0[8..12].copy_from_slice(&(length as u32).to_le_bytes());
        Ok(self.0)
    }

    pub(crate) fn array<const N: usize>(&mut self, v: &[u8; N]) {
        self.0.extend_from_slice(v);
    }
    pub(crate) fn u8(&mut self, v: &u8) {
        self.0.push(*v);
    }
    pub(crate) fn flag(&mut self, v: &bool) {
        self.0.push(u8::from(*v));
    }
    pub(crate) fn last(&mut self, v: &bool) {
        self.i64(&i64::from(*v));
    }
    pub(crate) fn u32(&mut self, v: &u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn u64(&mut self, v: &u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub(crate) fn i64(&mut self, v: &i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// A count; the record's `Check` bounded it well below `u32::MAX`.
    pub(crate) fn count(&mut self, n: usize) {
        self.u32(&(n as u32));
    }
    pub(crate) fn bytes(&mut self, b: &[u8]) {
        self.count(b.len());
        self.0.extend_from_slice(b);
    }
    pub(crate) fn text(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }
    pub(crate) fn name(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }
    pub(crate) fn ids(&mut self, ids: &[i64]) {
        self.count(ids.len());
        self.0.reserve(ids.len() * 8);
        for id in ids {
            self.i64(id);
        }
    }
    pub(crate) fn opt_ids(&mut self, ids: &Option<Vec<i64>>) {
        self.flag(&ids.is_some());
        if let Some(ids) = ids {
            self.ids(ids);
        }
    }
    pub(crate) fn opt_sums(&mut self, sums: &Option<Vec<u64>>) {
        self.flag(&sums.is_some());
        if let Some(sums) = sums {
            self.u64s(sums);
        }
    }
    pub(crate) fn dims(&mut self, dims: &[u64]) {
        self.u64s(dims);
    }
    pub(crate) fn u64s(&mut self, values: &[u64]) {
        self.count(values.len());
        for v in values {
            self.u64(v);
        }
    }
    pub(crate) fn leases(&mut self, leases: &[(i64, i64)]) {
        self.count(leases.len());
        for (r, e) in leases {
            self.i64(r);
            self.i64(e);
        }
    }
    pub(crate) fn record<T: Record>(&mut self, record: &T) {
        record.write(self);
    }
    pub(crate) fn records<T: Record>(&mut self, records: &[T]) {
        self.count(records.len());
        for record in records {
            record.write(self);
        }
    }
}
