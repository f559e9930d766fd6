//! Properties of the frame codec: every frame the encoder accepts decodes to itself; any
//! byte string decodes to a frame or an error, never a panic; a frame cut short or with a
//! byte flipped in its header is refused or decodes to a valid frame.

use kvferry::wire::rendezvous::{
    self, Abandon, Abandoned, Destination, Lookup, Refused, MAX_WAIT_MS,
};
use kvferry::wire::{
    decode, decode_header, encode, Agent, Announce, Cancel, Challenge, CudaTensor, Frame, Freed,
    Geometry, Goodbye, Hello, Holder, MemType, Notice, Notices, PoolAccess, Proof, Region, Revoke,
    Segment, Staged, HEADER_BYTES, MAX_FRAME_BYTES,
};
use proptest::collection::vec;
use proptest::prelude::*;

fn notice() -> impl Strategy<Value = Notice> {
    (
        any::<i64>(),
        0i64..1000,
        0i64..64,
        1i64..8,
        any::<bool>(),
        0i64..100,
        0i64..4,
        1i64..5,
    )
        .prop_map(|(r, s, start, len, last, e, g, gs)| {
            Notice::new(r, s, start, start + len, last, e, g, gs)
        })
}

fn ids(n: usize) -> impl Strategy<Value = Vec<i64>> {
    vec(0i64..1 << 40, n)
}

/// Notices and one destination id per block they cover.
fn notices_and_ids() -> impl Strategy<Value = (Vec<Notice>, Vec<i64>)> {
    vec(notice(), 0..6).prop_flat_map(|notices| {
        let n: i64 = notices.iter().map(|n| n.end - n.start).sum();
        (Just(notices), ids(n as usize))
    })
}

fn name() -> impl Strategy<Value = String> {
    "[A-Za-z0-9._-]{1,40}"
}

fn segment() -> impl Strategy<Value = Segment> {
    (
        name(),
        1u32..64,
        vec(1u64..1 << 16, 1..5),
        name(),
        1u32..256,
    )
        .prop_flat_map(|(name, num_layers, shape, dtype, tpb)| {
            let dims = shape.len() as u32;
            (0..dims).prop_map(move |block_dim| Segment {
                name: name.clone(),
                num_layers,
                shape: shape.clone(),
                dtype: dtype.clone(),
                tokens_per_block: tpb,
                block_dim,
            })
        })
}

fn cuda_tensor() -> impl Strategy<Value = CudaTensor> {
    (
        (
            any::<u32>(),
            vec(any::<u8>(), 0..65),
            any::<u64>(),
            any::<u64>(),
            vec(any::<u8>(), 0..100),
            any::<u64>(),
        ),
        (
            vec(any::<u8>(), 0..65),
            any::<bool>(),
            vec(1u64..1 << 12, 1..5),
            any::<u64>(),
            name(),
        ),
    )
        .prop_map(
            |(
                (device, handle, size, offset, counter, counter_offset),
                (event, sync, shape, tensor_offset, dtype),
            )| CudaTensor {
                device,
                handle,
                storage_size: size,
                storage_offset: offset,
                ref_counter_handle: counter,
                ref_counter_offset: counter_offset,
                event_handle: event,
                event_sync_required: sync,
                stride: shape.iter().map(|d| d * 2).collect(),
                shape,
                offset: tensor_offset,
                dtype,
            },
        )
}

fn hello() -> impl Strategy<Value = Hello> {
    (
        1u32..8,
        1u32..256,
        name(),
        1u32..4,
        any::<u64>(),
        any::<u64>(),
        0u32..4,
    )
        .prop_flat_map(
            |(layers, tpb, dtype, segments, seg_bytes, blocks, block_dim)| {
                let geometry = Geometry {
                    num_layers: layers,
                    tokens_per_block: tpb,
                    dtype,
                    segments,
                    segment_bytes: seg_bytes,
                    num_blocks: blocks,
                    block_dim,
                    block_layout: "H8.N16.C256".to_string(),
                };
                let n = layers as usize;
                let access = prop_oneof![
                    (segment(), any::<u32>(), any::<u32>(), any::<u64>()).prop_map(
                        |(segment, pid, fd, inode)| PoolAccess::Shm {
                            segment,
                            holder: Holder { pid, fd, inode },
                        }
                    ),
                    (segment(), 1u64..1 << 20)
                        .prop_map(|(ring, capacity)| PoolAccess::Staging { ring, capacity }),
                    vec(cuda_tensor(), n).prop_map(|layers| PoolAccess::CudaIpc { layers }),
                    (
                        name(),
                        vec(any::<u8>(), 0..512),
                        any::<bool>(),
                        any::<u32>(),
                        vec(any::<u64>(), n),
                        (1u64.., 1u64..),
                        vec((0u64..1 << 62, 1u64..1 << 40), 1..8),
                    )
                        .prop_map(
                            |(agent_name, metadata, vram, device, bases, strides, spans)| {
                                PoolAccess::Nixl {
                                    agent_name,
                                    metadata,
                                    mem_type: if vram { MemType::Vram } else { MemType::Dram },
                                    device,
                                    bases,
                                    segment_stride: strides.0,
                                    block_stride: strides.1,
                                    regions: spans
                                        .into_iter()
                                        .map(|(start, length)| Region { start, length })
                                        .collect(),
                                }
                            }
                        ),
                ];
                (Just(geometry), access).prop_map(|(geometry, access)| Hello { geometry, access })
            },
        )
}

