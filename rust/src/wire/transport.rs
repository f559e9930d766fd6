//! The transports' control channel: after the handshake, the receiver's hello (how to reach
//! its pool), then notices, announces, fences and staging batches from the sender, and
//! cancellations and staging frees back. A notice is eight `i64` (request, slice, start,
//! end, last (0 or 1), epoch, group, groups), 64 bytes; a lease is two `i64` (request,
//! epoch).

use super::check::{bound, check_covered, check_ids, check_name, check_sums};
use super::codec::{Reader, Writer};
use super::{
    decode_body_as, decode_frame, encode_frame, frame_set, record, Challenge, Check, FrameType,
    Goodbye, Proof, Record, Result, WireError, MAX_DIMS, MAX_HANDLE_BYTES, MAX_LAYERS, MAX_LEASES,
    MAX_METADATA_BYTES, MAX_NOTICES,
};

frame_set! {
    /// One frame of the transports' control channel.
    pub enum Frame for "transport channel" {
        Challenge, Proof, Hello, Notices, Announce, Revoke, Cancel, Staged, Freed, Agent, Goodbye,
    }
}

/// Decodes one whole frame (header and body, nothing after) of at most `limit` body bytes.
pub fn decode(bytes: &[u8], limit: u32) -> Result<Frame> {
    decode_frame(bytes, limit)
}

/// Decodes a body of type `kind` (its header already checked by [`super::decode_header`]).
pub fn decode_body(kind: FrameType, body: &[u8]) -> Result<Frame> {
    decode_body_as(kind, body)
}

/// Encodes a frame, refusing (as the decoder would) one that breaks a bound.
pub fn encode(frame: &Frame) -> Result<Vec<u8>> {
    encode_frame(frame)
}

record! {
    /// A completion notice (kvferry.notice.Notice), eight fixed-width values.
    #[derive(Copy)]
    pub struct Notice {
        /// The receiver's request id.
        request_id: i64 = i64(),
        /// The slice's index within the request.
        slice_id: i64 = i64(),
        /// First block.
        start: i64 = i64(),
        /// Past the last block.
        end: i64 = i64(),
        /// The request's last slice (an `i64`, 0 or 1, on the wire).
        last: bool = last(),
        /// The lease's epoch.
        epoch: i64 = i64(),
        /// The layer group written.
        group: i64 = i64(),
        /// Layer groups of the request.
        groups: i64 = i64(),
    }
}

impl Notice {
    /// A notice from its eight values, in wire order.
    #[allow(clippy::too_many_arguments, clippy::fn_params_excessive_bools)]
    pub fn new(
        request_id: i64,
        slice_id: i64,
        start: i64,
        end: i64,
        last: bool,
        epoch: i64,
        group: i64,
        groups: i64,
    ) -> Self {
        Self {
            request_id,
            slice_id,
            start,
            end,
            last,
            epoch,
            group,
            groups,
        }
    }
}

record! {
    /// A shared-memory segment holding a pool's layers back to back.
    pub struct Segment {
        /// The segment's name in `/dev/shm`.
        name: String = name(),
        /// Layers in it, in [1, 4096].
        num_layers: u32 = u32(),
        /// One layer's shape.
        shape: Vec<u64> = dims(),
        /// The element type.
        dtype: String = name(),
        /// Tokens per block (> 0).
        tokens_per_block: u32 = u32(),
        /// The shape's block dimension.
        block_dim: u32 = u32(),
    }
}

record! {
    /// Where a sender on the receiver's host opens a shared pool that has no name:
    /// `/proc/<pid>/fd/<fd>`, checked to be the segment of that inode. All zero: the
    /// descriptor itself comes with the hello (`SCM_RIGHTS` on a Unix socket).
    pub struct Holder {
        /// The receiver's process id.
        pid: u32 = u32(),
        /// The segment's descriptor in that process.
        fd: u32 = u32(),
        /// The segment's inode (what the opened file must be).
        inode: u64 = u64(),
    }
}

