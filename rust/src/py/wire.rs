//! `kvferry._core.wire_*`: the frame codec of `crate::wire` for the Python transports.
//!
//! A frame is `(kind, value)` on the Python side, the same shape both ways (`wire_encode`
//! takes what `wire_decode` returns): notices as 8-tuples, block ids as int64 arrays, the
//! hello as a dict. One call per frame: a batch of notices crosses the boundary once.
//! The rendezvous's frames: a lookup as `(transfer, wait_ms, sender)`, a destination as a
//! dict (its `dst_blocks` a list, as the connector hands it on), a refusal as its text, an
//! abandon as `(transfer, reason)`, an abandoned as `None`.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use super::args::{self, kind_and_value};
use super::arrays;
use super::errors::{fence, type_error};
use crate::wire::{
    self, CudaTensor, Destination, Frame, Geometry, Hello, Lookup, MemType, Notice, PoolAccess,
    Segment, Staged, WireError, NONCE_BYTES,
};

type NoticeTuple = (i64, i64, i64, i64, bool, i64, i64, i64);

fn invalid(py: Python<'_>, message: String) -> PyErr {
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

/// A missing or ill-typed field of a value to encode: names the field.
fn field<'py, T: FromPyObjectOwned<'py>>(
    dict: &Bound<'py, PyDict>,
    key: &'static str,
    what: &str,
) -> PyResult<T> {
    let Some(value) = dict.get_item(key)? else {
        return Err(invalid(dict.py(), format!("invalid {what}: no {key:?}")));
    };
    value.extract::<T>().map_err(|_| {
        type_error(
            key,
            "of the wire type (an int in range, a str, bytes, a list)",
            kind_and_value(&value),
        )
    })
}

fn sub<'py>(
    dict: &Bound<'py, PyDict>,
    key: &'static str,
    what: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let Some(value) = dict.get_item(key)? else {
        return Err(invalid(dict.py(), format!("invalid {what}: no {key:?}")));
    };
    value
        .cast_into::<PyDict>()
        .map_err(|e| type_error(key, "a dict", kind_and_value(e.into_inner().as_any())))
}

fn notices_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Notice>> {
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
        .map_err(|_| type_error("notices", expected, kind_and_value(obj)))?;
    let mut out = Vec::with_capacity(items.len());
    for item in &items {
        let t = item
            .cast::<PyTuple>()
            .map_err(|_| type_error("notice", "an 8-tuple", kind_and_value(item)))?;
        if t.len() != 8 {
            return Err(type_error("notice", "an 8-tuple", kind_and_value(item)));
        }
        let v =
            |i: usize, name: &'static str| -> PyResult<i64> { args::int(&t.get_item(i)?, name) };
        out.push(Notice::new(
            v(0, "request_id")?,
            v(1, "slice_id")?,
            v(2, "start")?,
            v(3, "end")?,
            args::flag(&t.get_item(4)?, "last")?,
            v(5, "epoch")?,
            v(6, "group")?,
            v(7, "groups")?,
        ));
    }
    Ok(out)
}