/// A destination as the decode worker publishes it (held blocks within its ids).
fn destination() -> impl Strategy<Value = Destination> {
    (
        (0i64..1 << 62, 0i64..1 << 40, 0i64..1 << 20, 1u32..1024),
        vec(0i64..1 << 31, 0..40),
        "[0-9a-f]{1,64}",
        name(),
        "[a-z+]{1,12}://[ -~]{0,200}",
        any::<u32>(),
    )
        .prop_flat_map(|(ints, dst_blocks, digest, engine, endpoint, call)| {
            let n = dst_blocks.len() as i64;
            (0..=n).prop_map(move |held_blocks| Destination {
                call,
                request_id: ints.0,
                epoch: ints.1,
                prompt_len: ints.2,
                block_size: ints.3,
                held_blocks,
                dst_blocks: dst_blocks.clone(),
                digest: digest.clone(),
                engine: engine.clone(),
                endpoint: endpoint.clone(),
            })
        })
}

/// The rendezvous's frames (kvferry.vllm.rendezvous).
fn rendezvous_frame() -> impl Strategy<Value = rendezvous::Frame> {
    use rendezvous::Frame as R;
    prop_oneof![
        (any::<u32>(), ".{1,256}", 0..=MAX_WAIT_MS, ".{1,32}").prop_map(
            |(call, transfer, wait_ms, sender)| R::Lookup(Lookup {
                call,
                transfer,
                wait_ms,
                sender
            })
        ),
        destination().prop_map(R::Destination),
        (any::<u32>(), ".{1,400}").prop_map(|(call, error)| R::Refused(Refused { call, error })),
        (any::<u32>(), ".{1,256}", ".{0,200}", 0..=i64::MAX).prop_map(
            |(call, transfer, reason, epoch)| R::Abandon(Abandon {
                call,
                transfer,
                reason,
                epoch,
            })
        ),
        any::<u32>().prop_map(|call| R::Abandoned(Abandoned { call })),
        (1u8..=2, any::<[u8; 32]>())
            .prop_map(|(role, nonce)| R::Challenge(Challenge { role, nonce })),
        ".{0,200}".prop_map(|reason| R::Goodbye(Goodbye { reason })),
    ]
}