record! {
    /// The fields torch shares a CUDA tensor's storage by (`_share_cuda_`) and the view on it.
    pub struct CudaTensor {
        /// The GPU.
        device: u32 = u32(),
        /// The memory's IPC handle.
        handle: Vec<u8> = bytes(MAX_HANDLE_BYTES),
        /// Bytes of the storage.
        storage_size: u64 = u64(),
        /// The storage's offset in the allocation.
        storage_offset: u64 = u64(),
        /// The reference counter's shared-memory file.
        ref_counter_handle: Vec<u8> = bytes(MAX_HANDLE_BYTES),
        /// Its offset.
        ref_counter_offset: u64 = u64(),
        /// The event's IPC handle.
        event_handle: Vec<u8> = bytes(MAX_HANDLE_BYTES),
        /// Whether the event must be waited on.
        event_sync_required: bool = flag(),
        /// The view's shape.
        shape: Vec<u64> = dims(),
        /// The view's strides.
        stride: Vec<u64> = dims(),
        /// The view's offset in elements.
        offset: u64 = u64(),
        /// The element type.
        dtype: String = name(),
    }
}

record! {
    /// The receiver pool's layout (`PagedKV.geometry()`) and size.
    pub struct Geometry {
        /// Layers, in [1, 4096].
        num_layers: u32 = u32(),
        /// Tokens per block (> 0).
        tokens_per_block: u32 = u32(),
        /// The element type.
        dtype: String = name(),
        /// Segments per layer (> 0).
        segments: u32 = u32(),
        /// Bytes of one block of one segment.
        segment_bytes: u64 = u64(),
        /// Blocks in the pool.
        num_blocks: u64 = u64(),
        /// The layers' block dimension.
        block_dim: u32 = u32(),
        /// The order of one block's elements (`PagedKV.block_layout`, e.g. `H8.N16.C256`).
        block_layout: String = name(),
    }
}

record! {
    /// A span of memory a NIXL receiver registered: the sender checks that every descriptor
    /// it builds from the receiver's bases and strides lies inside one.
    #[derive(Copy)]
    pub struct Region {
        /// Its first byte's address.
        start: u64 = u64(),
        /// Its bytes (> 0).
        length: u64 = u64(),
    }
}

/// Where a NIXL sender writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemType {
    /// Host memory.
    Dram = 0,
    /// GPU memory.
    Vram = 1,
}

/// How the sender reaches the receiver's pool (a tag byte, then the variant's fields).
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum PoolAccess {
    /// Maps the pool's segment (named, or held by the receiver: `holder`) and writes into it.
    Shm { segment: Segment, holder: Holder },
    /// Writes into a staging ring of `capacity` blocks; the receiver copies into its pool.
    Staging { ring: Segment, capacity: u64 },
    /// Opens each layer from its CUDA IPC handle.
    CudaIpc { layers: Vec<CudaTensor> },
    /// Adds the receiver's NIXL agent and writes into its registered layers: block `b` of
    /// segment `s` of layer `l` at `bases[l] + s * segment_stride + b * block_stride`, inside
    /// one of `regions` (what the receiver registered).
    Nixl {
        agent_name: String,
        metadata: Vec<u8>,
        mem_type: MemType,
        device: u32,
        bases: Vec<u64>,
        segment_stride: u64,
        block_stride: u64,
        regions: Vec<Region>,
    },
}

impl Record for PoolAccess {
    const FIELDS: &'static [&'static str] = &["kind"];

    fn read(r: &mut Reader<'_>) -> Result<Self> {
        Ok(match r.u8("pool kind")? {
            0 => Self::Shm {
                segment: r.record("segment")?,
                holder: r.record("holder")?,
            },
            1 => Self::Staging {
                ring: r.record("ring")?,
                capacity: r.u64("capacity")?,
            },
            2 => Self::CudaIpc {
                layers: r.records("layers", MAX_LAYERS, 1)?,
            },
            3 => Self::Nixl {
                agent_name: r.name("agent_name")?,
                metadata: r.bytes("metadata", MAX_METADATA_BYTES)?,
                mem_type: match r.u8("mem_type")? {
                    0 => MemType::Dram,
                    1 => MemType::Vram,
                    other => {
                        return Err(WireError::field("mem_type", other, "0 (DRAM) or 1 (VRAM)"))
                    }
                },
                device: r.u32("device")?,
                bases: r.u64s("bases", MAX_LAYERS)?,
                segment_stride: r.u64("segment_stride")?,
                block_stride: r.u64("block_stride")?,
                regions: r.records("regions", MAX_LAYERS, 16)?,
            },
            other => {
                return Err(WireError::field(
                    "pool kind",
                    other,
                    "0 (shm), 1 (staging), 2 (CUDA IPC) or 3 (NIXL)",
                ))
            }
        })
    }

    fn write(&self, w: &mut Writer) {
        match self {
            Self::Shm { segment, holder } => {
                w.u8(&0);
                w.record(segment);
                w.record(holder);
            }
            Self::Staging { ring, capacity } => {
                w.u8(&1);
                w.record(ring);
                w.u64(capacity);
            }
            Self::CudaIpc { layers } => {
                w.u8(&2);
                w.records(layers);
            }
            Self::Nixl {
                agent_name,
                metadata,
                mem_type,
                device,
                bases,
                segment_stride,
                block_stride,
                regions,
            } => {
                w.u8(&3);
                w.name(agent_name);
                w.bytes(metadata);
                w.u8(&(*mem_type as u8));
                w.u32(device);
                w.u64s(bases);
                w.u64(segment_stride);
                w.u64(block_stride);
                w.records(regions);
            }
        }
    }
}

