//! Scalar arguments that name themselves when refused.
//!
//! `PyO3`'s own extraction raises `OverflowError: Python int too large to convert to C long`
//! for `2**64` and only *notes* the argument's name; every integer and bool argument of the
//! module goes through one of the `from_py_with` extractors below instead, so the message
//! itself says which argument was refused and what it held.

use pyo3::prelude::*;
use pyo3::types::PyBool;

use super::errors::type_error;
use crate::error::CoreError;

/// Longest rendering of a refused value in a message (a stray list can be huge).
const MAX_SHOWN: usize = 60;

/// `repr(obj)`, cut to [`MAX_SHOWN`] characters.
pub fn shown(obj: &Bound<'_, PyAny>) -> String {
    let text = obj
        .repr()
        .map_or_else(|_| "<unprintable>".to_string(), |r| r.to_string());
    if text.chars().count() <= MAX_SHOWN {
        return text;
    }
    let cut: String = text.chars().take(MAX_SHOWN).collect();
    format!("{cut}...")
}

/// The type name and value of `obj`, for `TypeError`s: ``float 1.5``.
pub fn kind_and_value(obj: &Bound<'_, PyAny>) -> String {
    let kind = obj
        .get_type()
        .name()
        .map_or_else(|_| "object".to_string(), |n| n.to_string());
    format!("{kind} {}", shown(obj))
}

/// `obj` as an `i64`: an integer that does not fit is an invalid value, anything that is not
/// an integer (a float, a string) the wrong type.
pub fn int(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<i64> {
    if let Ok(value) = obj.extract::<i64>() {
        return Ok(value);
    }
    match obj.py().import("operator")?.call_method1("index", (obj,)) {
        Ok(index) => Err(CoreError::invalid(name, index, "in [-2**63, 2**63) (an int64)").into()),
        Err(_) => Err(type_error(name, "an integer", kind_and_value(obj))),
    }
}

/// `obj` as a `bool`: Python `bool` or `numpy.bool_`, never an integer (``1`` where a flag
/// belongs is usually an argument in the wrong place).
pub fn flag(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<bool> {
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(b.is_true());
    }
    obj.extract::<bool>()
        .map_err(|_| type_error(name, "a bool", kind_and_value(obj)))
}

/// Named `i64` extractors, one per argument name, for `#[pyo3(from_py_with = ...)]`.
macro_rules! int_args {
    ($($f:ident),* $(,)?) => {$(
        #[doc = concat!("`", stringify!($f), "` as an `i64`, refused by name.")]
        pub fn $f(obj: &Bound<'_, PyAny>) -> PyResult<i64> {
            int(obj, stringify!($f))
        }
    )*};
}

int_args!(
    start,
    end,
    tokens_per_block,
    prompt_len,
    reused_len,
    chunk_start,
    chunk_end,
    request_id,
    src_blocks,
    dst_blocks,
    layer_groups,
    layer_group,
);

/// `window`: ``None`` (full attention) or an `i64`.
pub fn window(obj: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
    if obj.is_none() {
        return Ok(None);
    }
    int(obj, "window").map(Some)
}

/// `src_blocks` of a plan call: ``None`` (unchecked) or an `i64`.
pub fn opt_src_blocks(obj: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
    if obj.is_none() {
        return Ok(None);
    }
    int(obj, "src_blocks").map(Some)
}

/// `dst_blocks` of a plan call: ``None`` (unchecked) or an `i64`.
pub fn opt_dst_blocks(obj: &Bound<'_, PyAny>) -> PyResult<Option<i64>> {
    if obj.is_none() {
        return Ok(None);
    }
    int(obj, "dst_blocks").map(Some)
}

/// Named `bool` extractors.
macro_rules! flag_args {
    ($($f:ident),* $(,)?) => {$(
        #[doc = concat!("`", stringify!($f), "` as a `bool`, refused by name.")]
        pub fn $f(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
            flag(obj, stringify!($f))
        }
    )*};
}

flag_args!(pipelined, context_only, prefix_sent);
