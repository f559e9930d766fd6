//! `kvferry._core.wire_*` and `rendezvous_*`: the frame codecs of `crate::wire` for Python.
//!
//! A frame is `(kind, fields)` on the Python side, the same shape both ways (`wire_encode`
//! takes what `wire_decode` returns): `fields` is a dict of the record's fields by name
//! (`kvferry.transports.frames` and `kvferry.vllm.frames` make one frozen dataclass of it),
//! except the hello's, which is the flat dict `hello.rs` describes. Notices cross as
//! 8-tuples, block ids as int64 arrays (out) or any int sequence (in), bytes as bytes. One
//! call per frame: a batch of notices crosses the boundary once. Each record's conversion is
//! generated from its `record!` table by `py_record!`, each set's by `py_frame_set!`.

use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use super::args::{self, kind_and_value};
use super::arrays;
use super::errors::{fence, type_error};
use crate::wire::{
    self, rendezvous, CudaTensor, FrameType, Notice, Record, Region, WireError, NONCE_BYTES,
};

mod hello;

pub(crate) fn invalid(py: Python<'_>, message: String) -> PyErr {
    match py
        .import("kvferry.errors")
        .and_then(|m| m.getattr("InvalidArgumentError"))
    {
        Ok(class) => class
            .call1((message,))
            .map_or_else(|e| e, PyErr::from_value),
        Err(err) => err,
    }
}

fn wire_err(py: Python<'_>, context: &str, err: &WireError) -> PyErr {
    invalid(py, format!("{context}: {err}"))
}

/// A field's Python form, both ways; `name` names the field in errors.
pub(crate) trait PyField: Sized {
    fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>>;
    fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self>;
}

/// The field `key` of a record's dict (`what` names the record).
pub(crate) fn required<'py>(
    dict: &Bound<'py, PyDict>,
    key: &'static str,
    what: &str,
) -> PyResult<Bound<'py, PyAny>> {
    dict.get_item(key)?
        .ok_or_else(|| invalid(dict.py(), format!("invalid {what}: no {key:?}")))
}

/// `obj` as a record's dict holding exactly its `fields` (a misspelt key is refused, not
/// dropped).
pub(crate) fn record_dict<'py>(
    obj: &Bound<'py, PyAny>,
    what: &'static str,
    fields: &[&str],
) -> PyResult<Bound<'py, PyDict>> {
    let dict = obj
        .cast::<PyDict>()
        .map_err(|_| type_error(what, "a dict of the frame's fields", kind_and_value(obj)))?;
    for key in dict.keys() {
        let known = key
            .extract::<String>()
            .is_ok_and(|k| fields.contains(&k.as_str()));
        if !known {
            let fields = fields.join(", ");
            return Err(invalid(
                obj.py(),
                format!(
                    "invalid {what}: unknown field {} (its fields: {fields})",
                    args::shown(&key)
                ),
            ));
        }
    }
    Ok(dict.clone())
}

/// `dict[key] = value` in its Python form.
pub(crate) fn put<T: PyField>(
    dict: &Bound<'_, PyDict>,
    key: &'static str,
    value: T,
) -> PyResult<()> {
    dict.set_item(key, value.to_py(dict.py())?)
}