/// Everything a receiver tells its sender once both proved they hold the key (its Python
/// form is one flat dict: `py::wire` writes it by hand).
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct Hello {
    pub geometry: Geometry,
    pub access: PoolAccess,
}

impl Record for Hello {
    const FIELDS: &'static [&'static str] = &["geometry", "access"];

    fn read(r: &mut Reader<'_>) -> Result<Self> {
        Ok(Self {
            geometry: r.record("geometry")?,
            access: r.record("access")?,
        })
    }

    fn write(&self, w: &mut Writer) {
        w.record(&self.geometry);
        w.record(&self.access);
    }
}

record! {
    /// Notices, with the destination blocks the notices' writes used, in notice order (a
    /// transport that writes one-sidedly says which, so the receiver checks its lease).
    pub struct Notices {
        /// At most [`MAX_NOTICES`].
        notices: Vec<Notice> = records(MAX_NOTICES, 64),
        /// One id per block the notices cover, or none.
        dst_ids: Option<Vec<i64>> = opt_ids(),
        /// One checksum per block the notices cover (`crate::checksum`), or none.
        checksums: Option<Vec<u64>> = opt_sums(),
    }
}

record! {
    /// Requests a sender will send, `(request_id, epoch)`, before their notices.
    pub struct Announce {
        /// At most [`MAX_LEASES`].
        leases: Vec<(i64, i64)> = leases(MAX_LEASES),
    }
}

record! {
    /// A request's fence: its sender writes nothing more for this epoch.
    pub struct Revoke {
        /// The receiver's request id.
        request_id: i64 = i64(),
        /// The lease's epoch.
        epoch: i64 = i64(),
    }
}

record! {
    /// Requests the receiver gave up on, `(request_id, epoch)`.
    pub struct Cancel {
        /// At most [`MAX_LEASES`].
        leases: Vec<(i64, i64)> = leases(MAX_LEASES),
    }
}

record! {
    /// A staging-ring batch: ring slots from `lo` hold the blocks of `notices` in order (or
    /// more, of which those at `picked` go to `dst_ids`); `freed` slots are free afterwards.
    pub struct Staged {
        /// At most [`MAX_NOTICES`].
        notices: Vec<Notice> = records(MAX_NOTICES, 64),
        /// The batch's first ring slot.
        lo: u64 = u64(),
        /// Ring slots free once the batch is applied.
        freed: u64 = u64(),
        /// The ring positions that go, strictly increasing (none: all of them).
        picked: Option<Vec<i64>> = opt_ids(),
        /// One destination id per block the notices cover.
        dst_ids: Vec<i64> = ids(),
        /// One checksum per block the notices cover (`crate::checksum`), or none.
        checksums: Option<Vec<u64>> = opt_sums(),
    }
}

record! {
    /// Staging-ring slots the receiver freed.
    pub struct Freed {
        /// How many.
        freed: u64 = u64(),
    }
}

record! {
    /// The NIXL agent a sender writes with.
    pub struct Agent {
        /// Its name (1 to 128 characters of `[A-Za-z0-9._-]`).
        agent_name: String = name(),
    }
}

