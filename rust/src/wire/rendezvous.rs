//! The vLLM connector's rendezvous (`kvferry.vllm.rendezvous`): its own channel, on the
//! codec's header and handshake. A lookup (transfer id, wait in milliseconds, the prefill
//! engine's id) is answered by a destination (request id, epoch, prompt length, block size,
//! held blocks, destination block ids, prompt digest, decode engine id, endpoint URL) or a
//! refusal (why); an abandon (transfer id, reason, the epoch of the destination its sender
//! took, 0 if none) by an abandoned or a refusal; an offer
//! (transfer id, the decode server's rendezvous addresses, their signature), which a decode
//! server sends to the prefill server a router named, by an accepted or a refusal. The
//! transports' codec knows none of these: a rendezvous frame on a transport's channel (or
//! the other way round) is refused as a type that channel does not take.
//!
//! Every one of those frames ends with a `call` (u32): the asking side numbers its
//! questions, and each answer names the question it answers, so one connection carries many
//! questions at once (a lookup may wait for its destination while others are answered).

use super::check::{bound, check_ids, check_name, check_text};
use super::{
    decode_frame, encode_frame, frame_set, record, Challenge, Check, Goodbye, Proof, Result,
    WireError, MAX_NAME_BYTES, MAX_REASON_BYTES,
};

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
/// The longest peer an offer names: every decode rank's rendezvous URL, separated by spaces.
pub const MAX_PEER_BYTES: usize = 4096;
/// An offer's signature of its peer: HMAC-SHA256 in lower-case hex.
pub const PEER_MAC_BYTES: usize = 64;

frame_set! {
    /// One frame of the rendezvous's channel.
    pub enum Frame for "rendezvous" {
        Challenge, Proof, Lookup, Destination, Refused, Abandon, Abandoned, Offer, Accepted,
        Goodbye,
    }
}

/// Decodes one whole rendezvous frame of at most `limit` body bytes.
pub fn decode(bytes: &[u8], limit: u32) -> Result<Frame> {
    decode_frame(bytes, limit)
}

/// Encodes a rendezvous frame, refusing (as the decoder would) one that breaks a bound.
pub fn encode(frame: &Frame) -> Result<Vec<u8>> {
    encode_frame(frame)
}

record! {
    /// A prefill request asking the decode server's rendezvous for its transfer's destination.
    pub struct Lookup {
        /// The transfer id both halves of the request carry (1 to 1024 bytes of UTF-8).
        transfer: String = text(MAX_TRANSFER_BYTES),
        /// How long the rendezvous may wait for the decode request to publish it (at most
        /// [`MAX_WAIT_MS`]).
        wait_ms: u32 = u32(),
        /// The prefill engine's id (1 to 128 bytes of UTF-8): each gets an endpoint of its own.
        sender: String = text(MAX_NAME_BYTES),
        /// The asking side's number for this question, echoed by its answer: one
        /// connection carries many questions at once (a lookup may wait), answered in any order.
        call: u32 = u32(),
    }
}

record! {
    /// Where a transfer's blocks go: what the decode worker published, and the URL of the
    /// endpoint the looking-up prefill engine sends to.
    pub struct Destination {
        /// The receiver's id of the request (>= 0).
        request_id: i64 = i64(),
        /// The epoch of its lease (>= 0).
        epoch: i64 = i64(),
        /// Tokens of the prompt (>= 0).
        prompt_len: i64 = i64(),
        /// Tokens per block on the decode server (> 0).
        block_size: u32 = u32(),
        /// Leading destination blocks the decode server already holds (at most `dst_blocks`).
        held_blocks: i64 = i64(),
        /// The decode server's block ids, in prompt order (>= 0, at most `MAX_IDS`).
        dst_blocks: Vec<i64> = ids(),
        /// The prompt's digest: lower-case hex digits, 1 to [`MAX_DIGEST_BYTES`].
        digest: String = text(MAX_DIGEST_BYTES),
        /// The decode engine's id (a name: [A-Za-z0-9._-], 1 to 128 bytes).
        engine: String = text(MAX_NAME_BYTES),
        /// The endpoint's URL (1 to [`MAX_URL_BYTES`] of UTF-8, no control characters).
        endpoint: String = text(MAX_URL_BYTES),
        /// The number of the question it answers (that question's `call`).
        call: u32 = u32(),
    }
}

record! {
    /// Why a lookup gets no destination.
    pub struct Refused {
        /// 1 to [`MAX_ERROR_BYTES`] of UTF-8.
        error: String = text(MAX_ERROR_BYTES),
        /// The number of the question it answers (that question's `call`).
        call: u32 = u32(),
    }
}