/// A record as a dict of its fields (`record!` invokes it).
macro_rules! py_record {
    ($name:ident { $($field:ident),* }) => {
        impl $crate::py::wire::PyField for $name {
            fn to_py(self, py: pyo3::Python<'_>) -> pyo3::PyResult<pyo3::Bound<'_, pyo3::PyAny>> {
                let dict = pyo3::types::PyDict::new(py);
                $($crate::py::wire::put(&dict, stringify!($field), self.$field)?;)*
                Ok(dict.into_any())
            }

            #[allow(unused_variables)] // a record without fields reads nothing
            fn from_py(obj: &pyo3::Bound<'_, pyo3::PyAny>, name: &'static str) -> pyo3::PyResult<Self> {
                let fields = <Self as $crate::wire::Record>::FIELDS;
                let dict = $crate::py::wire::record_dict(obj, name, fields)?;
                Ok(Self {
                    $($field: $crate::py::wire::PyField::from_py(
                        &$crate::py::wire::required(&dict, stringify!($field), name)?,
                        stringify!($field),
                    )?,)*
                })
            }
        }
    };
}
pub(crate) use py_record;

/// A set's frames as `(kind, fields)` (`frame_set!` invokes it).
pub(crate) trait PyFrame: Sized {
    fn to_py(self, py: Python<'_>) -> PyResult<(&'static str, Bound<'_, PyAny>)>;
    fn from_py(kind: &str, fields: &Bound<'_, PyAny>) -> PyResult<Self>;
}

macro_rules! py_frame_set {
    ($name:ident { $($variant:ident),* }) => {
        impl $crate::py::wire::PyFrame for $name {
            fn to_py(self, py: pyo3::Python<'_>) -> pyo3::PyResult<(&'static str, pyo3::Bound<'_, pyo3::PyAny>)> {
                Ok(match self {
                    $(Self::$variant(record) => (
                        $crate::wire::FrameType::$variant.name(),
                        $crate::py::wire::PyField::to_py(record, py)?,
                    ),)*
                })
            }

            fn from_py(kind: &str, fields: &pyo3::Bound<'_, pyo3::PyAny>) -> pyo3::PyResult<Self> {
                $(if kind == $crate::wire::FrameType::$variant.name() {
                    let name = $crate::wire::FrameType::$variant.name();
                    return Ok(Self::$variant($crate::py::wire::PyField::from_py(fields, name)?));
                })*
                Err($crate::py::wire::unknown_kind(fields.py(), kind, <Self as $crate::wire::FrameSet>::SET))
            }
        }
    };
}
pub(crate) use py_frame_set;

pub(crate) fn unknown_kind(py: Python<'_>, kind: &str, set: &str) -> PyErr {
    if FrameType::ALL.iter().any(|t| t.name() == kind) {
        return invalid(
            py,
            format!("invalid kind={kind:?}: not a frame of the {set}"),
        );
    }
    invalid(py, format!("invalid kind={kind:?}: not a frame type"))
}

fn int_error(name: &str, expected: &str, obj: &Bound<'_, PyAny>) -> PyErr {
    type_error(name, expected, kind_and_value(obj))
}

/// The unsigned ints: `extract` refuses a value out of the type's range, and the
/// error names the field and the range.
macro_rules! unsigned_field {
    ($($ty:ty => $range:literal),* $(,)?) => {$(
        impl PyField for $ty {
            fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
                Ok(self.into_pyobject(py)?.into_any())
            }
            fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self> {
                obj.extract().map_err(|_| int_error(name, $range, obj))
            }
        }
    )*};
}

unsigned_field!(u8 => "an int in [0, 255]", u32 => "an int in [0, 2**32)", u64 => "an int >= 0");

impl PyField for i64 {
    fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        Ok(self.into_pyobject(py)?.into_any())
    }
    fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self> {
        args::int(obj, name)
    }
}

impl PyField for bool {
    fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        Ok(pyo3::types::PyBool::new(py, self).to_owned().into_any())
    }
    fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self> {
        args::flag(obj, name)
    }
}

impl PyField for String {
    fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        Ok(self.into_pyobject(py)?.into_any())
    }
    fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self> {
        obj.extract()
            .map_err(|_| type_error(name, "a str", kind_and_value(obj)))
    }
}

impl PyField for [u8; NONCE_BYTES] {
    fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        Ok(PyBytes::new(py, &self).into_any())
    }
    fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self> {
        let raw = Vec::<u8>::from_py(obj, name)?;
        raw.try_into().map_err(|n: Vec<u8>| {
            invalid(
                obj.py(),
                format!("invalid {name}: {} bytes, must be {NONCE_BYTES}", n.len()),
            )
        })
    }
}

impl PyField for Vec<u8> {
    fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        Ok(PyBytes::new(py, &self).into_any())
    }
    fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self> {
        match obj.cast::<PyBytes>() {
            Ok(bytes) => Ok(bytes.as_bytes().to_vec()),
            Err(_) => Err(type_error(name, "bytes", kind_and_value(obj))),
        }
    }
}

impl PyField for Vec<u64> {
    fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        Ok(PyList::new(py, self)?.into_any())
    }
    fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self> {
        obj.extract()
            .map_err(|_| type_error(name, "a list of ints >= 0", kind_and_value(obj)))
    }
}

/// Block ids: an int64 array out (no copy per id), any int sequence or array in.
impl PyField for Vec<i64> {
    fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        Ok(PyArray1::from_vec(py, self).into_any())
    }
    fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self> {
        let array = arrays::i64_vec(obj, name)?;
        Ok(arrays::slice(&array)?.to_vec())
    }
}

