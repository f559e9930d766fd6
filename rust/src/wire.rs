//! The control-plane wire format: versioned, length-prefixed binary frames. Nothing on the
//! wire is ever a serialized object; every field has a fixed width or a bounded length, and
//! [`decode`] checks every one before the caller sees the frame.
//!
//! ```text
//! header (12 bytes, little-endian)        body (length bytes, by type)
//! +------+---------+------+--------+      +-------------------------------------------+
//! | KVFW | version | type | length |      | fixed-width fields; lists as u32 count +  |
//! |  4   |   u16   | u16  |  u32   |      | items; bytes/strings as u32 length + data |
//! +------+---------+------+--------+      +-------------------------------------------+
//! ```
//! A notice is eight `i64` (request, slice, start, end, last (0 or 1), epoch, group,
//! groups), 64 bytes; a lease is two `i64` (request, epoch). The vLLM connector's
//! rendezvous (`kvferry.vllm.rendezvous`) speaks five more: a lookup (transfer id, wait in
//! milliseconds, the prefill engine's id), answered by a destination (request id, epoch,
//! prompt length, block size, held blocks, destination block ids, prompt digest, decode
//! engine id, endpoint URL) or a refusal (why); an abandon (transfer id, reason), answered
//! by an abandoned (no body). The codec checks structure
//! (magic, version, type, length against the caller's limit, counts against the bounds
//! below, flags, enums, string characters, no trailing bytes); the receiver checks meaning
//! (a notice against its request's ledger and lease).
//!
//! ```
//! use kvferry::wire::{decode, encode, Frame, Notice, MAX_FRAME_BYTES};
//!
//! let frame = Frame::Notices { notices: vec![Notice::new(7, 0, 0, 4, true, 1, 0, 1)], dst_ids: Some(vec![3, 4, 5, 6]) };
//! let bytes = encode(&frame)?;
//! assert_eq!(decode(&bytes, MAX_FRAME_BYTES)?, frame);
//! assert!(decode(&bytes[..bytes.len() - 1], MAX_FRAME_BYTES).is_err()); // truncated
//! # Ok::<(), kvferry::wire::WireError>(())
//! ```

use std::fmt;

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"KVFW";
/// The version this codec speaks; a frame of any other version is refused.
pub const VERSION: u16 = 1;
/// Bytes in a frame header.
pub const HEADER_BYTES: usize = 12;
/// The largest body a frame may carry (a caller may set a lower limit per connection).
pub const MAX_FRAME_BYTES: u32 = 32 << 20;
/// The most block ids in one list of a frame.
pub const MAX_IDS: usize = 1 << 20;
/// The most notices in one frame.
pub const MAX_NOTICES: usize = 1 << 16;
/// The most leases (announces, cancellations) in one frame.
pub const MAX_LEASES: usize = 1 << 16;
/// The most layers a hello describes.
pub const MAX_LAYERS: usize = 4096;
/// The most dimensions of a tensor shape.
pub const MAX_DIMS: usize = 8;
/// The longest name (segment, agent, dtype) in bytes.
pub const MAX_NAME_BYTES: usize = 128;
/// The most bytes of NIXL agent metadata (opaque to kvferry, handed to NIXL as it came).
pub const MAX_METADATA_BYTES: usize = 1 << 20;
/// The most bytes of a CUDA IPC handle field (memory and event handles are 64 bytes; the
/// reference counter's handle is a shared-memory file name).
pub const MAX_HANDLE_BYTES: usize = 256;
/// The longest reason a goodbye carries.
pub const MAX_REASON_BYTES: usize = 1024;
/// Bytes of a handshake nonce and of a proof (HMAC-SHA256).
pub const NONCE_BYTES: usize = 32;
/// The longest transfer id (the connector takes at most 256 characters, 4 bytes each in
/// UTF-8 at most).
pub const MAX_TRANSFER_BYTES: usize = 1024;
/// The longest wait a lookup may ask for, in milliseconds (an hour).
pub const MAX_WAIT_MS: u32 = 3_600_000;
/// The longest endpoint URL a destination names.
pub const MAX_URL_BYTES: usize = 1024;
/// The longest prompt digest (hex digits) a destination carries.
pub const MAX_DIGEST_BYTES: usize = 64;
/// The longest refusal a rendezvous answers with (it names the transfer and a reason).
pub const MAX_ERROR_BYTES: usize = 4096;

/// Everything the codec refuses; the message says which field and what it held.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not a kvferry frame.
    #[error("bad magic {0:02x?}: not a kvferry frame (expected KVFW)")]
    Magic([u8; 4]),
    /// A version this side does not speak.
    #[error("unsupported wire version {0} (this side speaks {VERSION})")]
    Version(u16),
    /// A type this version does not define.
    #[error("unknown frame type {0}")]
    UnknownType(u16),
    /// A length past the connection's limit.
    #[error("frame of {length} bytes exceeds the limit of {limit}")]
    TooLong {
        /// The length the header announced.
        length: u64,
        /// The limit it was checked against.
        limit: u64,
    },
    /// The frame ended before a field.
    #[error("truncated frame: {what} needs {need} bytes, {left} left")]
    Truncated {
        /// The field being read.
        what: &'static str,
        /// Bytes it needs.
        need: usize,
        /// Bytes left.
        left: usize,
    },
    /// Bytes after the last field.
    #[error("{0} trailing bytes after the {1} frame's fields")]
    Trailing(usize, &'static str),
    /// A field outside its domain.
    #[error("invalid {field}={value}: must be {expected}")]
    Field {
        /// The field's name.
        field: &'static str,
        /// What it held.
        value: String,
        /// What it must be.
        expected: &'static str,
    },
}

