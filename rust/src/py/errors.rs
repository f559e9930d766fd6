//! `CoreError` -> the exception hierarchy of `kvferry.errors`, and the panic fence.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyModule, PyType};

use crate::error::CoreError;

/// The hierarchy is defined in Python (`kvferry/errors.py`) because its classes inherit from
/// both `KvFerryError` and a builtin (`ValueError`, `KeyError`); it is imported once, on the
/// first error, by which time `kvferry/__init__.py` has run.
static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn error_class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyType>> {
    let module = ERRORS.get_or_try_init(py, || py.import("kvferry.errors").map(Bound::unbind))?;
    Ok(module.bind(py).getattr(name)?.cast_into::<PyType>()?)
}

fn raise(name: &str, message: String) -> PyErr {
    Python::attach(|py| match error_class(py, name) {
        Ok(class) => PyErr::from_type(class, message),
        Err(import_error) => import_error,
    })
}

impl From<CoreError> for PyErr {
    fn from(err: CoreError) -> Self {
        let class = match err {
            CoreError::InvalidArgument { .. } => "InvalidArgumentError",
            CoreError::DuplicateTransfer { .. } => "DuplicateTransferError",
            CoreError::UnknownRequest(_) => "UnknownRequestError",
        };
        raise(class, err.to_string())
    }
}

/// A `TypeError` that names the argument, for values of the wrong kind.
pub fn type_error(name: &str, expected: &str, got: impl std::fmt::Display) -> PyErr {
    pyo3::exceptions::PyTypeError::new_err(format!("{name} must be {expected}, got {got}"))
}

/// Runs `f`, turning a panic into a `KvFerryError` so that no panic crosses into Python.
/// The core is written not to panic; this is the fence in case it does.
pub fn fence<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<&str>()
            .map(ToString::to_string)
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        let message = format!("internal error in kvferry._core (please report): {what}");
        Err(Python::attach(|py| match error_class(py, "KvFerryError") {
            Ok(class) => PyErr::from_type(class, message),
            Err(_) => PyRuntimeError::new_err(message),
        }))
    })
}