impl PyField for Option<Vec<i64>> {
    fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        match self {
            Some(ids) => ids.to_py(py),
            None => Ok(py.None().into_bound(py)),
        }
    }
    fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self> {
        if obj.is_none() {
            return Ok(None);
        }
        Vec::<i64>::from_py(obj, name).map(Some)
    }
}

/// Checksums: a uint64 array out, a uint64 array (or any sequence of ints >= 0) in.
impl PyField for Option<Vec<u64>> {
    fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        match self {
            Some(sums) => Ok(PyArray1::from_vec(py, sums).into_any()),
            None => Ok(py.None().into_bound(py)),
        }
    }
    fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self> {
        if obj.is_none() {
            return Ok(None);
        }
        if let Ok(array) = obj.cast::<PyArray1<u64>>() {
            if let Ok(read) = array.try_readonly() {
                return Ok(Some(read.as_array().to_vec()));
            }
        }
        obj.extract().map(Some).map_err(|_| {
            type_error(
                name,
                "a uint64 array or a sequence of ints in [0, 2**64)",
                kind_and_value(obj),
            )
        })
    }
}

impl PyField for Vec<(i64, i64)> {
    fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        Ok(PyList::new(py, self)?.into_any())
    }
    fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self> {
        obj.extract().map_err(|_| {
            type_error(
                name,
                "a sequence of (request_id, epoch) int64 pairs",
                kind_and_value(obj),
            )
        })
    }
}

type NoticeTuple = (i64, i64, i64, i64, bool, i64, i64, i64);

/// Notices as 8-tuples in wire order (`kvferry.notice.Notice.as_tuple()`), not dicts: a
/// batch is one list of tuples, built and read without a lookup per field.
impl PyField for Vec<Notice> {
    fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        let tuples = self.iter().map(|n| {
            (
                n.request_id,
                n.slice_id,
                n.start,
                n.end,
                n.last,
                n.epoch,
                n.group,
                n.groups,
            )
        });
        Ok(PyList::new(py, tuples)?.into_any())
    }
    fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self> {
        if let Ok(tuples) = obj.extract::<Vec<NoticeTuple>>() {
            return Ok(tuples
                .into_iter()
                .map(|(r, s, a, b, last, e, g, gs)| Notice::new(r, s, a, b, last, e, g, gs))
                .collect());
        }
        // The slow path only says which value of which notice does not fit.
        let expected = "a sequence of 8-value notice tuples (int64 values, last a bool)";
        let items: Vec<Bound<'_, PyAny>> = obj
            .extract()
            .map_err(|_| type_error(name, expected, kind_and_value(obj)))?;
        let mut out = Vec::with_capacity(items.len());
        for item in &items {
            let t = item
                .cast::<PyTuple>()
                .map_err(|_| type_error("notice", "an 8-tuple", kind_and_value(item)))?;
            if t.len() != 8 {
                return Err(type_error("notice", "an 8-tuple", kind_and_value(item)));
            }
            let mut values = [0i64; 8];
            for (i, field) in Notice::FIELDS.iter().enumerate() {
                if i != 4 {
                    values[i] = args::int(&t.get_item(i)?, field)?;
                }
            }
            let last = args::flag(&t.get_item(4)?, "last")?;
            let [request_id, slice_id, start, end, _, epoch, group, groups] = values;
            out.push(Notice::new(
                request_id, slice_id, start, end, last, epoch, group, groups,
            ));
        }
        Ok(out)
    }
}

impl PyField for Vec<CudaTensor> {
    fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        let list = PyList::empty(py);
        for tensor in self {
            list.append(tensor.to_py(py)?)?;
        }
        Ok(list.into_any())
    }
    fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self> {
        let items: Vec<Bound<'_, PyAny>> = obj
            .extract()
            .map_err(|_| type_error(name, "a list of CUDA IPC layer dicts", kind_and_value(obj)))?;
        items
            .iter()
            .map(|item| CudaTensor::from_py(item, "CUDA IPC layer"))
            .collect()
    }
}