impl WireError {
    fn field(field: &'static str, value: impl fmt::Display, expected: &'static str) -> Self {
        Self::Field {
            field,
            value: value.to_string(),
            expected,
        }
    }
}

/// Shorthand.
pub type Result<T> = std::result::Result<T, WireError>;

/// Frame types. The numbers are the wire's; they never change meaning within a version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum FrameType {
    /// Handshake: a role and a fresh nonce.
    Challenge = 1,
    /// Handshake: an HMAC-SHA256 over both nonces.
    Proof = 2,
    /// Receiver to sender: the pool's geometry and how to reach it.
    Hello = 3,
    /// Sender to receiver: notices, with the destination ids their writes used.
    Notices = 4,
    /// Sender to receiver: requests it will send, before their notices.
    Announce = 5,
    /// Sender to receiver: a request's fence.
    Revoke = 6,
    /// Receiver to sender: requests the receiver gave up on.
    Cancel = 7,
    /// Sender to receiver: a staging-ring batch.
    Staged = 8,
    /// Receiver to sender: staging-ring slots freed.
    Freed = 9,
    /// Sender to receiver: the NIXL agent it writes with.
    Agent = 10,
    /// Either way: why the connection is about to close.
    Goodbye = 11,
    /// Prefill side to the rendezvous: the destination of a transfer, please.
    Lookup = 12,
    /// Rendezvous to the prefill side: where a looked-up transfer's blocks go.
    Destination = 13,
    /// Rendezvous to the prefill side: why a lookup gets no destination.
    Refused = 14,
    /// Prefill side to the rendezvous: it gave a transfer up.
    Abandon = 15,
    /// Rendezvous to the prefill side: the abandon is recorded.
    Abandoned = 16,
}

impl FrameType {
    /// The type of wire number `value`.
    pub fn from_u16(value: u16) -> Result<Self> {
        Ok(match value {
            1 => Self::Challenge,
            2 => Self::Proof,
            3 => Self::Hello,
            4 => Self::Notices,
            5 => Self::Announce,
            6 => Self::Revoke,
            7 => Self::Cancel,
            8 => Self::Staged,
            9 => Self::Freed,
            10 => Self::Agent,
            11 => Self::Goodbye,
            12 => Self::Lookup,
            13 => Self::Destination,
            14 => Self::Refused,
            15 => Self::Abandon,
            16 => Self::Abandoned,
            other => return Err(WireError::UnknownType(other)),
        })
    }

    /// The lower-case name Python sees.
    pub fn name(self) -> &'static str {
        match self {
            Self::Challenge => "challenge",
            Self::Proof => "proof",
            Self::Hello => "hello",
            Self::Notices => "notices",
            Self::Announce => "announce",
            Self::Revoke => "revoke",
            Self::Cancel => "cancel",
            Self::Staged => "staged",
            Self::Freed => "freed",
            Self::Agent => "agent",
            Self::Goodbye => "goodbye",
            Self::Lookup => "lookup",
            Self::Destination => "destination",
            Self::Refused => "refused",
            Self::Abandon => "abandon",
            Self::Abandoned => "abandoned",
        }
    }
}

/// A completion notice (kvferry.notice.Notice), eight fixed-width values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs, clippy::struct_excessive_bools)]
pub struct Notice {
    pub request_id: i64,
    pub slice_id: i64,
    pub start: i64,
    pub end: i64,
    pub last: bool,
    pub epoch: i64,
    pub group: i64,
    pub groups: i64,
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

/// A shared-memory segment holding a pool's layers back to back.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct Segment {
    pub name: String,
    pub num_layers: u32,
    pub shape: Vec<u64>,
    pub dtype: String,
    pub tokens_per_block: u32,
    pub block_dim: u32,
}

/// The fields torch shares a CUDA tensor's storage by (`_share_cuda_`) and the view on it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct CudaTensor {
    pub device: u32,
    pub handle: Vec<u8>,
    pub storage_size: u64,
    pub storage_offset: u64,
    pub ref_counter_handle: Vec<u8>,
    pub ref_counter_offset: u64,
    pub event_handle: Vec<u8>,
    pub event_sync_required: bool,
    pub shape: Vec<u64>,
    pub stride: Vec<u64>,
    pub offset: u64,
    pub dtype: String,
}

/// Where a NIXL sender writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemType {
    /// Host memory.
    Dram = 0,
    /// GPU memory.
    Vram = 1,
}

/// How the sender reaches the receiver's pool.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum PoolAccess {
    /// Maps the pool's segment and writes into it.
    Shm { segment: Segment },
    /// Writes into a staging ring of `capacity` blocks; the receiver copies into its pool.
    Staging { ring: Segment, capacity: u64 },
    /// Opens each layer from its CUDA IPC handle.
    CudaIpc { layers: Vec<CudaTensor> },
    /// Adds the receiver's NIXL agent and writes into its registered layers.
    Nixl {
        agent_name: String,
        metadata: Vec<u8>,
        mem_type: MemType,
        device: u32,
        bases: Vec<u64>,
    },
}

/// The receiver pool's layout (`PagedKV.geometry()`) and size.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct Geometry {
    pub num_layers: u32,
    pub tokens_per_block: u32,
    pub dtype: String,
    pub segments: u32,
    pub segment_bytes: u64,
    pub num_blocks: u64,
    pub block_dim: u32,
}

/// Everything a receiver tells its sender once both proved they hold the key.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct Hello {
    pub geometry: Geometry,
    pub access: PoolAccess,
}

