//! numpy inputs: contiguous int64/bool arrays are borrowed as they are; other array-likes
//! (lists, int32 arrays) are converted once, and anything that is not losslessly an integer
//! (or bool) array is refused with an error that names the argument: floats, bool masks
//! where ids belong, ragged lists, the wrong number of dimensions.

use numpy::{Element, PyArray, PyArray1, PyArrayMethods, PyReadonlyArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt, PyList};

use super::args::{kind_and_value, shown};
use super::errors::type_error;
use crate::error::CoreError;

fn as_array<'py, T: Element, D: numpy::ndarray::Dimension>(
    obj: &Bound<'py, PyAny>,
    name: &'static str,
    dtype: &str,
) -> PyResult<PyReadonlyArray<'py, T, D>> {
    if let Ok(array) = obj.cast::<PyArray<T, D>>() {
        if array.is_c_contiguous() {
            return array
                .try_readonly()
                .map_err(|e| type_error(name, "a readable array", e));
        }
    }
    let py = obj.py();
    let np = py.import("numpy")?;
    let array = np
        .call_method1("asarray", (obj,))
        .map_err(|err| unconvertible(py, obj, name, D::NDIM, &err))?;
    let ndim: usize = array.getattr("ndim")?.extract()?;
    let want = D::NDIM.unwrap_or(ndim);
    if ndim != want {
        // A scalar is shown as itself: `src_ids=None` says more than `<0-d array>`.
        let value = if ndim == 0 {
            shown(obj)
        } else {
            format!("<{ndim}-d array>")
        };
        return Err(CoreError::invalid(name, value, format!("a {want}-d array")).into());
    }
    let size: usize = array.getattr("size")?.extract()?;
    let from = array.getattr("dtype")?;
    // Empty lists arrive as float64; anything else must cast without loss. numpy calls
    // bool -> int64 safe, but a bool array where ids belong is a mask passed by mistake.
    let kind: String = from.getattr("kind")?.extract()?;
    let safe: bool = np
        .call_method1("can_cast", (&from, dtype, "safe"))?
        .extract()?;
    if size > 0 && (!safe || (kind == "b" && dtype != "bool")) {
        return Err(type_error(
            name,
            &format!("an array castable to {dtype}"),
            format!("dtype {from}"),
        ));
    }
    let converted = np.call_method1("ascontiguousarray", (array, dtype))?;
    Ok(converted.cast_into::<PyArray<T, D>>()?.readonly())
}

/// The error for an array-like numpy cannot convert (a ragged list, a CUDA tensor), naming
/// the argument instead of leaking numpy's message alone.
fn unconvertible(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    name: &'static str,
    want: Option<usize>,
    err: &PyErr,
) -> PyErr {
    let why = err.value(py).to_string();
    let want = want.map_or_else(
        || "an array-like".to_string(),
        |n| format!("a {n}-d array-like"),
    );
    if err.is_instance_of::<PyTypeError>(py) {
        return type_error(name, &want, format!("{} ({why})", kind_and_value(obj)));
    }
    CoreError::invalid(name, shown(obj), format!("{want} ({why})")).into()
}

/// A 1-d int64 view of `obj`.
pub fn i64_vec<'py>(
    obj: &Bound<'py, PyAny>,
    name: &'static str,
) -> PyResult<PyReadonlyArray<'py, i64, numpy::Ix1>> {
    if let Some(values) = int_list(obj, name) {
        return Ok(PyArray1::from_vec(obj.py(), values?).readonly());
    }
    as_array(obj, name, "int64")
}

/// The values of a list of plain ints that each fit in an int64 (the chunk bounds an engine
/// passes), read straight off the list where numpy's conversion makes about ten Python
/// calls; a bool in it is refused by name (a flag where an id or a bound belongs, which
/// numpy would take as 0 or 1). None for any other list (a float, a numpy scalar, an int
/// past int64), which `as_array` converts or refuses.
fn int_list(obj: &Bound<'_, PyAny>, name: &'static str) -> Option<PyResult<Vec<i64>>> {
    let list = obj.cast::<PyList>().ok()?;
    let mut values = Vec::with_capacity(list.len());
    for (at, item) in list.iter().enumerate() {
        if item.is_instance_of::<PyBool>() {
            return Some(Err(type_error(
                name,
                "a list of ints",
                format!("bool {} at index {at}", shown(&item)),
            )));
        }
        if !item.is_exact_instance_of::<PyInt>() {
            return None;
        }
        values.push(item.extract::<i64>().ok()?);
    }
    Some(Ok(values))
}

/// A 2-d int64 view of `obj`.
pub fn i64_table<'py>(
    obj: &Bound<'py, PyAny>,
    name: &'static str,
) -> PyResult<PyReadonlyArray<'py, i64, numpy::Ix2>> {
    as_array(obj, name, "int64")
}

/// A 1-d bool view of `obj`.
pub fn bool_vec<'py>(
    obj: &Bound<'py, PyAny>,
    name: &'static str,
) -> PyResult<PyReadonlyArray<'py, bool, numpy::Ix1>> {
    as_array(obj, name, "bool")
}

/// The contiguous slice of a borrowed array (always contiguous after `as_array`).
pub fn slice<'a, T: Element, D: numpy::ndarray::Dimension>(
    array: &'a PyReadonlyArray<'_, T, D>,
) -> PyResult<&'a [T]> {
    array
        .as_slice()
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
}
