//! Fuzzes one request's ledger as a receiver drives it: whole-block claims (`claim`, `hold`)
//! and layer-group claims (`claim_layer`) of any ranges, groups and group counts, in any order,
//! against a model of per-(group, block) arrivals.
//!
//! ```text
//! model:  whole[b]            the block arrived whole (a whole claim, a hold, or every group)
//!         group[g][b]         group g of the block arrived (layer-wise streaming)
//! claim / hold [s, e):        in bounds, and no block of it arrived whole or in any group
//! claim_layer [s, e), g of G: G in [1, 1024] and the same G as earlier layer claims, g < G,
//!                             in bounds, no block of it arrived whole or in group g
//! ```
//! Invariants: no panic; each call succeeds exactly when the model says so, and a refused call
//! names the first bad argument (or is a duplicate) and changes nothing; after every call the
//! ledger's claimed blocks, per-block and per-(group, block) state and completeness are the
//! model's.

#![no_main]

use arbitrary::Arbitrary;
use kvferry::{BlockRange, CoreError, Ledger, Prompt, MAX_LAYER_GROUPS};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    /// Tokens per block, `1 + tpb % 64`.
    tpb: u8,
    /// Prompt length, `1 + prompt_len % 4096`.
    prompt_len: u16,
    ops: Vec<Op>,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Claim(u16, u16),
    Hold(u16, u16),
    /// A range, a group and a group count: mostly small, sometimes anything.
    ClaimLayer(u16, u16, Small, Small),
}

/// A group or group count: mostly `0..8`, sometimes any `i64`.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Small {
    Few(u8),
    Raw(i64),
}

impl Small {
    fn get(self) -> i64 {
        match self {
            Self::Few(v) => i64::from(v % 8),
            Self::Raw(v) => v,
        }
    }
}

/// What a call must give.
#[derive(Debug, PartialEq)]
enum Want {
    Ok,
    Invalid(&'static str),
    Duplicate,
}

struct Model {
    whole: Vec<bool>,
    groups: Option<Vec<Vec<bool>>>,
}

impl Model {
    fn in_bounds(&self, start: u64, end: u64) -> bool {
        start <= end && end <= self.whole.len() as u64
    }

    fn blocks(start: u64, end: u64) -> impl Iterator<Item = usize> {
        (start as usize)..(end as usize)
    }

    fn any_group(&self, b: usize) -> bool {
        self.groups
            .as_ref()
            .is_some_and(|g| g.iter().any(|bits| bits[b]))
    }

    fn claim(&self, start: u64, end: u64) -> Want {
        if !self.in_bounds(start, end) {
            return Want::Invalid("range");
        }
        if Self::blocks(start, end).any(|b| self.whole[b] || self.any_group(b)) {
            return Want::Duplicate;
        }
        Want::Ok
    }

    fn claim_layer(&self, start: u64, end: u64, group: i64, groups: i64) -> Want {
        if groups < 0 {
            return Want::Invalid("layer_groups");
        }
        if group < 0 {
            return Want::Invalid("layer_group");
        }
        let known = self.groups.as_ref().map(Vec::len);
        if groups == 0 || groups > MAX_LAYER_GROUPS || known.is_some_and(|n| n as i64 != groups) {
            return Want::Invalid("layer_groups");
        }
        if group >= groups {
            return Want::Invalid("layer_group");
        }
        if !self.in_bounds(start, end) {
            return Want::Invalid("range");
        }
        let mine = self.groups.as_ref().map(|g| &g[group as usize]);
        if Self::blocks(start, end).any(|b| self.whole[b] || mine.is_some_and(|bits| bits[b])) {
            return Want::Duplicate;
        }
        Want::Ok
    }

    fn apply_claim(&mut self, start: u64, end: u64) {
        for b in Self::blocks(start, end) {
            self.whole[b] = true;
        }
    }

    fn apply_layer(&mut self, start: u64, end: u64, group: usize, groups: usize) {
        let n = self.whole.len();
        let all = self
            .groups
            .get_or_insert_with(|| vec![vec![false; n]; groups]);
        for b in Self::blocks(start, end) {
            all[group][b] = true;
            if all.iter().all(|bits| bits[b]) {
                self.whole[b] = true;
            }
        }
    }
}

fn outcome(got: Result<(), CoreError>) -> Want {
    match got {
        Ok(()) => Want::Ok,
        Err(CoreError::InvalidArgument { name, .. }) => Want::Invalid(name),
        Err(CoreError::DuplicateTransfer { .. }) => Want::Duplicate,
        Err(other) => panic!("unexpected error {other:?}"),
    }
}

fn check_state(ledger: &Ledger, model: &Model) {
    let claimed = model.whole.iter().filter(|&&w| w).count() as u64;
    assert_eq!(ledger.claimed_blocks(), claimed);
    assert_eq!(ledger.is_complete(), claimed == model.whole.len() as u64);
    for (b, &whole) in model.whole.iter().enumerate() {
        assert_eq!(ledger.is_claimed(b as u64), whole, "block {b}");
    }
    if let Some(groups) = &model.groups {
        for (g, bits) in groups.iter().enumerate() {
            for (b, &set) in bits.iter().enumerate() {
                assert_eq!(
                    ledger.is_group_claimed(b as u64, g),
                    set,
                    "group {g} block {b}"
                );
            }
        }
    }
}

fuzz_target!(|input: Input| {
    let tpb = 1 + i64::from(input.tpb % 64);
    let prompt_len = 1 + i64::from(input.prompt_len % 4096);
    let mut ledger = Ledger::new(Prompt::new(tpb, prompt_len, 0, None).unwrap()).unwrap();
    let mut model = Model {
        whole: vec![false; ledger.num_blocks() as usize],
        groups: None,
    };
    for op in input.ops.iter().take(64) {
        let before = ledger.clone();
        let (want, got) = match *op {
            Op::Claim(s, e) | Op::Hold(s, e) => {
                let (s, e) = (u64::from(s), u64::from(e));
                let range = BlockRange { start: s, end: e };
                let got = match op {
                    Op::Hold(..) => ledger.hold(range),
                    _ => ledger.claim(range),
                };
                let want = model.claim(s, e);
                if want == Want::Ok {
                    model.apply_claim(s, e);
                }
                (want, got)
            }
            Op::ClaimLayer(s, e, group, groups) => {
                let (s, e, group, groups) = (u64::from(s), u64::from(e), group.get(), groups.get());
                let got = ledger.claim_layer(BlockRange { start: s, end: e }, group, groups);
                let want = model.claim_layer(s, e, group, groups);
                if want == Want::Ok {
                    model.apply_layer(s, e, group as usize, groups as usize);
                }
                (want, got)
            }
        };
        let got = outcome(got);
        assert_eq!(got, want, "{op:?}");
        if got != Want::Ok {
            assert!(ledger == before, "refused {op:?} changed the ledger");
        }
        check_state(&ledger, &model);
    }
});
