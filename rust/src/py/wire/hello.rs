//! The hello's Python form: one flat dict, as `kvferry.transports` builds and reads it.
//!
//! ```text
//! {"geometry": {num_layers, tokens_per_block, dtype, segments, segment_bytes, block_layout},
//!  "num_blocks", "block_dim", "kind": "shm" | "staging" | "cuda_ipc" | "nixl", and by kind:
//!  shm: "segment" (a Segment dict), "holder" (a Holder dict); staging: "segment" (the ring), "capacity";
//!  cuda_ipc: "layers" (CudaTensor dicts); nixl: "agent_name", "agent_metadata" (bytes),
//!  "mem_type" ("DRAM" | "VRAM"), "device", "bases", "segment_stride", "block_stride",
//!  "regions" (Region dicts: start, length)}
//! ```
//! The geometry's other keys (`PagedKV.geometry()` may carry more) are the pool's business
//! and are not sent.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::super::args::kind_and_value;
use super::super::errors::type_error;
use super::{invalid, required, PyField};
use crate::wire::{Geometry, Hello, MemType, PoolAccess};

fn dict<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, PyDict>> {
    obj.cast::<PyDict>()
        .cloned()
        .map_err(|_| type_error(name, "a dict", kind_and_value(obj)))
}

fn get<T: PyField>(dict: &Bound<'_, PyDict>, key: &'static str, what: &str) -> PyResult<T> {
    T::from_py(&required(dict, key, what)?, key)
}

impl PyField for Hello {
    fn to_py(self, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        let d = PyDict::new(py);
        let g = self.geometry;
        let geometry = PyDict::new(py);
        geometry.set_item("num_layers", g.num_layers)?;
        geometry.set_item("tokens_per_block", g.tokens_per_block)?;
        geometry.set_item("dtype", g.dtype)?;
        geometry.set_item("segments", g.segments)?;
        geometry.set_item("segment_bytes", g.segment_bytes)?;
        geometry.set_item("block_layout", g.block_layout)?;
        d.set_item("geometry", geometry)?;
        d.set_item("num_blocks", g.num_blocks)?;
        d.set_item("block_dim", g.block_dim)?;
        match self.access {
            PoolAccess::Shm { segment, holder } => {
                d.set_item("kind", "shm")?;
                d.set_item("segment", segment.to_py(py)?)?;
                d.set_item("holder", holder.to_py(py)?)?;
            }
            PoolAccess::Staging { ring, capacity } => {
                d.set_item("kind", "staging")?;
                d.set_item("segment", ring.to_py(py)?)?;
                d.set_item("capacity", capacity)?;
            }
            PoolAccess::CudaIpc { layers } => {
                d.set_item("kind", "cuda_ipc")?;
                d.set_item("layers", layers.to_py(py)?)?;
            }
            PoolAccess::Nixl {
                agent_name,
                metadata,
                mem_type,
                device,
                bases,
                segment_stride,
                block_stride,
                regions,
            } => {
                d.set_item("kind", "nixl")?;
                d.set_item("agent_name", agent_name)?;
                d.set_item("agent_metadata", metadata.to_py(py)?)?;
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
                d.set_item("segment_stride", segment_stride)?;
                d.set_item("block_stride", block_stride)?;
                d.set_item("regions", regions.to_py(py)?)?;
            }
        }
        Ok(d.into_any())
    }

    fn from_py(obj: &Bound<'_, PyAny>, name: &'static str) -> PyResult<Self> {
        let d = dict(obj, name)?;
        let geometry = dict(&required(&d, "geometry", "hello")?, "geometry")?;
        let g = Geometry {
            num_layers: get(&geometry, "num_layers", "geometry")?,
            tokens_per_block: get(&geometry, "tokens_per_block", "geometry")?,
            dtype: get(&geometry, "dtype", "geometry")?,
            segments: get(&geometry, "segments", "geometry")?,
            segment_bytes: get(&geometry, "segment_bytes", "geometry")?,
            num_blocks: get(&d, "num_blocks", "hello")?,
            block_dim: get(&d, "block_dim", "hello")?,
            block_layout: get(&geometry, "block_layout", "geometry")?,
        };
        let kind: String = get(&d, "kind", "hello")?;
        let access = match kind.as_str() {
            "shm" => PoolAccess::Shm {
                segment: get(&d, "segment", "hello")?,
                holder: get(&d, "holder", "hello")?,
            },
            "staging" => PoolAccess::Staging {
                ring: get(&d, "segment", "hello")?,
                capacity: get(&d, "capacity", "hello")?,
            },
            "cuda_ipc" => PoolAccess::CudaIpc {
                layers: get(&d, "layers", "hello")?,
            },
            "nixl" => PoolAccess::Nixl {
                agent_name: get(&d, "agent_name", "hello")?,
                metadata: get(&d, "agent_metadata", "hello")?,
                mem_type: match get::<String>(&d, "mem_type", "hello")?.as_str() {
                    "DRAM" => MemType::Dram,
                    "VRAM" => MemType::Vram,
                    other => {
                        let message =
                            format!("invalid mem_type={other:?}: must be 'DRAM' or 'VRAM'");
                        return Err(invalid(d.py(), message));
                    }
                },
                device: get(&d, "device", "hello")?,
                bases: get(&d, "bases", "hello")?,
                segment_stride: get(&d, "segment_stride", "hello")?,
                block_stride: get(&d, "block_stride", "hello")?,
                regions: get(&d, "regions", "hello")?,
            },
            other => {
                let message = format!(
                    "invalid kind={other:?}: must be 'shm', 'staging', 'cuda_ipc' or 'nixl'"
                );
                return Err(invalid(d.py(), message));
            }
        };
        Ok(Self {
            geometry: g,
            access,
        })
    }
}
