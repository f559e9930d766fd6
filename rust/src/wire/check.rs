//! The bounds and domains the records' `Check`s share.

use super::{Notice, Result, WireError, MAX_IDS, MAX_NAME_BYTES};

pub(crate) fn bound(field: &'static str, len: usize, max: usize) -> Result<()> {
    if len > max {
        return Err(WireError::field(
            field,
            format!("<{len} items>"),
            "within the per-frame bound",
        ));
    }
    Ok(())
}

/// Block ids: at most [`MAX_IDS`], none negative.
pub(crate) fn check_ids(field: &'static str, ids: &[i64]) -> Result<()> {
    bound(field, ids.len(), MAX_IDS)?;
    if let Some(bad) = ids.iter().find(|&&id| id < 0) {
        return Err(WireError::field(field, bad, "block ids >= 0"));
    }
    Ok(())
}

/// 1 to [`MAX_NAME_BYTES`] of `[A-Za-z0-9._-]`.
pub(crate) fn check_name(field: &'static str, name: &str) -> Result<()> {
    if name.is_empty()
        || name.len() > MAX_NAME_BYTES
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(WireError::field(
            field,
            format!("{name:?}"),
            "1 to 128 characters of [A-Za-z0-9._-]",
        ));
    }
    Ok(())
}

/// Non-empty UTF-8 text of at most `max` bytes (any characters: an id is the caller's).
pub(crate) fn check_text(field: &'static str, text: &str, max: usize) -> Result<()> {
    if text.is_empty() {
        return Err(WireError::field(field, "\"\"", "non-empty text"));
    }
    bound(field, text.len(), max)
}

/// Blocks the notices cover, refusing a notice whose range is empty or reversed (a write
/// always carries blocks) so that the count is meaningful.
pub(crate) fn covered(notices: &[Notice]) -> Result<u128> {
    let mut total: u128 = 0;
    for n in notices {
        if n.end <= n.start || n.start < 0 {
            return Err(WireError::field(
                "notice range",
                format!("[{}, {})", n.start, n.end),
                "a non-empty range of blocks >= 0 (with dst_ids)",
            ));
        }
        total += (n.end - n.start) as u128;
    }
    Ok(total)
}

/// `ids` name one block per block the notices cover.
pub(crate) fn check_covered(field: &'static str, notices: &[Notice], ids: &[i64]) -> Result<()> {
    check_ids(field, ids)?;
    if covered(notices)? != ids.len() as u128 {
        return Err(WireError::field(
            field,
            format!("<{} ids>", ids.len()),
            "one id per block the notices cover",
        ));
    }
    Ok(())
}

/// Checksums, when a frame carries them: one per block the notices cover.
pub(crate) fn check_sums(notices: &[Notice], sums: Option<&[u64]>) -> Result<()> {
    let Some(sums) = sums else { return Ok(()) };
    bound("checksums", sums.len(), MAX_IDS)?;
    if covered(notices)? != sums.len() as u128 {
        return Err(WireError::field(
            "checksums",
            format!("<{} checksums>", sums.len()),
            "one checksum per block the notices cover",
        ));
    }
    Ok(())
}