/// A staging-ring batch: ring slots from `lo` hold the blocks of `notices` in order (or
/// more, of which those at `picked` go to `dst_ids`); `freed` slots are free afterwards.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct Staged {
    pub notices: Vec<Notice>,
    pub lo: u64,
    pub freed: u64,
    pub picked: Option<Vec<i64>>,
    pub dst_ids: Vec<i64>,
}

/// A prefill request asking the decode server's rendezvous for its transfer's destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    /// The transfer id both halves of the request carry (1 to 1024 bytes of UTF-8).
    pub transfer: String,
    /// How long the rendezvous may wait for the decode request to publish it (at most
    /// [`MAX_WAIT_MS`]).
    pub wait_ms: u32,
    /// The prefill engine's id (1 to 128 bytes of UTF-8): each gets an endpoint of its own.
    pub sender: String,
}

/// Where a transfer's blocks go: what the decode worker published, and the URL of the
/// endpoint the looking-up prefill engine sends to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    /// The receiver's id of the request (>= 0).
    pub request_id: i64,
    /// The epoch of its lease (>= 0).
    pub epoch: i64,
    /// Tokens of the prompt (>= 0).
    pub prompt_len: i64,
    /// Tokens per block on the decode server (> 0).
    pub block_size: u32,
    /// Leading destination blocks the decode server already holds (at most `dst_blocks`).
    pub held_blocks: i64,
    /// The decode server's block ids, in prompt order (>= 0, at most [`MAX_IDS`]).
    pub dst_blocks: Vec<i64>,
    /// The prompt's digest: lower-case hex digits, 1 to [`MAX_DIGEST_BYTES`].
    pub digest: String,
    /// The decode engine's id (a name: [A-Za-z0-9._-], 1 to 128 bytes).
    pub engine: String,
    /// The endpoint's URL (1 to [`MAX_URL_BYTES`] of UTF-8, no control characters).
    pub endpoint: String,
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum Frame {
    Challenge {
        role: u8,
        nonce: [u8; NONCE_BYTES],
    },
    Proof {
        mac: [u8; NONCE_BYTES],
    },
    Hello(Hello),
    /// `dst_ids`: the destination blocks the notices' writes used, in notice order (a
    /// transport that writes one-sidedly says which, so the receiver checks its lease).
    Notices {
        notices: Vec<Notice>,
        dst_ids: Option<Vec<i64>>,
    },
    Announce(Vec<(i64, i64)>),
    Revoke(i64, i64),
    Cancel(Vec<(i64, i64)>),
    Staged(Staged),
    Freed(u64),
    Agent(String),
    Goodbye(String),
    Lookup(Lookup),
    Destination(Destination),
    /// Why a lookup gets no destination (1 to [`MAX_ERROR_BYTES`] of UTF-8).
    Refused(String),
    /// A transfer the prefill side gave up, and why (at most [`MAX_REASON_BYTES`]).
    Abandon {
        transfer: String,
        reason: String,
    },
    Abandoned,
}

impl Frame {
    /// The frame's type.
    pub fn kind(&self) -> FrameType {
        match self {
            Self::Challenge { .. } => FrameType::Challenge,
            Self::Proof { .. } => FrameType::Proof,
            Self::Hello(_) => FrameType::Hello,
            Self::Notices { .. } => FrameType::Notices,
            Self::Announce(_) => FrameType::Announce,
            Self::Revoke(..) => FrameType::Revoke,
            Self::Cancel(_) => FrameType::Cancel,
            Self::Staged(_) => FrameType::Staged,
            Self::Freed(_) => FrameType::Freed,
            Self::Agent(_) => FrameType::Agent,
            Self::Goodbye(_) => FrameType::Goodbye,
            Self::Lookup(_) => FrameType::Lookup,
            Self::Destination(_) => FrameType::Destination,
            Self::Refused(_) => FrameType::Refused,
            Self::Abandon { .. } => FrameType::Abandon,
            Self::Abandoned => FrameType::Abandoned,
        }
    }
}

/// A validated header: the frame's type and body length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The frame's type.
    pub kind: FrameType,
    /// Bytes of body that follow.
    pub length: u32,
}

/// Checks a header: magic, version, a known type, a length within `limit` (and within
/// [`MAX_FRAME_BYTES`]). A caller reads exactly `length` more bytes only after this.
pub fn decode_header(bytes: &[u8], limit: u32) -> Result<Header> {
    if bytes.len() < HEADER_BYTES {
        return Err(WireError::Truncated {
            what: "header",
            need: HEADER_BYTES,
            left: bytes.len(),
        });
    }
    let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
    if magic != MAGIC {
        return Err(WireError::Magic(magic));
    }
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    if version != VERSION {
        return Err(WireError::Version(version));
    }
    let kind = FrameType::from_u16(u16::from_le_bytes([bytes[6], bytes[7]]))?;
    let length = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    let limit = limit.min(MAX_FRAME_BYTES);
    if length > limit {
        return Err(WireError::TooLong {
            length: u64::from(length),
            limit: u64::from(limit),
        });
    }
    Ok(Header { kind, length })
}

/// Decodes one whole frame (header and body, nothing after) of at most `limit` body bytes.
pub fn decode(bytes: &[u8], limit: u32) -> Result<Frame> {
    let header = decode_header(bytes, limit)?;
    let body = &bytes[HEADER_BYTES..];
    if body.len() != header.length as usize {
        if body.len() < header.length as usize {
            return Err(WireError::Truncated {
                what: "body",
                need: header.length as usize,
                left: body.len(),
            });
        }
        return Err(WireError::Trailing(
            body.len() - header.length as usize,
            header.kind.name(),
        ));
    }
    decode_body(header.kind, body)
}