record! {
    /// A transfer the prefill side gave up, and why.
    pub struct Abandon {
        /// The transfer id (1 to [`MAX_TRANSFER_BYTES`]).
        transfer: String = text(MAX_TRANSFER_BYTES),
        /// Why (at most [`MAX_REASON_BYTES`]; may be empty).
        reason: String = text(MAX_REASON_BYTES),
        /// The epoch of the destination the abandoning request took (>= 0; 0: it took
        /// none): a transfer taken already is given up only by the request that took it.
        epoch: i64 = i64(),
        /// The asking side's number for this question, echoed by its answer: one
        /// connection carries many questions at once (a lookup may wait), answered in any order.
        call: u32 = u32(),
    }
}

record! {
    /// The abandon is recorded.
    pub struct Abandoned {
        /// The number of the question it answers (that question's `call`).
        call: u32 = u32(),
    }
}

record! {
    /// A decode server telling a prefill server's rendezvous that the destination of
    /// `transfer` is published at `peer` (the decode server's rendezvous, one URL per tensor
    /// parallel rank, separated by spaces), signed by `peer_mac`.
    pub struct Offer {
        /// The transfer id (1 to [`MAX_TRANSFER_BYTES`]).
        transfer: String = text(MAX_TRANSFER_BYTES),
        /// 1 to [`MAX_PEER_BYTES`] of UTF-8, no control characters.
        peer: String = text(MAX_PEER_BYTES),
        /// [`PEER_MAC_BYTES`] lower-case hex digits.
        peer_mac: String = text(PEER_MAC_BYTES),
        /// The asking side's number for this question, echoed by its answer: one
        /// connection carries many questions at once (a lookup may wait), answered in any order.
        call: u32 = u32(),
    }
}

record! {
    /// The offer is taken.
    pub struct Accepted {
        /// The number of the question it answers (that question's `call`).
        call: u32 = u32(),
    }
}

impl Check for Lookup {
    fn check(&self) -> Result<()> {
        check_text("transfer", &self.transfer, MAX_TRANSFER_BYTES)?;
        if self.wait_ms > MAX_WAIT_MS {
            return Err(WireError::field(
                "wait_ms",
                self.wait_ms,
                "at most 3600000 (an hour)",
            ));
        }
        check_text("sender", &self.sender, MAX_NAME_BYTES)
    }
}

impl Check for Destination {
    fn check(&self) -> Result<()> {
        for (field, value) in [
            ("request_id", self.request_id),
            ("epoch", self.epoch),
            ("prompt_len", self.prompt_len),
        ] {
            if value < 0 {
                return Err(WireError::field(field, value, ">= 0"));
            }
        }
        if self.block_size == 0 {
            return Err(WireError::field("block_size", 0, "> 0"));
        }
        check_ids("dst_blocks", &self.dst_blocks)?;
        if self.held_blocks < 0 || self.held_blocks as u64 > self.dst_blocks.len() as u64 {
            return Err(WireError::field(
                "held_blocks",
                self.held_blocks,
                "in [0, the number of dst_blocks]",
            ));
        }
        let digest = &self.digest;
        if digest.is_empty()
            || digest.len() > MAX_DIGEST_BYTES
            || !digest
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(WireError::field(
                "digest",
                format!("{digest:?}"),
                "1 to 64 lower-case hex digits",
            ));
        }
        check_name("engine", &self.engine)?;
        let url = &self.endpoint;
        if url.is_empty() || url.len() > MAX_URL_BYTES || url.chars().any(char::is_control) {
            return Err(WireError::field(
                "endpoint",
                format!("{url:?}"),
                "a URL of 1 to 1024 bytes, no control characters",
            ));
        }
        Ok(())
    }
}

impl Check for Refused {
    fn check(&self) -> Result<()> {
        check_text("error", &self.error, MAX_ERROR_BYTES)
    }
}

impl Check for Abandon {
    fn check(&self) -> Result<()> {
        check_text("transfer", &self.transfer, MAX_TRANSFER_BYTES)?;
        bound("reason", self.reason.len(), MAX_REASON_BYTES)?;
        if self.epoch < 0 {
            return Err(WireError::field("epoch", self.epoch, ">= 0"));
        }
        Ok(())
    }
}

impl Check for Abandoned {}

impl Check for Offer {
    fn check(&self) -> Result<()> {
        check_text("transfer", &self.transfer, MAX_TRANSFER_BYTES)?;
        let peer = &self.peer;
        if peer.is_empty() || peer.len() > MAX_PEER_BYTES || peer.chars().any(char::is_control) {
            return Err(WireError::field(
                "peer",
                format!("<{} bytes>", peer.len()),
                "1 to 4096 bytes of UTF-8, no control characters",
            ));
        }
        let mac = &self.peer_mac;
        if mac.len() != PEER_MAC_BYTES
            || !mac
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(WireError::field(
                "peer_mac",
                format!("<{} bytes>", mac.len()),
                "64 lower-case hex digits",
            ));
        }
        Ok(())
    }
}