fn ids_arg(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Vec<i64>> {
    let array = arrays::i64_vec(obj, name)?;
    Ok(arrays::slice(&array)?.to_vec())
}

fn leases_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<(i64, i64)>> {
    obj.extract().map_err(|_| {
        type_error(
            "leases",
            "a sequence of (request_id, epoch) int64 pairs",
            kind_and_value(obj),
        )
    })
}

fn segment_arg(dict: &Bound<'_, PyDict>, what: &str) -> PyResult<Segment> {
    Ok(Segment {
        name: field(dict, "name", what)?,
        num_layers: field(dict, "num_layers", what)?,
        shape: field(dict, "shape", what)?,
        dtype: field(dict, "dtype", what)?,
        tokens_per_block: field(dict, "tokens_per_block", what)?,
        block_dim: field(dict, "block_dim", what)?,
    })
}

fn hello_arg(obj: &Bound<'_, PyAny>) -> PyResult<Hello> {
    let dict = obj
        .cast::<PyDict>()
        .map_err(|_| type_error("hello", "a dict", kind_and_value(obj)))?;
    let geometry = sub(dict, "geometry", "hello")?;
    let g = Geometry {
        num_layers: field(&geometry, "num_layers", "geometry")?,
        tokens_per_block: field(&geometry, "tokens_per_block", "geometry")?,
        dtype: field(&geometry, "dtype", "geometry")?,
        segments: field(&geometry, "segments", "geometry")?,
        segment_bytes: field(&geometry, "segment_bytes", "geometry")?,
        num_blocks: field(dict, "num_blocks", "hello")?,
        block_dim: field(dict, "block_dim", "hello")?,
    };
    let kind: String = field(dict, "kind", "hello")?;
    let access = match kind.as_str() {
        "shm" => PoolAccess::Shm {
            segment: segment_arg(&sub(dict, "segment", "hello")?, "segment")?,
        },
        "staging" => PoolAccess::Staging {
            ring: segment_arg(&sub(dict, "segment", "hello")?, "segment")?,
            capacity: field(dict, "capacity", "hello")?,
        },
        "cuda_ipc" => {
            let layers: Vec<Bound<'_, PyDict>> = field(dict, "layers", "hello")?;
            let mut out = Vec::with_capacity(layers.len());
            for t in &layers {
                let what = "CUDA IPC layer";
                out.push(CudaTensor {
                    device: field(t, "device", what)?,
                    handle: field(t, "handle", what)?,
                    storage_size: field(t, "storage_size", what)?,
                    storage_offset: field(t, "storage_offset", what)?,
                    ref_counter_handle: field(t, "ref_counter_handle", what)?,
                    ref_counter_offset: field(t, "ref_counter_offset", what)?,
                    event_handle: field(t, "event_handle", what)?,
                    event_sync_required: field(t, "event_sync_required", what)?,
                    shape: field(t, "shape", what)?,
                    stride: field(t, "stride", what)?,
                    offset: field(t, "offset", what)?,
                    dtype: field(t, "dtype", what)?,
                });
            }
            PoolAccess::CudaIpc { layers: out }
        }
        "nixl" => PoolAccess::Nixl {
            agent_name: field(dict, "agent_name", "hello")?,
            metadata: field(dict, "agent_metadata", "hello")?,
            mem_type: match field::<String>(dict, "mem_type", "hello")?.as_str() {
                "DRAM" => MemType::Dram,
                "VRAM" => MemType::Vram,
                other => {
                    return Err(invalid(
                        dict.py(),
                        format!("invalid mem_type={other:?}: must be 'DRAM' or 'VRAM'"),
                    ))
                }
            },
            device: field(dict, "device", "hello")?,
            bases: field(dict, "bases", "hello")?,
        },
        other => {
            return Err(invalid(
                dict.py(),
                format!("invalid kind={other:?}: must be 'shm', 'staging', 'cuda_ipc' or 'nixl'"),
            ))
        }
    };
    Ok(Hello {
        geometry: g,
        access,
    })
}

fn pair<'py>(
    obj: &Bound<'py, PyAny>,
    what: &'static str,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
    let t = obj
        .cast::<PyTuple>()
        .map_err(|_| type_error(what, "a tuple", kind_and_value(obj)))?;
    if t.len() != 2 {
        return Err(type_error(what, "a 2-tuple", kind_and_value(obj)));
    }
    Ok((t.get_item(0)?, t.get_item(1)?))
}

fn staged_arg(value: &Bound<'_, PyAny>) -> PyResult<Staged> {
    let t = value
        .cast::<PyTuple>()
        .map_err(|_| type_error("staged", "a 5-tuple", kind_and_value(value)))?;
    if t.len() != 5 {
        return Err(type_error(
            "staged",
            "a 5-tuple (notices, lo, freed, picked, dst_ids)",
            kind_and_value(value),
        ));
    }
    let picked = t.get_item(3)?;
    Ok(Staged {
        notices: notices_arg(&t.get_item(0)?)?,
        lo: t.get_item(1)?.extract().map_err(|_| {
            type_error("lo", "an int >= 0", kind_and_value(&t.get_item(1).unwrap()))
        })?,
        freed: t.get_item(2)?.extract().map_err(|_| {
            type_error(
                "freed",
                "an int >= 0",
                kind_and_value(&t.get_item(2).unwrap()),
            )
        })?,
        picked: if picked.is_none() {
            None
        } else {
            Some(ids_arg(&picked, "picked")?)
        },
        dst_ids: ids_arg(&t.get_item(4)?, "dst_ids")?,
    })
}

