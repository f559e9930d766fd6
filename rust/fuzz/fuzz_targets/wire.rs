//! Fuzzes the control-plane frame decoders (`kvferry::wire::decode`, the transports' channel,
//! and `kvferry::wire::rendezvous::decode`, the vLLM rendezvous's) on any bytes, and on any
//! body behind a valid header (so the fuzzer spends its time in the body decoders rather than
//! rediscovering the magic).
//!
//! Invariants: no panic; whatever decodes is a frame the encoder accepts and encodes back to
//! the very bytes it came from (one encoding per frame: no field is read loosely), and a frame
//! cut short by one byte is refused.

#![no_main]

use kvferry::wire::{
    decode, decode_header, encode, rendezvous, FrameType, HEADER_BYTES, MAX_FRAME_BYTES, VERSION,
};
use libfuzzer_sys::fuzz_target;

fn check(bytes: &[u8]) {
    let _ = decode_header(bytes, MAX_FRAME_BYTES);
    if let Ok(frame) = rendezvous::decode(bytes, MAX_FRAME_BYTES) {
        let again = rendezvous::encode(&frame).expect("a decoded rendezvous frame encodes");
        assert_eq!(
            again, bytes,
            "a decoded rendezvous frame does not encode back to its bytes"
        );
        assert!(
            rendezvous::decode(&bytes[..bytes.len() - 1], MAX_FRAME_BYTES).is_err(),
            "a truncated rendezvous frame decoded"
        );
    }
    if let Ok(frame) = decode(bytes, MAX_FRAME_BYTES) {
        let again = encode(&frame).expect("a decoded frame encodes");
        assert_eq!(
            again, bytes,
            "a decoded frame does not encode back to its bytes"
        );
        assert!(
            decode(&bytes[..bytes.len() - 1], MAX_FRAME_BYTES).is_err(),
            "a truncated frame decoded"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    // The same bytes as the body of a frame of the type the first two name.
    if data.len() >= 2 {
        let mut framed = Vec::with_capacity(HEADER_BYTES + data.len());
        framed.extend_from_slice(b"KVFW");
        framed.extend_from_slice(&VERSION.to_le_bytes());
        let types = FrameType::ALL.len() as u8 + 1; // and 0, which no frame has
        framed.extend_from_slice(&u16::from(data[0] % types).to_le_bytes());
        framed.extend_from_slice(&((data.len() - 1) as u32).to_le_bytes());
        framed.extend_from_slice(&data[1..]);
        check(&framed);
    }
});