/// Decodes a body of type `kind` (its header already checked by [`decode_header`]).
pub fn decode_body(kind: FrameType, body: &[u8]) -> Result<Frame> {
    let mut r = Reader { bytes: body, at: 0 };
    let frame = match kind {
        FrameType::Challenge => {
            let role = r.u8("role")?;
            Frame::Challenge {
                role,
                nonce: r.array("nonce")?,
            }
        }
        FrameType::Proof => Frame::Proof {
            mac: r.array("mac")?,
        },
        FrameType::Hello => Frame::Hello(r.hello()?),
        FrameType::Notices => {
            let notices = r.notices()?;
            let dst_ids = if r.flag("has_dst_ids")? {
                Some(r.ids("dst_ids")?)
            } else {
                None
            };
            Frame::Notices { notices, dst_ids }
        }
        FrameType::Announce => Frame::Announce(r.leases()?),
        FrameType::Revoke => Frame::Revoke(r.i64("request_id")?, r.i64("epoch")?),
        FrameType::Cancel => Frame::Cancel(r.leases()?),
        FrameType::Staged => {
            let notices = r.notices()?;
            let lo = r.u64("lo")?;
            let freed = r.u64("freed")?;
            let picked = if r.flag("has_picked")? {
                Some(r.ids("picked")?)
            } else {
                None
            };
            let dst_ids = r.ids("dst_ids")?;
            Frame::Staged(Staged {
                notices,
                lo,
                freed,
                picked,
                dst_ids,
            })
        }
        FrameType::Freed => Frame::Freed(r.u64("freed")?),
        FrameType::Agent => Frame::Agent(r.name("agent_name")?),
        FrameType::Goodbye => Frame::Goodbye(r.text("reason", MAX_REASON_BYTES)?),
        FrameType::Lookup => Frame::Lookup(Lookup {
            transfer: r.text("transfer", MAX_TRANSFER_BYTES)?,
            wait_ms: r.u32("wait_ms")?,
            sender: r.text("sender", MAX_NAME_BYTES)?,
        }),
        FrameType::Destination => Frame::Destination(Destination {
            request_id: r.i64("request_id")?,
            epoch: r.i64("epoch")?,
            prompt_len: r.i64("prompt_len")?,
            block_size: r.u32("block_size")?,
            held_blocks: r.i64("held_blocks")?,
            dst_blocks: r.ids("dst_blocks")?,
            digest: r.text("digest", MAX_DIGEST_BYTES)?,
            engine: r.text("engine", MAX_NAME_BYTES)?,
            endpoint: r.text("endpoint", MAX_URL_BYTES)?,
        }),
        FrameType::Refused => Frame::Refused(r.text("error", MAX_ERROR_BYTES)?),
        FrameType::Abandon => Frame::Abandon {
            transfer: r.text("transfer", MAX_TRANSFER_BYTES)?,
            reason: r.text("reason", MAX_REASON_BYTES)?,
        },
        FrameType::Abandoned => Frame::Abandoned,
    };
    if r.at != body.len() {
        return Err(WireError::Trailing(body.len() - r.at, kind.name()));
    }
    validate(&frame)?;
    Ok(frame)
}

/// Encodes a frame, refusing (as the decoder would) one that breaks a bound.
pub fn encode(frame: &Frame) -> Result<Vec<u8>> {
    validate(frame)?;
    let mut w = Writer(Vec::with_capacity(HEADER_BYTES + 64));
    w.0.extend_from_slice(&MAGIC);
    w.u16(VERSION);
    w.u16(frame.kind() as u16);
    w.u32(0); // the length, patched below
    match frame {
        Frame::Challenge { role, nonce } => {
            w.u8(*role);
            w.0.extend_from_slice(nonce);
        }
        Frame::Proof { mac } => w.0.extend_from_slice(mac),
        Frame::Hello(hello) => w.hello(hello),
        Frame::Notices { notices, dst_ids } => {
            w.notices(notices);
            w.u8(u8::from(dst_ids.is_some()));
            if let Some(ids) = dst_ids {
                w.ids(ids);
            }
        }
        Frame::Announce(leases) | Frame::Cancel(leases) => w.leases(leases),
        Frame::Revoke(request_id, epoch) => {
            w.i64(*request_id);
            w.i64(*epoch);
        }
        Frame::Staged(s) => {
            w.notices(&s.notices);
            w.u64(s.lo);
            w.u64(s.freed);
            w.u8(u8::from(s.picked.is_some()));
            if let Some(picked) = &s.picked {
                w.ids(picked);
            }
            w.ids(&s.dst_ids);
        }
        Frame::Freed(n) => w.u64(*n),
        Frame::Agent(name) => w.bytes(name.as_bytes()),
        Frame::Goodbye(reason) | Frame::Refused(reason) => w.bytes(reason.as_bytes()),
        Frame::Lookup(l) => {
            w.bytes(l.transfer.as_bytes());
            w.u32(l.wait_ms);
            w.bytes(l.sender.as_bytes());
        }
        Frame::Destination(d) => {
            w.i64(d.request_id);
            w.i64(d.epoch);
            w.i64(d.prompt_len);
            w.u32(d.block_size);
            w.i64(d.held_blocks);
            w.ids(&d.dst_blocks);
            w.bytes(d.digest.as_bytes());
            w.bytes(d.engine.as_bytes());
            w.bytes(d.endpoint.as_bytes());
        }
        Frame::Abandon { transfer, reason } => {
            w.bytes(transfer.as_bytes());
            w.bytes(reason.as_bytes());
        }
        Frame::Abandoned => {}
    }
    let length = w.0.len() - HEADER_BYTES;
    if length > MAX_FRAME_BYTES as usize {
        return Err(WireError::TooLong {
            length: length as u64,
            limit: u64::from(MAX_FRAME_BYTES),
        });
    }
    w.0[8..12].copy_from_slice(&(length as u32).to_le_bytes());
    Ok(w.0)
}

