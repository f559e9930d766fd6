//! The control-plane wire format: versioned, length-prefixed binary frames. Nothing on the
//! wire is ever a serialized object; every field has a fixed width or a bounded length, and
//! a decoder checks every one before the caller sees the frame.
//!
//! ```text
//! header (12 bytes, little-endian)        body (length bytes, by type)
//! +------+---------+------+--------+      +-------------------------------------------+
//! | KVFW | version | type | length |      | fixed-width fields; lists as u32 count +  |
//! |  4   |   u16   | u16  |  u32   |      | items; bytes/strings as u32 length + data |
//! +------+---------+------+--------+      +-------------------------------------------+
//! ```
//! A frame's body is its record's fields in the order its `record!` table lists them (one
//! table per record: the struct, its decoder, its encoder and its Python form come from
//! it; only the hello's pool access, a tagged union, is read and written by hand).
//! Frames travel in sets, one per kind of channel: the transports' control channel
//! ([`Frame`], in `transport`) and the vLLM connector's rendezvous ([`rendezvous::Frame`]).
//! Both start with the handshake's frames (challenge, proof, defined here) and may end with
//! a goodbye; a frame of a type outside the channel's set is refused as a type this side
//! does not take. Type numbers come from one registry ([`FrameType`]) so that no two sets
//! ever give a number two meanings.
//!
//! The codec checks structure (magic, version, type, length against the caller's limit,
//! counts against the bounds below, flags, enums, string characters, no trailing bytes); the
//! receiver checks meaning (a notice against its request's ledger and lease).
//!
//! ```
//! use kvferry::wire::{decode, encode, Frame, Notice, Notices, MAX_FRAME_BYTES};
//!
//! let notices = vec![Notice::new(7, 0, 0, 4, true, 1, 0, 1)];
//! let frame = Frame::Notices(Notices { notices, dst_ids: Some(vec![3, 4, 5, 6]), checksums: None });
//! let bytes = encode(&frame)?;
//! assert_eq!(decode(&bytes, MAX_FRAME_BYTES)?, frame);
//! assert!(decode(&bytes[..bytes.len() - 1], MAX_FRAME_BYTES).is_err()); // truncated
//! # Ok::<(), kvferry::wire::WireError>(())
//! ```

use std::fmt;

mod check;
pub(crate) mod codec;
pub mod rendezvous;
mod transport;

use check::bound;
use codec::{Reader, Writer};
pub use transport::*;

/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"KVFW";
/// The version this codec speaks; a frame of any other version is refused.
///
/// History (bump it when any record's fields, their order or widths, or a type number's
/// meaning change; a peer of another version is refused at its first frame):
/// - 1: challenge, proof, hello (shm, staging, CUDA IPC, NIXL pools), notices with their
///   destination ids, announce, revoke, cancel, staged, freed, agent, goodbye (types 1-11);
///   then the rendezvous's lookup, destination, refused, abandon, abandoned (types 12-16),
///   added within version 1 as new types (no existing frame changed, and a peer that does
///   not know them refuses them as unknown types).
/// - 2: the shm hello carries a `Holder` (the receiver's pid, the segment's descriptor there and
///   its inode) after its segment: over `tcp://` an shm endpoint's pool has no name either, and
///   a sender on its host opens it through `/proc/<pid>/fd/<fd>`.
///   Also in 2: the hello's geometry carries the pool's block layout (`block_layout`), so pools
///   whose blocks order their elements differently are refused at the handshake.
/// - 3: the NIXL hello carries the receiving pool's segment and block strides and the spans
///   it registered (`regions`) after its bases, so a sender addresses a receiving pool that
///   is not packed (block-outer layouts, head slices) and checks every descriptor against
///   what the receiver registered. The other fields keep their meaning.
/// - 4: every rendezvous frame but the handshake's and the goodbye carries a `call` (u32)
///   last: a question's number, which its answer names, so one authenticated connection
///   carries many lookups, abandons and offers at once and their answers come in any order.
///   Notices and staging batches carry each block's checksum after their destination ids
///   (`checksums`: a flag byte, then one `u64` per block the notices cover), which the
///   receiver checks once the blocks landed (`crate::checksum`).
pub const VERSION: u16 = 4;
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
    /// A type of another channel's set.
    #[error("a {kind} frame, which the {set} does not take")]
    NotInSet {
        /// The frame's type name.
        kind: &'static str,
        /// The channel whose set it is not in.
        set: &'static str,
    },
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
    pub(crate) fn field(
        field: &'static str,
        value: impl fmt::Display,
        expected: &'static str,
    ) -> Self {
        Self::Field {
            field,
            value: value.to_string(),
            expected,
        }
    }
}

/// Shorthand.
pub type Result<T> = std::result::Result<T, WireError>;