impl Check for Hello {
    fn check(&self) -> Result<()> {
        let g = &self.geometry;
        if g.num_layers == 0 || g.num_layers as usize > MAX_LAYERS {
            return Err(WireError::field("num_layers", g.num_layers, "in [1, 4096]"));
        }
        if g.tokens_per_block == 0 {
            return Err(WireError::field("tokens_per_block", 0, "> 0"));
        }
        if g.segments == 0 {
            return Err(WireError::field("segments", 0, "> 0"));
        }
        check_name("dtype", &g.dtype)?;
        match &self.access {
            PoolAccess::Shm { segment, .. } => check_segment("segment", segment),
            PoolAccess::Staging { ring, capacity } => {
                check_segment("ring", ring)?;
                if *capacity == 0 {
                    return Err(WireError::field("capacity", 0, "> 0"));
                }
                Ok(())
            }
            PoolAccess::CudaIpc { layers } => {
                if layers.len() != g.num_layers as usize {
                    let count = format!("<{} layers>", layers.len());
                    return Err(WireError::field(
                        "layers",
                        count,
                        "one per layer of the geometry",
                    ));
                }
                layers.iter().try_for_each(check_tensor)
            }
            PoolAccess::Nixl {
                agent_name,
                metadata,
                bases,
                segment_stride,
                block_stride,
                regions,
                ..
            } => {
                check_name("agent_name", agent_name)?;
                bound("metadata", metadata.len(), MAX_METADATA_BYTES)?;
                if bases.len() != g.num_layers as usize {
                    let count = format!("<{} addresses>", bases.len());
                    return Err(WireError::field(
                        "bases",
                        count,
                        "one per layer of the geometry",
                    ));
                }
                // Whether the strides place the blocks inside `regions`, and apart from one
                // another, is the sender's check (kvferry.transports.nixl): it needs the
                // geometry's numbers together, not one field at a time.
                if *segment_stride == 0 {
                    return Err(WireError::field("segment_stride", 0, "> 0"));
                }
                if *block_stride == 0 {
                    return Err(WireError::field("block_stride", 0, "> 0"));
                }
                bound("regions", regions.len(), MAX_LAYERS)?;
                if regions.is_empty() {
                    return Err(WireError::field("regions", "<0 regions>", "at least one"));
                }
                for region in regions {
                    if region.length == 0 || region.start.checked_add(region.length).is_none() {
                        let span = format!("({}, {})", region.start, region.length);
                        return Err(WireError::field(
                            "regions",
                            span,
                            "non-empty spans within the 64-bit address space",
                        ));
                    }
                }
                Ok(())
            }
        }
    }
}

fn check_shape(field: &'static str, dims: &[u64]) -> Result<()> {
    if dims.is_empty() || dims.len() > MAX_DIMS {
        return Err(WireError::field(
            field,
            format!("<{} dims>", dims.len()),
            "1 to 8 dimensions",
        ));
    }
    if dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .is_none()
    {
        return Err(WireError::field(
            field,
            format!("{dims:?}"),
            "a shape whose element count fits in 64 bits",
        ));
    }
    Ok(())
}

fn check_segment(field: &'static str, s: &Segment) -> Result<()> {
    check_name(field, &s.name)?;
    check_name("dtype", &s.dtype)?;
    check_shape("shape", &s.shape)?;
    if s.num_layers == 0 || s.num_layers as usize > MAX_LAYERS {
        return Err(WireError::field("num_layers", s.num_layers, "in [1, 4096]"));
    }
    if s.tokens_per_block == 0 {
        return Err(WireError::field("tokens_per_block", 0, "> 0"));
    }
    if s.block_dim as usize >= s.shape.len() {
        return Err(WireError::field(
            "block_dim",
            s.block_dim,
            "a dimension of the shape",
        ));
    }
    Ok(())
}

fn check_tensor(t: &CudaTensor) -> Result<()> {
    check_shape("shape", &t.shape)?;
    if t.stride.len() != t.shape.len() {
        return Err(WireError::field(
            "stride",
            format!("{:?}", t.stride),
            "one stride per dimension",
        ));
    }
    check_name("dtype", &t.dtype)?;
    for (field, handle) in [
        ("handle", &t.handle),
        ("ref_counter_handle", &t.ref_counter_handle),
        ("event_handle", &t.event_handle),
    ] {
        bound(field, handle.len(), MAX_HANDLE_BYTES)?;
    }
    Ok(())
}