impl PyField for Vec<Region> {
    fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        let list = PyList::empty(py);
        for region in self {
            list.append(region.to_py(py)?)?;
        }
        Ok(list.into_any())
    }
    fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self> {
        let items: Vec<Bound<'_, PyAny>> = obj
            .extract()
            .map_err(|_| type_error(name, "a list of region dicts", kind_and_value(obj)))?;
        items
            .iter()
            .map(|item| Region::from_py(item, "region"))
            .collect()
    }
}

/// `kind -> field names` of every frame whose Python form is a dict of its record's fields
/// (all but the hello), for the Python dataclasses to be checked against.
pub fn frame_fields(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    let add =
        |kind: FrameType, fields: &[&str]| out.set_item(kind.name(), PyTuple::new(py, fields)?);
    add(FrameType::Challenge, wire::Challenge::FIELDS)?;
    add(FrameType::Proof, wire::Proof::FIELDS)?;
    add(FrameType::Notices, wire::Notices::FIELDS)?;
    add(FrameType::Announce, wire::Announce::FIELDS)?;
    add(FrameType::Revoke, wire::Revoke::FIELDS)?;
    add(FrameType::Cancel, wire::Cancel::FIELDS)?;
    add(FrameType::Staged, wire::Staged::FIELDS)?;
    add(FrameType::Freed, wire::Freed::FIELDS)?;
    add(FrameType::Agent, wire::Agent::FIELDS)?;
    add(FrameType::Goodbye, wire::Goodbye::FIELDS)?;
    add(FrameType::Lookup, rendezvous::Lookup::FIELDS)?;
    add(FrameType::Destination, rendezvous::Destination::FIELDS)?;
    add(FrameType::Refused, rendezvous::Refused::FIELDS)?;
    add(FrameType::Abandon, rendezvous::Abandon::FIELDS)?;
    add(FrameType::Abandoned, rendezvous::Abandoned::FIELDS)?;
    add(FrameType::Offer, rendezvous::Offer::FIELDS)?;
    add(FrameType::Accepted, rendezvous::Accepted::FIELDS)?;
    Ok(out)
}

/// Checks a 12-byte header against `limit`; returns `(type name, body length)`.
#[pyfunction]
pub fn wire_header(py: Python<'_>, header: &[u8], limit: u32) -> PyResult<(&'static str, u32)> {
    fence(|| {
        let h =
            wire::decode_header(header, limit).map_err(|e| wire_err(py, "invalid frame", &e))?;
        Ok((h.kind.name(), h.length))
    })
}

fn decode_as<'py, F: PyFrame>(
    py: Python<'py>,
    decode: fn(&[u8], u32) -> wire::Result<F>,
    frame: &[u8],
    limit: u32,
) -> PyResult<(&'static str, Bound<'py, PyAny>)> {
    fence(|| {
        decode(frame, limit)
            .map_err(|e| wire_err(py, "invalid frame", &e))?
            .to_py(py)
    })
}

fn encode_as<'py, F: PyFrame>(
    encode: fn(&F) -> wire::Result<Vec<u8>>,
    kind: &str,
    fields: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    let py = fields.py();
    fence(|| {
        let frame = F::from_py(kind, fields)?;
        let bytes = encode(&frame)
            .map_err(|e| wire_err(py, &format!("cannot encode this {kind} frame"), &e))?;
        Ok(PyBytes::new(py, &bytes))
    })
}

/// Decodes one whole frame of the transports' channel (header and body) of at most `limit`
/// body bytes.
#[pyfunction]
pub fn wire_decode<'py>(
    py: Python<'py>,
    frame: &[u8],
    limit: u32,
) -> PyResult<(&'static str, Bound<'py, PyAny>)> {
    decode_as(py, wire::decode, frame, limit)
}

/// Encodes `(kind, fields)` as one frame of the transports' channel, refusing what the
/// decoder would refuse.
#[pyfunction]
pub fn wire_encode<'py>(kind: &str, fields: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    encode_as(wire::encode, kind, fields)
}

/// `wire_decode` for the rendezvous's channel.
#[pyfunction]
pub fn rendezvous_decode<'py>(
    py: Python<'py>,
    frame: &[u8],
    limit: u32,
) -> PyResult<(&'static str, Bound<'py, PyAny>)> {
    decode_as(py, rendezvous::decode, frame, limit)
}

/// `wire_encode` for the rendezvous's channel.
#[pyfunction]
pub fn rendezvous_encode<'py>(
    kind: &str,
    fields: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    encode_as(rendezvous::encode, kind, fields)
}