/// The registry of type numbers: one row per frame type, its number, its name (the one
/// Python sees) and what it carries.
macro_rules! frame_types {
    ($($(#[$doc:meta])* $variant:ident = $number:literal, $name:literal;)*) => {
        /// Frame types of every channel. The numbers are the wire's; they never change
        /// meaning within a version.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u16)]
        pub enum FrameType {
            $($(#[$doc])* $variant = $number,)*
        }

        impl FrameType {
            /// Every type, in number order.
            pub const ALL: &'static [FrameType] = &[$(Self::$variant),*];

            /// The type of wire number `value`.
            pub fn from_u16(value: u16) -> Result<Self> {
                match value {
                    $($number => Ok(Self::$variant),)*
                    other => Err(WireError::UnknownType(other)),
                }
            }

            /// The lower-case name Python sees.
            pub fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)*
                }
            }
        }
    };
}

frame_types! {
    /// Handshake: a role and a fresh nonce.
    Challenge = 1, "challenge";
    /// Handshake: an HMAC-SHA256 over both nonces.
    Proof = 2, "proof";
    /// Receiver to sender: the pool's geometry and how to reach it.
    Hello = 3, "hello";
    /// Sender to receiver: notices, with the destination ids their writes used.
    Notices = 4, "notices";
    /// Sender to receiver: requests it will send, before their notices.
    Announce = 5, "announce";
    /// Sender to receiver: a request's fence.
    Revoke = 6, "revoke";
    /// Receiver to sender: requests the receiver gave up on.
    Cancel = 7, "cancel";
    /// Sender to receiver: a staging-ring batch.
    Staged = 8, "staged";
    /// Receiver to sender: staging-ring slots freed.
    Freed = 9, "freed";
    /// Sender to receiver: the NIXL agent it writes with.
    Agent = 10, "agent";
    /// Either way: why the connection is about to close.
    Goodbye = 11, "goodbye";
    /// Prefill side to the rendezvous: the destination of a transfer, please.
    Lookup = 12, "lookup";
    /// Rendezvous to the prefill side: where a looked-up transfer's blocks go.
    Destination = 13, "destination";
    /// Rendezvous to the prefill side: why a lookup gets no destination.
    Refused = 14, "refused";
    /// Prefill side to the rendezvous: it gave a transfer up.
    Abandon = 15, "abandon";
    /// Rendezvous to the prefill side: the abandon is recorded.
    Abandoned = 16, "abandoned";
    /// Decode side to a prefill server's rendezvous: a transfer's destination is published
    /// at this decode server (routers that tell the decode server where the prefill ran).
    Offer = 17, "offer";
    /// A prefill server's rendezvous to the decode side: the offer is taken.
    Accepted = 18, "accepted";
}

/// A fixed sequence of fields, read and written in order (the `record!` table).
pub(crate) trait Record: Sized {
    /// The fields' names, in wire order.
    #[allow(dead_code)] // read by the Python conversions (feature "python") and the tests
    const FIELDS: &'static [&'static str];
    fn read(r: &mut Reader<'_>) -> Result<Self>;
    fn write(&self, w: &mut Writer);
}

/// What a record's values must hold beyond their sizes (which the reader checked): the
/// encoder refuses what the decoder would. Most records have nothing more to check.
pub(crate) trait Check {
    fn check(&self) -> Result<()> {
        Ok(())
    }
}

/// One table row per field: `name: Type = codec(args)`, where `codec` names the `Reader`
/// method that reads it (with the field's name and `args`) and the `Writer` method that
/// writes it. Adding a field to a record is one line here: struct, decoder, encoder and the
/// Python form (`py::wire::py_record`) follow.
macro_rules! record {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $($(#[$fmeta:meta])* $field:ident: $ty:ty = $codec:ident($($arg:expr),*)),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub struct $name {
            $($(#[$fmeta])* pub $field: $ty,)*
        }

        impl $crate::wire::Record for $name {
            const FIELDS: &'static [&'static str] = &[$(stringify!($field)),*];

            #[allow(unused_variables)] // a record without fields reads nothing
            fn read(r: &mut $crate::wire::codec::Reader<'_>) -> $crate::wire::Result<Self> {
                Ok(Self {
                    $($field: r.$codec(stringify!($field) $(, $arg)*)?,)*
                })
            }

            #[allow(unused_variables)]
            fn write(&self, w: &mut $crate::wire::codec::Writer) {
                $(w.$codec(&self.$field);)*
            }
        }

        #[cfg(feature = "python")]
        $crate::py::wire::py_record!($name { $($field),* });
    };
}
pub(crate) use record;

/// A channel's set of frames: an enum with one variant per frame type it takes, each
/// carrying the record of the same name (`Frame::Lookup(Lookup)`).
macro_rules! frame_set {
    (
        $(#[$meta:meta])*
        pub enum $name:ident for $set:literal {
            $($(#[$vmeta:meta])* $variant:ident),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vmeta])*
            #[doc = concat!("A frame carrying a [`", stringify!($variant), "`].")]
            $variant($variant),)*
        }

        $(impl From<$variant> for $name {
            fn from(record: $variant) -> Self {
                Self::$variant(record)
            }
        })*

        impl $crate::wire::FrameSet for $name {
            const SET: &'static str = $set;

            fn kind(&self) -> $crate::wire::FrameType {
                match self {
                    $(Self::$variant(_) => $crate::wire::FrameType::$variant,)*
                }
            }

            fn read(
                kind: $crate::wire::FrameType,
                r: &mut $crate::wire::codec::Reader<'_>,
            ) -> $crate::wire::Result<Self> {
                use $crate::wire::Record;
                match kind {
                    $($crate::wire::FrameType::$variant => Ok(Self::$variant($variant::read(r)?)),)*
                    other => Err($crate::wire::WireError::NotInSet { kind: other.name(), set: $set }),
                }
            }

            fn write(&self, w: &mut $crate::wire::codec::Writer) {
                use $crate::wire::Record;
                match self {
                    $(Self::$variant(record) => record.write(w),)*
                }
            }

            fn check(&self) -> $crate::wire::Result<()> {
                use $crate::wire::Check;
                match self {
                    $(Self::$variant(record) => record.check(),)*
                }
            }
        }

        #[cfg(feature = "python")]
        $crate::py::wire::py_frame_set!($name { $($variant),* });
    };
}
pub(crate) use frame_set;

/// The frames one kind of channel takes (built by `frame_set!`).
pub(crate) trait FrameSet: Sized {
    /// The channel, as errors name it.
    #[allow(dead_code)] // read by the Python conversions (feature "python")
    const SET: &'static str;
    fn kind(&self) -> FrameType;
    /// The body of a frame of type `kind` (`NotInSet` for a type of another channel).
    fn read(kind: FrameType, r: &mut Reader<'_>) -> Result<Self>;
    fn write(&self, w: &mut Writer);
    fn check(&self) -> Result<()>;
}

record! {
    /// Handshake: the sender's role (1 endpoint, 2 sender) and a fresh nonce.
    pub struct Challenge {
        /// 1 (endpoint) or 2 (sender).
        role: u8 = u8(),
        /// Fresh random bytes.
        nonce: [u8; NONCE_BYTES] = array(),
    }
}

impl Check for Challenge {
    fn check(&self) -> Result<()> {
        if !matches!(self.role, 1 | 2) {
            return Err(WireError::field(
                "role",
                self.role,
                "1 (endpoint) or 2 (sender)",
            ));
        }
        Ok(())
    }
}

record! {
    /// Handshake: an HMAC-SHA256 over the label, the role and both nonces.
    pub struct Proof {
        /// The MAC.
        mac: [u8; NONCE_BYTES] = array(),
    }
}

impl Check for Proof {}

record! {
    /// Why the connection is about to close (at most [`MAX_REASON_BYTES`] of UTF-8).
    pub struct Goodbye {
        /// Said to the peer; may be empty.
        reason: String = text(MAX_REASON_BYTES),
    }
}

impl Check for Goodbye {
    fn check(&self) -> Result<()> {
        bound("reason", self.reason.len(), MAX_REASON_BYTES)
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

/// Decodes one whole frame of set `F` (header and body, nothing after) of at most `limit`
/// body bytes.
pub(crate) fn decode_frame<F: FrameSet>(bytes: &[u8], limit: u32) -> Result<F> {
    let header = decode_header(bytes, limit)?;
    let body = &bytes[HEADER_BYTES..];
    let length = header.length as usize;
    if body.len() < length {
        return Err(WireError::Truncated {
            what: "body",
            need: length,
            left: body.len(),
        });
    }
    if body.len() > length {
        return Err(WireError::Trailing(body.len() - length, header.kind.name()));
    }
    decode_body_as(header.kind, body)
}

/// Decodes a body of type `kind` (its header already checked by [`decode_header`]).
pub(crate) fn decode_body_as<F: FrameSet>(kind: FrameType, body: &[u8]) -> Result<F> {
    let mut r = Reader::new(body);
    let frame = F::read(kind, &mut r)?;
    if r.left() != 0 {
        return Err(WireError::Trailing(r.left(), kind.name()));
    }
    frame.check()?;
    Ok(frame)
}

/// Encodes a frame of set `F`, refusing (as the decoder would) one that breaks a bound.
pub(crate) fn encode_frame<F: FrameSet>(frame: &F) -> Result<Vec<u8>> {
    frame.check()?;
    let mut w = Writer::header(frame.kind() as u16);
    frame.write(&mut w);
    w.finish()
}