impl Check for Notices {
    fn check(&self) -> Result<()> {
        bound("notices", self.notices.len(), MAX_NOTICES)?;
        if let Some(ids) = &self.dst_ids {
            check_covered("dst_ids", &self.notices, ids)?;
        }
        check_sums(&self.notices, self.checksums.as_deref())
    }
}

impl Check for Announce {
    fn check(&self) -> Result<()> {
        bound("leases", self.leases.len(), MAX_LEASES)
    }
}

impl Check for Cancel {
    fn check(&self) -> Result<()> {
        bound("leases", self.leases.len(), MAX_LEASES)
    }
}

impl Check for Revoke {}

impl Check for Freed {}

impl Check for Agent {
    fn check(&self) -> Result<()> {
        check_name("agent_name", &self.agent_name)
    }
}

impl Check for Staged {
    fn check(&self) -> Result<()> {
        bound("notices", self.notices.len(), MAX_NOTICES)?;
        check_covered("dst_ids", &self.notices, &self.dst_ids)?;
        check_sums(&self.notices, self.checksums.as_deref())?;
        if let Some(picked) = &self.picked {
            check_ids("picked", picked)?;
            if picked.len() != self.dst_ids.len() {
                return Err(WireError::field(
                    "picked",
                    format!("<{} ids>", picked.len()),
                    "as many as dst_ids",
                ));
            }
            if picked.windows(2).any(|w| w[0] >= w[1]) {
                return Err(WireError::field(
                    "picked",
                    "<not increasing>",
                    "strictly increasing ring positions",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{decode_header, HEADER_BYTES, MAX_FRAME_BYTES, MAX_REASON_BYTES, VERSION};
    use super::*;

    fn notices_frame() -> Frame {
        Frame::Notices(Notices {
            notices: vec![
                Notice::new(1, 0, 0, 2, false, 3, 0, 1),
                Notice::new(1, 1, 2, 3, true, 3, 1, 2),
            ],
            dst_ids: Some(vec![9, 4, 7]),
            checksums: Some(vec![u64::MAX, 0, 1 << 63]),
        })
    }

    #[test]
    fn header_fields_are_checked_in_order() {
        let mut bytes = encode(&notices_frame()).unwrap();
        assert!(decode(&bytes, MAX_FRAME_BYTES).is_ok());
        let version = VERSION as u8;
        bytes[4] = version + 1;
        assert_eq!(
            decode(&bytes, MAX_FRAME_BYTES),
            Err(WireError::Version(VERSION + 1))
        );
        bytes[4] = version;
        bytes[6] = 99;
        assert_eq!(
            decode(&bytes, MAX_FRAME_BYTES),
            Err(WireError::UnknownType(99))
        );
        bytes[6] = 4;
        assert!(matches!(
            decode(&bytes, 16),
            Err(WireError::TooLong { limit: 16, .. })
        ));
        bytes[0] = b'X';
        assert!(matches!(
            decode(&bytes, MAX_FRAME_BYTES),
            Err(WireError::Magic(_))
        ));
    }

    #[test]
    fn dst_ids_must_cover_the_notices() {
        let frame = Frame::Notices(Notices {
            notices: vec![Notice::new(1, 0, 0, 2, false, 3, 0, 1)],
            dst_ids: Some(vec![1]),
            checksums: None,
        });
        assert!(matches!(
            encode(&frame),
            Err(WireError::Field {
                field: "dst_ids",
                ..
            })
        ));
    }

    #[test]
    fn checksums_must_cover_the_notices() {
        let notices = vec![Notice::new(1, 0, 0, 2, false, 3, 0, 1)];
        let short = Frame::Notices(Notices {
            notices: notices.clone(),
            dst_ids: Some(vec![1, 2]),
            checksums: Some(vec![5]),
        });
        let staged = Frame::Staged(Staged {
            notices,
            lo: 0,
            freed: 0,
            picked: None,
            dst_ids: vec![1, 2],
            checksums: Some(vec![5, 6, 7]),
        });
        for frame in [short, staged] {
            assert!(matches!(
                encode(&frame),
                Err(WireError::Field {
                    field: "checksums",
                    ..
                })
            ));
        }
        // And a decoder given such bytes (encoded by hand) refuses them too.
        let good = notices_frame();
        let mut bytes = encode(&good).unwrap();
        let n = bytes.len();
        bytes.truncate(n - 8); // drop the last checksum and say there are two
        let count_at = n - 3 * 8 - 4; // the count before three checksums
        bytes[count_at..count_at + 4].copy_from_slice(&2u32.to_le_bytes());
        let len = (bytes.len() - HEADER_BYTES) as u32;
        bytes[8..12].copy_from_slice(&len.to_le_bytes());
        assert!(matches!(
            decode(&bytes, MAX_FRAME_BYTES),
            Err(WireError::Field {
                field: "checksums",
                ..
            })
        ));
    }

    #[test]
    fn the_encoder_refuses_what_the_decoder_would() {
        let long = Frame::Goodbye(Goodbye {
            reason: "x".repeat(MAX_REASON_BYTES + 1),
        });
        assert!(matches!(
            encode(&long),
            Err(WireError::Field {
                field: "reason",
                ..
            })
        ));
        let many = Frame::Announce(Announce {
            leases: vec![(0, 0); MAX_LEASES + 1],
        });
        assert!(matches!(
            encode(&many),
            Err(WireError::Field {
                field: "leases",
                ..
            })
        ));
    }

    #[test]
    fn a_count_larger_than_the_body_is_refused_before_allocating() {
        let mut bytes = encode(&Frame::Announce(Announce {
            leases: vec![(1, 1)],
        }))
        .unwrap();
        bytes[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&bytes, MAX_FRAME_BYTES).is_err());
    }

    #[test]
    fn a_frame_of_the_rendezvous_is_not_the_transport_channels() {
        let bytes = super::super::rendezvous::encode(&super::super::rendezvous::Frame::Abandoned(
            super::super::rendezvous::Abandoned { call: 1 },
        ))
        .unwrap();
        assert_eq!(
            decode_header(&bytes, MAX_FRAME_BYTES).unwrap().kind,
            FrameType::Abandoned
        );
        assert_eq!(
            decode(&bytes, MAX_FRAME_BYTES),
            Err(WireError::NotInSet {
                kind: "abandoned",
                set: "transport channel"
            })
        );
        assert_eq!(bytes.len(), HEADER_BYTES + 4); // its call
    }

    fn nixl_hello(segment_stride: u64, block_stride: u64, regions: Vec<Region>) -> Frame {
        Frame::Hello(Hello {
            geometry: Geometry {
                num_layers: 1,
                tokens_per_block: 16,
                dtype: "bf16".to_string(),
                segments: 2,
                segment_bytes: 64,
                num_blocks: 8,
                block_dim: 1,
                block_layout: "any".to_string(),
            },
            access: PoolAccess::Nixl {
                agent_name: "rx".to_string(),
                metadata: vec![1, 2, 3],
                mem_type: MemType::Dram,
                device: 0,
                bases: vec![4096],
                segment_stride,
                block_stride,
                regions,
            },
        })
    }

    #[test]
    fn a_nixl_hello_needs_strides_and_regions() {
        let region = |start, length| Region { start, length };
        let good = nixl_hello(512, 64, vec![region(4096, 1024)]);
        let bytes = encode(&good).unwrap();
        assert_eq!(decode(&bytes, MAX_FRAME_BYTES), Ok(good));
        for (frame, field) in [
            (
                nixl_hello(0, 64, vec![region(4096, 1024)]),
                "segment_stride",
            ),
            (nixl_hello(512, 0, vec![region(4096, 1024)]), "block_stride"),
            (nixl_hello(512, 64, vec![]), "regions"),
            (nixl_hello(512, 64, vec![region(4096, 0)]), "regions"),
            (nixl_hello(512, 64, vec![region(u64::MAX, 2)]), "regions"),
        ] {
            assert!(
                matches!(encode(&frame), Err(WireError::Field { field: f, .. }) if f == field),
                "{field}: {:?}",
                encode(&frame)
            );
        }
    }

    #[test]
    fn the_records_list_their_fields_in_wire_order() {
        assert_eq!(
            Notice::FIELDS,
            [
                "request_id",
                "slice_id",
                "start",
                "end",
                "last",
                "epoch",
                "group",
                "groups"
            ]
        );
        assert_eq!(
            Staged::FIELDS,
            ["notices", "lo", "freed", "picked", "dst_ids", "checksums"]
        );
        assert_eq!(Notices::FIELDS, ["notices", "dst_ids", "checksums"]);
    }
}