/// The bounds and domains both sides hold a frame to (the decoder has checked sizes as it
/// read; this checks what the values mean structurally).
fn validate(frame: &Frame) -> Result<()> {
    match frame {
        Frame::Challenge { role, .. } if !matches!(role, 1 | 2) => {
            return Err(WireError::field("role", role, "1 (endpoint) or 2 (sender)"))
        }
        Frame::Hello(hello) => validate_hello(hello)?,
        Frame::Notices { notices, dst_ids } => {
            bound("notices", notices.len(), MAX_NOTICES)?;
            if let Some(ids) = dst_ids {
                check_ids("dst_ids", ids)?;
                let covered = covered(notices)?;
                if covered != ids.len() as u128 {
                    return Err(WireError::field(
                        "dst_ids",
                        format!("<{} ids>", ids.len()),
                        "one id per block the notices cover",
                    ));
                }
            }
        }
        Frame::Announce(leases) | Frame::Cancel(leases) => {
            bound("leases", leases.len(), MAX_LEASES)?;
        }
        Frame::Staged(s) => {
            bound("notices", s.notices.len(), MAX_NOTICES)?;
            check_ids("dst_ids", &s.dst_ids)?;
            if covered(&s.notices)? != s.dst_ids.len() as u128 {
                return Err(WireError::field(
                    "dst_ids",
                    format!("<{} ids>", s.dst_ids.len()),
                    "one id per block the notices cover",
                ));
            }
            if let Some(picked) = &s.picked {
                check_ids("picked", picked)?;
                if picked.len() != s.dst_ids.len() {
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
        }
        Frame::Agent(name) => check_name("agent_name", name)?,
        Frame::Goodbye(reason) => bound("reason", reason.len(), MAX_REASON_BYTES)?,
        Frame::Lookup(l) => {
            check_text("transfer", &l.transfer, MAX_TRANSFER_BYTES)?;
            if l.wait_ms > MAX_WAIT_MS {
                return Err(WireError::field(
                    "wait_ms",
                    l.wait_ms,
                    "at most 3600000 (an hour)",
                ));
            }
            check_text("sender", &l.sender, MAX_NAME_BYTES)?;
        }
        Frame::Destination(d) => validate_destination(d)?,
        Frame::Refused(error) => check_text("error", error, MAX_ERROR_BYTES)?,
        Frame::Abandon { transfer, reason } => {
            check_text("transfer", transfer, MAX_TRANSFER_BYTES)?;
            bound("reason", reason.len(), MAX_REASON_BYTES)?;
        }
        _ => {}
    }
    Ok(())
}

/// Blocks the notices cover, refusing a notice whose range is empty or reversed (a write
/// always carries blocks) so that the count is meaningful.
fn covered(notices: &[Notice]) -> Result<u128> {
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

fn bound(field: &'static str, len: usize, max: usize) -> Result<()> {
    if len > max {
        return Err(WireError::field(
            field,
            format!("<{len} items>"),
            "within the per-frame bound",
        ));
    }
    Ok(())
}

fn check_ids(field: &'static str, ids: &[i64]) -> Result<()> {
    bound(field, ids.len(), MAX_IDS)?;
    if let Some(bad) = ids.iter().find(|&&id| id < 0) {
        return Err(WireError::field(field, bad, "block ids >= 0"));
    }
    Ok(())
}

fn check_name(field: &'static str, name: &str) -> Result<()> {
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
fn check_text(field: &'static str, text: &str, max: usize) -> Result<()> {
    if text.is_empty() {
        return Err(WireError::field(field, "\"\"", "non-empty text"));
    }
    bound(field, text.len(), max)
}

fn validate_destination(d: &Destination) -> Result<()> {
    for (field, value) in [
        ("request_id", d.request_id),
        ("epoch", d.epoch),
        ("prompt_len", d.prompt_len),
    ] {
        if value < 0 {
            return Err(WireError::field(field, value, ">= 0"));
        }
    }
    if d.block_size == 0 {
        return Err(WireError::field("block_size", 0, "> 0"));
    }
    check_ids("dst_blocks", &d.dst_blocks)?;
    if d.held_blocks < 0 || d.held_blocks as u64 > d.dst_blocks.len() as u64 {
        return Err(WireError::field(
            "held_blocks",
            d.held_blocks,
            "in [0, the number of dst_blocks]",
        ));
    }
    if d.digest.is_empty()
        || d.digest.len() > MAX_DIGEST_BYTES
        || !d
            .digest
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(WireError::field(
            "digest",
            format!("{:?}", d.digest),
            "1 to 64 lower-case hex digits",
        ));
    }
    check_name("engine", &d.engine)?;
    if d.endpoint.is_empty()
        || d.endpoint.len() > MAX_URL_BYTES
        || d.endpoint.chars().any(char::is_control)
    {
        return Err(WireError::field(
            "endpoint",
            format!("{:?}", d.endpoint),
            "a URL of 1 to 1024 bytes, no control characters",
        ));
    }
    Ok(())
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

fn validate_hello(hello: &Hello) -> Result<()> {
    let g = &hello.geometry;
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
    match &hello.access {
        PoolAccess::Shm { segment } => check_segment("segment", segment)?,
        PoolAccess::Staging { ring, capacity } => {
            check_segment("ring", ring)?;
            if *capacity == 0 {
                return Err(WireError::field("capacity", 0, "> 0"));
            }
        }
        PoolAccess::CudaIpc { layers } => {
            if layers.len() != g.num_layers as usize {
                return Err(WireError::field(
                    "layers",
                    format!("<{} layers>", layers.len()),
                    "one per layer of the geometry",
                ));
            }
            for t in layers {
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
            }
        }
        PoolAccess::Nixl {
            agent_name,
            metadata,
            bases,
            ..
        } => {
            check_name("agent_name", agent_name)?;
            bound("metadata", metadata.len(), MAX_METADATA_BYTES)?;
            if bases.len() != g.num_layers as usize {
                return Err(WireError::field(
                    "bases",
                    format!("<{} addresses>", bases.len()),
                    "one per layer of the geometry",
                ));
            }
        }
    }
    Ok(())
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, what: &'static str, n: usize) -> Result<&'a [u8]> {
        let left = self.bytes.len() - self.at;
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

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(what, N)?);
        Ok(out)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8> {
        Ok(self.take(what, 1)?[0])
    }

    fn flag(&mut self, what: &'static str) -> Result<bool> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(WireError::field(what, other, "0 or 1")),
        }
    }

    fn u32(&mut self, what: &'static str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn i64(&mut self, what: &'static str) -> Result<i64> {
        Ok(i64::from_le_bytes(self.array(what)?))
    }

    /// A count of items of `item_bytes` each, checked against `max` and against the bytes
    /// left before anything is allocated for them.
    fn count(&mut self, what: &'static str, max: usize, item_bytes: usize) -> Result<usize> {
        let n = self.u32(what)? as usize;
        bound(what, n, max)?;
        let left = self.bytes.len() - self.at;
        if n.saturating_mul(item_bytes) > left {
            return Err(WireError::Truncated {
                what,
                need: n.saturating_mul(item_bytes),
                left,
            });
        }
        Ok(n)
    }

    fn bytes(&mut self, what: &'static str, max: usize) -> Result<Vec<u8>> {
        let n = self.count(what, max, 1)?;
        Ok(self.take(what, n)?.to_vec())
    }

    fn text(&mut self, what: &'static str, max: usize) -> Result<String> {
        let raw = self.bytes(what, max)?;
        String::from_utf8(raw).map_err(|_| WireError::field(what, "<not UTF-8>", "UTF-8 text"))
    }

    fn name(&mut self, what: &'static str) -> Result<String> {
        let name = self.text(what, MAX_NAME_BYTES)?;
        check_name(what, &name)?;
        Ok(name)
    }

    fn ids(&mut self, what: &'static str) -> Result<Vec<i64>> {
        let n = self.count(what, MAX_IDS, 8)?;
        let raw = self.take(what, n * 8)?;
        Ok(raw
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect())
    }

    fn dims(&mut self, what: &'static str) -> Result<Vec<u64>> {
        let n = self.count(what, MAX_DIMS, 8)?;
        (0..n).map(|_| self.u64(what)).collect()
    }

    fn notices(&mut self) -> Result<Vec<Notice>> {
        let n = self.count("notices", MAX_NOTICES, 64)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let request_id = self.i64("request_id")?;
            let slice_id = self.i64("slice_id")?;
            let start = self.i64("start")?;
            let end = self.i64("end")?;
            let last = match self.i64("last")? {
                0 => false,
                1 => true,
                other => return Err(WireError::field("last", other, "0 or 1")),
            };
            let epoch = self.i64("epoch")?;
            let group = self.i64("group")?;
            let groups = self.i64("groups")?;
            out.push(Notice::new(
                request_id, slice_id, start, end, last, epoch, group, groups,
            ));
        }
        Ok(out)
    }

    fn leases(&mut self) -> Result<Vec<(i64, i64)>> {
        let n = self.count("leases", MAX_LEASES, 16)?;
        (0..n)
            .map(|_| Ok((self.i64("request_id")?, self.i64("epoch")?)))
            .collect()
    }

    fn segment(&mut self) -> Result<Segment> {
        Ok(Segment {
            name: self.name("segment name")?,
            num_layers: self.u32("num_layers")?,
            shape: self.dims("shape")?,
            dtype: self.name("dtype")?,
            tokens_per_block: self.u32("tokens_per_block")?,
            block_dim: self.u32("block_dim")?,
        })
    }

    fn cuda_tensor(&mut self) -> Result<CudaTensor> {
        Ok(CudaTensor {
            device: self.u32("device")?,
            handle: self.bytes("handle", MAX_HANDLE_BYTES)?,
            storage_size: self.u64("storage_size")?,
            storage_offset: self.u64("storage_offset")?,
            ref_counter_handle: self.bytes("ref_counter_handle", MAX_HANDLE_BYTES)?,
            ref_counter_offset: self.u64("ref_counter_offset")?,
            event_handle: self.bytes("event_handle", MAX_HANDLE_BYTES)?,
            event_sync_required: self.flag("event_sync_required")?,
            shape: self.dims("shape")?,
            stride: self.dims("stride")?,
            offset: self.u64("offset")?,
            dtype: self.name("dtype")?,
        })
    }

    fn hello(&mut self) -> Result<Hello> {
        let geometry = Geometry {
            num_layers: self.u32("num_layers")?,
            tokens_per_block: self.u32("tokens_per_block")?,
            dtype: self.name("dtype")?,
            segments: self.u32("segments")?,
            segment_bytes: self.u64("segment_bytes")?,
            num_blocks: self.u64("num_blocks")?,
            block_dim: self.u32("block_dim")?,
        };
        let access = match self.u8("pool kind")? {
            0 => PoolAccess::Shm {
                segment: self.segment()?,
            },
            1 => PoolAccess::Staging {
                ring: self.segment()?,
                capacity: self.u64("capacity")?,
            },
            2 => {
                let n = self.count("layers", MAX_LAYERS, 1)?;
                PoolAccess::CudaIpc {
                    layers: (0..n).map(|_| self.cuda_tensor()).collect::<Result<_>>()?,
                }
            }
            3 => PoolAccess::Nixl {
                agent_name: self.name("agent_name")?,
                metadata: self.bytes("metadata", MAX_METADATA_BYTES)?,
                mem_type: match self.u8("mem_type")? {
                    0 => MemType::Dram,
                    1 => MemType::Vram,
                    other => {
                        return Err(WireError::field("mem_type", other, "0 (DRAM) or 1 (VRAM)"))
                    }
                },
                device: self.u32("device")?,
                bases: {
                    let n = self.count("bases", MAX_LAYERS, 8)?;
                    (0..n).map(|_| self.u64("bases")).collect::<Result<_>>()?
                },
            },
            other => {
                return Err(WireError::field(
                    "pool kind",
                    other,
                    "0 (shm), 1 (staging), 2 (CUDA IPC) or 3 (NIXL)",
                ))
            }
        };
        Ok(Hello { geometry, access })
    }
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// Lengths were bounded by `validate`, well below `u32::MAX`.
    fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
    }
    fn ids(&mut self, ids: &[i64]) {
        self.u32(ids.len() as u32);
        self.0.reserve(ids.len() * 8);
        for &id in ids {
            self.i64(id);
        }
    }
    fn dims(&mut self, dims: &[u64]) {
        self.u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
    }
    fn notices(&mut self, notices: &[Notice]) {
        self.u32(notices.len() as u32);
        self.0.reserve(notices.len() * 64);
        for n in notices {
            for v in [
                n.request_id,
                n.slice_id,
                n.start,
                n.end,
                i64::from(n.last),
                n.epoch,
                n.group,
                n.groups,
            ] {
                self.i64(v);
            }
        }
    }
    fn leases(&mut self, leases: &[(i64, i64)]) {
        self.u32(leases.len() as u32);
        for &(r, e) in leases {
            self.i64(r);
            self.i64(e);
        }
    }
    fn segment(&mut self, s: &Segment) {
        self.bytes(s.name.as_bytes());
        self.u32(s.num_layers);
        self.dims(&s.shape);
        self.bytes(s.dtype.as_bytes());
        self.u32(s.tokens_per_block);
        self.u32(s.block_dim);
    }
    fn hello(&mut self, h: &Hello) {
        let g = &h.geometry;
        self.u32(g.num_layers);
        self.u32(g.tokens_per_block);
        self.bytes(g.dtype.as_bytes());
        self.u32(g.segments);
        self.u64(g.segment_bytes);
        self.u64(g.num_blocks);
        self.u32(g.block_dim);
        match &h.access {
            PoolAccess::Shm { segment } => {
                self.u8(0);
                self.segment(segment);
            }
            PoolAccess::Staging { ring, capacity } => {
                self.u8(1);
                self.segment(ring);
                self.u64(*capacity);
            }
            PoolAccess::CudaIpc { layers } => {
                self.u8(2);
                self.u32(layers.len() as u32);
                for t in layers {
                    self.u32(t.device);
                    self.bytes(&t.handle);
                    self.u64(t.storage_size);
                    self.u64(t.storage_offset);
                    self.bytes(&t.ref_counter_handle);
                    self.u64(t.ref_counter_offset);
                    self.bytes(&t.event_handle);
                    self.u8(u8::from(t.event_sync_required));
                    self.dims(&t.shape);
                    self.dims(&t.stride);
                    self.u64(t.offset);
                    self.bytes(t.dtype.as_bytes());
                }
            }
            PoolAccess::Nixl {
                agent_name,
                metadata,
                mem_type,
                device,
                bases,
            } => {
                self.u8(3);
                self.bytes(agent_name.as_bytes());
                self.bytes(metadata);
                self.u8(*mem_type as u8);
                self.u32(*device);
                self.u32(bases.len() as u32);
                for &b in bases {
                    self.u64(b);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn notices_frame() -> Frame {
        Frame::Notices {
            notices: vec![
                Notice::new(1, 0, 0, 2, false, 3, 0, 1),
                Notice::new(1, 1, 2, 3, true, 3, 1, 2),
            ],
            dst_ids: Some(vec![9, 4, 7]),
        }
    }

    #[test]
    fn header_fields_are_checked_in_order() {
        let mut bytes = encode(&notices_frame()).unwrap();
        assert!(decode(&bytes, MAX_FRAME_BYTES).is_ok());
        bytes[4] = 2;
        assert_eq!(decode(&bytes, MAX_FRAME_BYTES), Err(WireError::Version(2)));
        bytes[4] = 1;
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
        let frame = Frame::Notices {
            notices: vec![Notice::new(1, 0, 0, 2, false, 3, 0, 1)],
            dst_ids: Some(vec![1]),
        };
        assert!(matches!(
            encode(&frame),
            Err(WireError::Field {
                field: "dst_ids",
                ..
            })
        ));
    }

    #[test]
    fn the_encoder_refuses_what_the_decoder_would() {
        let long = Frame::Goodbye("x".repeat(MAX_REASON_BYTES + 1));
        assert!(matches!(
            encode(&long),
            Err(WireError::Field {
                field: "reason",
                ..
            })
        ));
        let many = Frame::Announce(vec![(0, 0); MAX_LEASES + 1]);
        assert!(matches!(
            encode(&many),
            Err(WireError::Field {
                field: "leases",
                ..
            })
        ));
    }

    fn destination() -> Destination {
        Destination {
            request_id: 7,
            epoch: 2,
            prompt_len: 70,
            block_size: 16,
            held_blocks: 2,
            dst_blocks: vec![9, 4, 7, 1, 3],
            digest: "0123456789abcdef0123456789abcdef".into(),
            engine: "3f2a9c01d4e5b6a7".into(),
            endpoint: "staging+unix:///tmp/kvferry-x/notices.sock".into(),
        }
    }

    fn refused_field(frame: &Frame) -> &'static str {
        match encode(frame) {
            Err(WireError::Field { field, .. }) => field,
            other => panic!("expected a field error, got {other:?}"),
        }
    }

    #[test]
    fn rendezvous_frames_round_trip() {
        for frame in [
            Frame::Lookup(Lookup {
                transfer: "turn-1 ⟂ agent".into(),
                wait_ms: MAX_WAIT_MS,
                sender: "prefill-0".into(),
            }),
            Frame::Destination(destination()),
            Frame::Refused("transfer 'T' was abandoned: prefill aborted".into()),
            Frame::Abandon {
                transfer: "T".into(),
                reason: String::new(),
            },
            Frame::Abandoned,
        ] {
            let bytes = encode(&frame).unwrap();
            assert_eq!(decode(&bytes, MAX_FRAME_BYTES), Ok(frame));
            assert!(decode(&bytes[..bytes.len() - 1], MAX_FRAME_BYTES).is_err());
        }
        // An abandoned carries nothing: a byte after its header is trailing.
        let mut bytes = encode(&Frame::Abandoned).unwrap();
        bytes[8] = 1;
        bytes.push(0);
        assert_eq!(
            decode(&bytes, MAX_FRAME_BYTES),
            Err(WireError::Trailing(1, "abandoned"))
        );
    }

    #[test]
    fn rendezvous_fields_are_bounded_on_encode() {
        let lookup = |transfer: &str, wait_ms: u32, sender: &str| {
            Frame::Lookup(Lookup {
                transfer: transfer.into(),
                wait_ms,
                sender: sender.into(),
            })
        };
        assert_eq!(refused_field(&lookup("", 0, "P")), "transfer");
        let long = "x".repeat(MAX_TRANSFER_BYTES + 1);
        assert_eq!(refused_field(&lookup(&long, 0, "P")), "transfer");
        assert_eq!(refused_field(&lookup("T", MAX_WAIT_MS + 1, "P")), "wait_ms");
        assert_eq!(refused_field(&lookup("T", 0, "")), "sender");
        assert_eq!(
            refused_field(&lookup("T", 0, &"s".repeat(MAX_NAME_BYTES + 1))),
            "sender"
        );
        let with = |f: fn(&mut Destination)| {
            let mut d = destination();
            f(&mut d);
            Frame::Destination(d)
        };
        assert_eq!(refused_field(&with(|d| d.request_id = -1)), "request_id");
        assert_eq!(refused_field(&with(|d| d.epoch = -1)), "epoch");
        assert_eq!(refused_field(&with(|d| d.prompt_len = -1)), "prompt_len");
        assert_eq!(refused_field(&with(|d| d.block_size = 0)), "block_size");
        assert_eq!(refused_field(&with(|d| d.held_blocks = 6)), "held_blocks");
        assert_eq!(refused_field(&with(|d| d.held_blocks = -1)), "held_blocks");
        assert_eq!(refused_field(&with(|d| d.dst_blocks[1] = -4)), "dst_blocks");
        assert_eq!(refused_field(&with(|d| d.digest = "ABC".into())), "digest");
        assert_eq!(refused_field(&with(|d| d.digest.clear())), "digest");
        assert_eq!(refused_field(&with(|d| d.engine = "a b".into())), "engine");
        assert_eq!(refused_field(&with(|d| d.endpoint.clear())), "endpoint");
        assert_eq!(refused_field(&with(|d| d.endpoint.push('\n'))), "endpoint");
        assert_eq!(refused_field(&Frame::Refused(String::new())), "error");
        assert_eq!(
            refused_field(&Frame::Refused("e".repeat(MAX_ERROR_BYTES + 1))),
            "error"
        );
        let abandon = |transfer: &str, reason: String| Frame::Abandon {
            transfer: transfer.into(),
            reason,
        };
        assert_eq!(refused_field(&abandon("", String::new())), "transfer");
        assert_eq!(
            refused_field(&abandon("T", "r".repeat(MAX_REASON_BYTES + 1))),
            "reason"
        );
    }

    #[test]
    fn a_destination_the_encoder_refuses_is_refused_on_decode() {
        // Held blocks past the ids, patched into a valid frame: the decoder checks it too.
        let mut bytes = encode(&Frame::Destination(destination())).unwrap();
        let at = HEADER_BYTES + 8 * 3 + 4; // request_id, epoch, prompt_len, block_size
        bytes[at..at + 8].copy_from_slice(&6i64.to_le_bytes());
        assert!(matches!(
            decode(&bytes, MAX_FRAME_BYTES),
            Err(WireError::Field {
                field: "held_blocks",
                ..
            })
        ));
    }

    #[test]
    fn a_count_larger_than_the_body_is_refused_before_allocating() {
        let mut bytes = encode(&Frame::Announce(vec![(1, 1)])).unwrap();
        bytes[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&bytes, MAX_FRAME_BYTES).is_err());
    }
}