fn destination_arg(obj: &Bound<'_, PyAny>) -> PyResult<Destination> {
    let dict = obj
        .cast::<PyDict>()
        .map_err(|_| type_error("destination", "a dict", kind_and_value(obj)))?;
    let what = "destination";
    let Some(dst) = dict.get_item("dst_blocks")? else {
        return Err(invalid(
            dict.py(),
            format!("invalid {what}: no \"dst_blocks\""),
        ));
    };
    Ok(Destination {
        request_id: field(dict, "request_id", what)?,
        epoch: field(dict, "epoch", what)?,
        prompt_len: field(dict, "prompt_len", what)?,
        block_size: field(dict, "block_size", what)?,
        held_blocks: field(dict, "held_blocks", what)?,
        dst_blocks: ids_arg(&dst, "dst_blocks")?,
        digest: field(dict, "digest", what)?,
        engine: field(dict, "engine", what)?,
        endpoint: field(dict, "endpoint", what)?,
    })
}

fn destination_out(py: Python<'_>, d: Destination) -> PyResult<Bound<'_, PyAny>> {
    let out = PyDict::new(py);
    out.set_item("request_id", d.request_id)?;
    out.set_item("epoch", d.epoch)?;
    out.set_item("prompt_len", d.prompt_len)?;
    out.set_item("block_size", d.block_size)?;
    out.set_item("held_blocks", d.held_blocks)?;
    out.set_item("dst_blocks", d.dst_blocks)?;
    out.set_item("digest", d.digest)?;
    out.set_item("engine", d.engine)?;
    out.set_item("endpoint", d.endpoint)?;
    Ok(out.into_any())
}

/// The rendezvous's frames (`None`: `kind` is not one of them).
fn rendezvous_arg(kind: &str, value: &Bound<'_, PyAny>) -> PyResult<Option<Frame>> {
    Ok(Some(match kind {
        "lookup" => {
            let (transfer, wait_ms, sender): (String, u32, String) =
                value.extract().map_err(|_| {
                    type_error(
                        "lookup",
                        "a (transfer: str, wait_ms: int in [0, 3600000], sender: str) tuple",
                        kind_and_value(value),
                    )
                })?;
            Frame::Lookup(Lookup {
                transfer,
                wait_ms,
                sender,
            })
        }
        "destination" => Frame::Destination(destination_arg(value)?),
        "refused" => Frame::Refused(
            value
                .extract()
                .map_err(|_| type_error("refused", "a str", kind_and_value(value)))?,
        ),
        "abandon" => {
            let (transfer, reason): (String, String) = value.extract().map_err(|_| {
                type_error(
                    "abandon",
                    "a (transfer: str, reason: str) pair",
                    kind_and_value(value),
                )
            })?;
            Frame::Abandon { transfer, reason }
        }
        "abandoned" => {
            if !value.is_none() {
                return Err(type_error(
                    "abandoned",
                    "None (the frame has no body)",
                    kind_and_value(value),
                ));
            }
            Frame::Abandoned
        }
        _ => return Ok(None),
    }))
}

fn frame_arg(kind: &str, value: &Bound<'_, PyAny>) -> PyResult<Frame> {
    let py = value.py();
    Ok(match kind {
        "challenge" => {
            let (role, nonce) = pair(value, "challenge")?;
            let nonce: Vec<u8> = nonce
                .extract()
                .map_err(|_| type_error("nonce", "bytes", kind_and_value(&nonce)))?;
            let nonce: [u8; NONCE_BYTES] = nonce.try_into().map_err(|n: Vec<u8>| {
                invalid(
                    py,
                    format!("invalid nonce: {} bytes, must be {NONCE_BYTES}", n.len()),
                )
            })?;
            Frame::Challenge {
                role: role
                    .extract()
                    .map_err(|_| type_error("role", "an int in [0, 255]", kind_and_value(&role)))?,
                nonce,
            }
        }
        "proof" => {
            let mac: Vec<u8> = value
                .extract()
                .map_err(|_| type_error("mac", "bytes", kind_and_value(value)))?;
            let mac: [u8; NONCE_BYTES] = mac.try_into().map_err(|m: Vec<u8>| {
                invalid(
                    py,
                    format!("invalid mac: {} bytes, must be {NONCE_BYTES}", m.len()),
                )
            })?;
            Frame::Proof { mac }
        }
        "hello" => Frame::Hello(hello_arg(value)?),
        "notices" => {
            let (notices, dst) = pair(value, "notices")?;
            Frame::Notices {
                notices: notices_arg(&notices)?,
                dst_ids: if dst.is_none() {
                    None
                } else {
                    Some(ids_arg(&dst, "dst_ids")?)
                },
            }
        }
        "announce" => Frame::Announce(leases_arg(value)?),
        "cancel" => Frame::Cancel(leases_arg(value)?),
        "revoke" => {
            let (r, e): (i64, i64) = value.extract().map_err(|_| {
                type_error(
                    "revoke",
                    "a (request_id, epoch) int64 pair",
                    kind_and_value(value),
                )
            })?;
            Frame::Revoke(r, e)
        }
        "staged" => Frame::Staged(staged_arg(value)?),
        "freed" => Frame::Freed(
            value
                .extract()
                .map_err(|_| type_error("freed", "an int >= 0", kind_and_value(value)))?,
        ),
        "agent" => Frame::Agent(
            value
                .extract()
                .map_err(|_| type_error("agent", "a str", kind_and_value(value)))?,
        ),
        "goodbye" => Frame::Goodbye(
            value
                .extract()
                .map_err(|_| type_error("goodbye", "a str", kind_and_value(value)))?,
        ),
        other => {
            if let Some(frame) = rendezvous_arg(other, value)? {
                return Ok(frame);
            }
            return Err(invalid(
                py,
                format!("invalid kind={other:?}: not a frame type"),
            ));
        }
    })
}

fn notices_out<'py>(py: Python<'py>, notices: &[Notice]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(
        py,
        notices.iter().map(|n| {
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
        }),
    )
}