impl Check for Accepted {}

#[cfg(test)]
mod tests {
    use super::super::{decode_header, FrameType, HEADER_BYTES, MAX_FRAME_BYTES, NONCE_BYTES};
    use super::*;

    fn destination() -> Destination {
        Destination {
            call: 3,
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

    fn lookup(transfer: &str, wait_ms: u32, sender: &str) -> Frame {
        Frame::Lookup(Lookup {
            call: 1,
            transfer: transfer.into(),
            wait_ms,
            sender: sender.into(),
        })
    }

    fn offer(transfer: &str, peer: &str, peer_mac: &str) -> Frame {
        Frame::Offer(Offer {
            call: u32::MAX,
            transfer: transfer.into(),
            peer: peer.into(),
            peer_mac: peer_mac.into(),
        })
    }

    #[test]
    fn rendezvous_frames_round_trip() {
        for frame in [
            lookup("turn-1 ⟂ agent", MAX_WAIT_MS, "prefill-0"),
            Frame::Destination(destination()),
            Frame::Refused(Refused {
                call: 9,
                error: "transfer 'T' was abandoned: prefill aborted".into(),
            }),
            Frame::Abandon(Abandon {
                call: 0,
                transfer: "T".into(),
                reason: String::new(),
                epoch: 7,
            }),
            Frame::Abandoned(Abandoned { call: 4 }),
            offer(
                "T",
                "unix:///tmp/a.sock tcp://10.0.0.2:7001",
                &"ab12".repeat(16),
            ),
            Frame::Accepted(Accepted { call: 5 }),
        ] {
            let bytes = encode(&frame).unwrap();
            assert_eq!(decode(&bytes, MAX_FRAME_BYTES), Ok(frame));
            assert!(decode(&bytes[..bytes.len() - 1], MAX_FRAME_BYTES).is_err());
        }
        // An abandoned carries its call only: a byte after it is trailing.
        let mut bytes = encode(&Frame::Abandoned(Abandoned { call: 4 })).unwrap();
        bytes[8] = 5;
        bytes.push(0);
        assert_eq!(
            decode(&bytes, MAX_FRAME_BYTES),
            Err(WireError::Trailing(1, "abandoned"))
        );
    }

    #[test]
    fn a_transport_frame_is_not_the_rendezvous_s() {
        let bytes =
            crate::wire::encode(&crate::wire::Frame::Freed(crate::wire::Freed { freed: 3 }))
                .unwrap();
        assert_eq!(
            decode_header(&bytes, MAX_FRAME_BYTES).unwrap().kind,
            FrameType::Freed
        );
        assert_eq!(
            decode(&bytes, MAX_FRAME_BYTES),
            Err(WireError::NotInSet {
                kind: "freed",
                set: "rendezvous"
            })
        );
        // The handshake's frames are every channel's, byte for byte.
        let challenge = Challenge {
            role: 2,
            nonce: [7; NONCE_BYTES],
        };
        let ours = encode(&Frame::Challenge(challenge.clone())).unwrap();
        assert_eq!(
            ours,
            crate::wire::encode(&crate::wire::Frame::Challenge(challenge)).unwrap()
        );
        assert_eq!(ours.len(), HEADER_BYTES + 1 + NONCE_BYTES);
    }

    #[test]
    fn rendezvous_fields_are_bounded_on_encode() {
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
        let refused = |error: String| Frame::Refused(Refused { call: 0, error });
        assert_eq!(refused_field(&refused(String::new())), "error");
        assert_eq!(
            refused_field(&refused("e".repeat(MAX_ERROR_BYTES + 1))),
            "error"
        );
        let abandon = |transfer: &str, reason: String, epoch: i64| {
            Frame::Abandon(Abandon {
                call: 0,
                transfer: transfer.into(),
                reason,
                epoch,
            })
        };
        assert_eq!(refused_field(&abandon("", String::new(), 0)), "transfer");
        assert_eq!(
            refused_field(&abandon("T", "r".repeat(MAX_REASON_BYTES + 1), 0)),
            "reason"
        );
        assert_eq!(refused_field(&abandon("T", String::new(), -1)), "epoch");
        let mac = "0f".repeat(32);
        assert_eq!(refused_field(&offer("", "unix:///p", &mac)), "transfer");
        assert_eq!(refused_field(&offer("T", "", &mac)), "peer");
        assert_eq!(refused_field(&offer("T", "unix:///p\n", &mac)), "peer");
        let long = "p".repeat(MAX_PEER_BYTES + 1);
        assert_eq!(refused_field(&offer("T", &long, &mac)), "peer");
        assert_eq!(
            refused_field(&offer("T", "unix:///p", &mac[2..])),
            "peer_mac"
        );
        assert_eq!(
            refused_field(&offer("T", "unix:///p", &mac.to_uppercase())),
            "peer_mac"
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
}