/// Checksums of any value (the codec carries them; only the receiver computes them).
fn sums(n: usize, seed: u64) -> Vec<u64> {
    (0..n as u64)
        .map(|i| seed.rotate_left(i as u32) ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .collect()
}

fn frame() -> impl Strategy<Value = Frame> {
    let leases = || vec((any::<i64>(), any::<i64>()), 0..20);
    prop_oneof![
        (1u8..=2, any::<[u8; 32]>())
            .prop_map(|(role, nonce)| Frame::Challenge(Challenge { role, nonce })),
        any::<[u8; 32]>().prop_map(|mac| Frame::Proof(Proof { mac })),
        hello().prop_map(Frame::Hello),
        (
            notices_and_ids(),
            any::<bool>(),
            any::<bool>(),
            any::<u64>()
        )
            .prop_map(|((notices, ids), named, summed, seed)| {
                let checksums = summed.then(|| sums(ids.len(), seed));
                Frame::Notices(Notices {
                    notices,
                    dst_ids: named.then_some(ids),
                    checksums,
                })
            }),
        vec(notice(), 0..6).prop_map(|notices| Frame::Notices(Notices {
            notices,
            dst_ids: None,
            checksums: None,
        })),
        leases().prop_map(|leases| Frame::Announce(Announce { leases })),
        leases().prop_map(|leases| Frame::Cancel(Cancel { leases })),
        (any::<i64>(), any::<i64>())
            .prop_map(|(request_id, epoch)| Frame::Revoke(Revoke { request_id, epoch })),
        (
            notices_and_ids(),
            any::<u64>(),
            any::<u64>(),
            any::<bool>(),
            any::<bool>()
        )
            .prop_map(|((notices, dst_ids), lo, freed, pick, summed)| {
                let picked = pick.then(|| (0..dst_ids.len() as i64).map(|i| i * 2).collect());
                let checksums = summed.then(|| sums(dst_ids.len(), lo));
                Frame::Staged(Staged {
                    notices,
                    lo,
                    freed,
                    picked,
                    dst_ids,
                    checksums,
                })
            }),
        any::<u64>().prop_map(|freed| Frame::Freed(Freed { freed })),
        name().prop_map(|agent_name| Frame::Agent(Agent { agent_name })),
        ".{0,200}".prop_map(|reason| Frame::Goodbye(Goodbye { reason })),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn every_encoded_frame_decodes_to_itself(frame in frame()) {
        let bytes = encode(&frame).expect("the strategy builds only valid frames");
        prop_assert_eq!(decode(&bytes, MAX_FRAME_BYTES), Ok(frame));
    }

    #[test]
    fn any_bytes_decode_to_a_frame_or_an_error(bytes in vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes, MAX_FRAME_BYTES);
        let _ = decode_header(&bytes, MAX_FRAME_BYTES);
    }

    #[test]
    fn any_body_behind_a_valid_header_decodes_or_errs(kind in 0u16..19, body in vec(any::<u8>(), 0..512)) {
        let mut bytes = b"KVFW".to_vec();
        bytes.extend_from_slice(&1u16.to_le_bytes());
        bytes.extend_from_slice(&kind.to_le_bytes());
        bytes.extend_from_slice(&(body.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&body);
        if let Ok(frame) = decode(&bytes, MAX_FRAME_BYTES) {
            // Whatever decodes is a frame the encoder would have produced, byte for byte.
            prop_assert_eq!(&encode(&frame).unwrap(), &bytes);
        }
        if let Ok(frame) = rendezvous::decode(&bytes, MAX_FRAME_BYTES) {
            prop_assert_eq!(&rendezvous::encode(&frame).unwrap(), &bytes);
        }
    }

    #[test]
    fn a_frame_cut_short_is_refused(frame in frame(), cut in any::<prop::sample::Index>()) {
        let bytes = encode(&frame).unwrap();
        let at = cut.index(bytes.len());
        prop_assert!(decode(&bytes[..at], MAX_FRAME_BYTES).is_err());
    }

    #[test]
    fn a_mutated_frame_decodes_to_a_valid_frame_or_errs(frame in frame(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut bytes = encode(&frame).unwrap();
        let i = at.index(bytes.len());
        bytes[i] = byte;
        if let Ok(decoded) = decode(&bytes, MAX_FRAME_BYTES) {
            // What decodes passed every check the encoder makes: it encodes back to the bytes.
            prop_assert_eq!(encode(&decoded).unwrap(), bytes);
        }
    }

    #[test]
    fn every_rendezvous_frame_decodes_to_itself_and_not_when_cut(frame in rendezvous_frame(), cut in any::<prop::sample::Index>()) {
        let bytes = rendezvous::encode(&frame).expect("the strategy builds only valid frames");
        prop_assert_eq!(rendezvous::decode(&bytes, MAX_FRAME_BYTES), Ok(frame));
        prop_assert!(rendezvous::decode(&bytes[..cut.index(bytes.len())], MAX_FRAME_BYTES).is_err());
    }

    #[test]
    fn a_mutated_rendezvous_frame_decodes_to_a_valid_frame_or_errs(frame in rendezvous_frame(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut bytes = rendezvous::encode(&frame).unwrap();
        let i = at.index(bytes.len());
        bytes[i] = byte;
        match rendezvous::decode(&bytes, MAX_FRAME_BYTES) {
            Ok(decoded) => prop_assert_eq!(rendezvous::encode(&decoded).unwrap(), bytes),
            Err(err) => prop_assert!(!err.to_string().is_empty()),
        }
    }

    #[test]
    fn a_destination_with_held_blocks_past_its_ids_is_refused(d in destination(), extra in 1i64..100) {
        let held = d.dst_blocks.len() as i64 + extra;
        let bad = rendezvous::Frame::Destination(Destination { held_blocks: held, ..d });
        prop_assert!(rendezvous::encode(&bad).is_err());
    }

    #[test]
    fn a_header_is_refused_unless_magic_version_and_type_are_known(header in vec(any::<u8>(), HEADER_BYTES)) {
        if decode_header(&header, MAX_FRAME_BYTES).is_ok() {
            prop_assert_eq!(&header[..6], b"KVFW\x02\x00");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_frame_of_one_channel_is_refused_on_the_other(frame in frame(), theirs in rendezvous_frame()) {
        // The two sets share only the handshake's frames and the goodbye.
        let bytes = encode(&frame).unwrap();
        let shared = matches!(frame, Frame::Challenge(_) | Frame::Proof(_) | Frame::Goodbye(_));
        prop_assert_eq!(rendezvous::decode(&bytes, MAX_FRAME_BYTES).is_ok(), shared);
        let bytes = rendezvous::encode(&theirs).unwrap();
        let shared = matches!(theirs, rendezvous::Frame::Challenge(_) | rendezvous::Frame::Goodbye(_));
        prop_assert_eq!(decode(&bytes, MAX_FRAME_BYTES).is_ok(), shared);
    }
}

#[test]
fn a_pickle_is_not_a_frame() {
    // pickle.dumps((pathlib.Path.touch, ...)) starts with the protocol opcode 0x80.
    let pickle = b"\x80\x04\x95\x1c\x00\x00\x00\x00\x00\x00\x00\x8c\x07pathlib";
    assert!(decode(pickle, MAX_FRAME_BYTES).is_err());
}