fn ids_out(py: Python<'_>, ids: Vec<i64>) -> Bound<'_, PyAny> {
    PyArray1::from_vec(py, ids).into_any()
}

fn segment_out(py: Python<'_>, s: Segment) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("name", s.name)?;
    d.set_item("num_layers", s.num_layers)?;
    d.set_item("shape", s.shape)?;
    d.set_item("dtype", s.dtype)?;
    d.set_item("tokens_per_block", s.tokens_per_block)?;
    d.set_item("block_dim", s.block_dim)?;
    Ok(d)
}

fn hello_out(py: Python<'_>, hello: Hello) -> PyResult<Bound<'_, PyAny>> {
    let d = PyDict::new(py);
    let g = hello.geometry;
    let geometry = PyDict::new(py);
    geometry.set_item("num_layers", g.num_layers)?;
    geometry.set_item("tokens_per_block", g.tokens_per_block)?;
    geometry.set_item("dtype", g.dtype)?;
    geometry.set_item("segments", g.segments)?;
    geometry.set_item("segment_bytes", g.segment_bytes)?;
    d.set_item("geometry", geometry)?;
    d.set_item("num_blocks", g.num_blocks)?;
    d.set_item("block_dim", g.block_dim)?;
    match hello.access {
        PoolAccess::Shm { segment } => {
            d.set_item("kind", "shm")?;
            d.set_item("segment", segment_out(py, segment)?)?;
        }
        PoolAccess::Staging { ring, capacity } => {
            d.set_item("kind", "staging")?;
            d.set_item("segment", segment_out(py, ring)?)?;
            d.set_item("capacity", capacity)?;
        }
        PoolAccess::CudaIpc { layers } => {
            d.set_item("kind", "cuda_ipc")?;
            let out = PyList::empty(py);
            for t in layers {
                let l = PyDict::new(py);
                l.set_item("device", t.device)?;
                l.set_item("handle", PyBytes::new(py, &t.handle))?;
                l.set_item("storage_size", t.storage_size)?;
                l.set_item("storage_offset", t.storage_offset)?;
                l.set_item(
                    "ref_counter_handle",
                    PyBytes::new(py, &t.ref_counter_handle),
                )?;
                l.set_item("ref_counter_offset", t.ref_counter_offset)?;
                l.set_item("event_handle", PyBytes::new(py, &t.event_handle))?;
                l.set_item("event_sync_required", t.event_sync_required)?;
                l.set_item("shape", t.shape)?;
                l.set_item("stride", t.stride)?;
                l.set_item("offset", t.offset)?;
                l.set_item("dtype", t.dtype)?;
                out.append(l)?;
            }
            d.set_item("layers", out)?;
        }
        PoolAccess::Nixl {
            agent_name,
            metadata,
            mem_type,
            device,
            bases,
        } => {
            d.set_item("kind", "nixl")?;
            d.set_item("agent_name", agent_name)?;
            d.set_item("agent_metadata", PyBytes::new(py, &metadata))?;
            d.set_item(
                "mem_type",
                if mem_type == MemType::Vram {
                    "VRAM"
                } else {
                    "DRAM"
                },
            )?;
            d.set_item("device", device)?;
            d.set_item("bases", bases)?;
        }
    }
    Ok(d.into_any())
}

fn frame_out(py: Python<'_>, frame: Frame) -> PyResult<Bound<'_, PyAny>> {
    Ok(match frame {
        Frame::Challenge { role, nonce } => (role, PyBytes::new(py, &nonce))
            .into_pyobject(py)?
            .into_any(),
        Frame::Proof { mac } => PyBytes::new(py, &mac).into_any(),
        Frame::Hello(hello) => hello_out(py, hello)?,
        Frame::Notices { notices, dst_ids } => {
            let dst = match dst_ids {
                Some(ids) => ids_out(py, ids),
                None => py.None().into_bound(py),
            };
            (notices_out(py, &notices)?, dst)
                .into_pyobject(py)?
                .into_any()
        }
        Frame::Announce(leases) | Frame::Cancel(leases) => PyList::new(py, leases)?.into_any(),
        Frame::Revoke(r, e) => (r, e).into_pyobject(py)?.into_any(),
        Frame::Staged(s) => {
            let picked = match s.picked {
                Some(ids) => ids_out(py, ids),
                None => py.None().into_bound(py),
            };
            (
                notices_out(py, &s.notices)?,
                s.lo,
                s.freed,
                picked,
                ids_out(py, s.dst_ids),
            )
                .into_pyobject(py)?
                .into_any()
        }
        Frame::Freed(n) => n.into_pyobject(py)?.into_any(),
        Frame::Agent(name) | Frame::Goodbye(name) | Frame::Refused(name) => {
            name.into_pyobject(py)?.into_any()
        }
        Frame::Lookup(l) => (l.transfer, l.wait_ms, l.sender)
            .into_pyobject(py)?
            .into_any(),
        Frame::Destination(d) => destination_out(py, d)?,
        Frame::Abandon { transfer, reason } => (transfer, reason).into_pyobject(py)?.into_any(),
        Frame::Abandoned => py.None().into_bound(py),
    })
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

/// Decodes one whole frame (header and body) of at most `limit` body bytes.
#[pyfunction]
pub fn wire_decode<'py>(
    py: Python<'py>,
    frame: &[u8],
    limit: u32,
) -> PyResult<(&'static str, Bound<'py, PyAny>)> {
    fence(|| {
        let decoded = wire::decode(frame, limit).map_err(|e| wire_err(py, "invalid frame", &e))?;
        let kind = decoded.kind().name();
        Ok((kind, frame_out(py, decoded)?))
    })
}

/// Encodes `(kind, value)` as one frame, refusing what the decoder would refuse.
#[pyfunction]
pub fn wire_encode<'py>(
    py: Python<'py>,
    kind: &str,
    value: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyBytes>> {
    fence(|| {
        let frame = frame_arg(kind, value)?;
        let bytes = wire::encode(&frame)
            .map_err(|e| wire_err(py, &format!("cannot encode this {kind} frame"), &e))?;
        Ok(PyBytes::new(py, &bytes))
    })
}
