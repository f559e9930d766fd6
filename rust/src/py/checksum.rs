//! `block_checksums`: the per-block checksum (`crate::checksum`) of a CPU pool's blocks,
//! read where they lie (numpy views of the pool's layers, no copy), without the GIL.

use numpy::ndarray::{ArrayView3, Axis};
use numpy::{PyArray1, PyArray3, PyArrayMethods, PyReadonlyArray3, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::args::kind_and_value;
use super::arrays::{i64_vec, slice};
use super::errors::{fence, type_error};
use crate::checksum::{segment_position, sum_words, WORD_BYTES};
use crate::error::CoreError;

/// The checksum of each block ``block_ids[i]`` over ``layers``, which are layers
/// ``first_layer``, ``first_layer + 1``, ... of a pool, each a 3-d uint8 array ``(segments,
/// num_blocks, segment_bytes)`` whose rows are contiguous (any other strides: a pool's
/// ``segment_views(torch.uint8)`` as numpy). Returns a uint64 array, one value per id.
#[pyfunction]
#[allow(clippy::needless_pass_by_value)] // pyo3 hands the list over as an owned Vec
pub fn block_checksums<'py>(
    py: Python<'py>,
    layers: Vec<Bound<'py, PyAny>>,
    block_ids: &Bound<'py, PyAny>,
    first_layer: u64,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    fence(|| {
        let borrowed = layers
            .iter()
            .map(|obj| {
                obj.cast::<PyArray3<u8>>()
                    .map_err(|_| {
                        type_error("layers", "a list of 3-d uint8 arrays", kind_and_value(obj))
                    })?
                    .try_readonly()
                    .map_err(|e| type_error("layers", "readable arrays", e))
            })
            .collect::<PyResult<Vec<PyReadonlyArray3<'py, u8>>>>()?;
        let ids = i64_vec(block_ids, "block_ids")?;
        let ids = slice(&ids)?;
        let views: Vec<ArrayView3<'_, u8>> = borrowed.iter().map(|a| a.as_array()).collect();
        let shape = check_layers(&borrowed)?;
        check_ids(ids, shape[1])?;
        let sums = if ids.len() as u64 * (shape[0] * shape[2]) as u64 * views.len() as u64 > 1 << 16
        {
            py.detach(|| checksums(&views, ids, first_layer, shape[0]))
        } else {
            checksums(&views, ids, first_layer, shape[0])
        };
        Ok(PyArray1::from_vec(py, sums))
    })
}

fn check_layers(layers: &[PyReadonlyArray3<'_, u8>]) -> PyResult<[usize; 3]> {
    let Some(first) = layers.first() else {
        return Err(CoreError::invalid("layers", "[]", "at least one layer").into());
    };
    let shape: [usize; 3] = [first.shape()[0], first.shape()[1], first.shape()[2]];
    for (i, layer) in layers.iter().enumerate() {
        if layer.shape() != shape {
            let got = format!("<layer {i} of shape {:?}>", layer.shape());
            return Err(CoreError::invalid(
                "layers",
                got,
                format!("every layer of shape {shape:?}"),
            )
            .into());
        }
        if shape[2] > 1 && layer.strides()[2] != 1 {
            let got = format!("<layer {i} of strides {:?}>", layer.strides());
            return Err(CoreError::invalid("layers", got, "rows of contiguous bytes").into());
        }
    }
    if shape[2] % WORD_BYTES != 0 {
        let got = format!("<segments of {} bytes>", shape[2]);
        return Err(CoreError::invalid("layers", got, "segments of whole 8-byte words").into());
    }
    Ok(shape)
}

fn check_ids(ids: &[i64], num_blocks: usize) -> PyResult<()> {
    if let Some(bad) = ids
        .iter()
        .find(|&&b| b < 0 || b as u64 >= num_blocks as u64)
    {
        return Err(CoreError::invalid(
            "block_ids",
            format!("<an array holding {bad}>"),
            format!("block ids in [0, {num_blocks})"),
        )
        .into());
    }
    Ok(())
}

fn checksums(
    layers: &[ArrayView3<'_, u8>],
    ids: &[i64],
    first_layer: u64,
    segments: usize,
) -> Vec<u64> {
    let segment_words = layers.first().map_or(0, |l| l.shape()[2] / WORD_BYTES) as u64;
    ids.iter()
        .map(|&block| {
            let mut sum = 0u64;
            for (k, layer) in layers.iter().enumerate() {
                let rows = layer.index_axis(Axis(1), block as usize);
                for (s, row) in rows.outer_iter().enumerate() {
                    let at = segment_position(
                        first_layer + k as u64,
                        s as u64,
                        segments as u64,
                        segment_words,
                    );
                    let bytes = row.as_slice().unwrap_or_default();
                    sum = sum.wrapping_add(sum_words(bytes, at));
                }
            }
            sum
        })
        .collect()
}
