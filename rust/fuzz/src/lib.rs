//! The oracle shared by the fuzz targets: the planner's formulas restated on `i128` (so there
//! is no overflow to reason about) independently of `kvferry::plan`, and the refusals each
//! call must produce.
//!
//! ```text
//! tokens:  |<------ reused R ------>|<-- chunk s..e -->| ... |P
//! blocks:  [0 ....... floor(R/tpb))[boundary][ ... floor(e/tpb)) ... ceil(P/tpb))
//! early:   [0, floor(R/tpb))    non-final chunk: [.., floor(e/tpb))    last: [.., ceil(P/tpb))
//! window:  only the last chunk sends, the live blocks [floor((P+1-W)/tpb), ceil(P/tpb))
//! ```

use arbitrary::Arbitrary;
use kvferry::{BlockRange, CoreError, MAX_LEDGER_BLOCKS};

pub mod pairs;

/// A half-open block span `[start, end)`.
pub type Span = (u64, u64);

/// The span of a range the core returned.
pub const fn span(range: BlockRange) -> Span {
    (range.start, range.end)
}

/// An integer argument: mostly a plausible one, sometimes any `i64` so that the refusals and
/// the extremes get their share of the inputs.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Int {
    /// `0..=65535`.
    Small(u16),
    /// Anything, negative and `i64::MAX` included.
    Raw(i64),
}

impl Int {
    /// The value.
    pub fn get(self) -> i64 {
        match self {
            Self::Small(v) => i64::from(v),
            Self::Raw(v) => v,
        }
    }
}

/// A reused length: mostly a share of the prompt (so that the request is valid), sometimes any
/// `i64`.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Reused {
    /// `share / 256` of the prompt, rounded down.
    Share(u8),
    /// Anything.
    Raw(i64),
}

impl Reused {
    /// The reused length for a prompt of `prompt_len` tokens.
    pub fn get(self, prompt_len: i64) -> i64 {
        match self {
            Self::Share(share) => (i128::from(prompt_len) * i128::from(share) / 256) as i64,
            Self::Raw(v) => v,
        }
    }
}

/// One request's prompt as the oracle sees it.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    tpb: i128,
    prompt: i128,
    reused: i128,
    /// The window when it is shorter than the prompt: a wider one is full attention.
    window: Option<i128>,
}

impl Shape {
    /// The shape, or the name of the first argument that `Prompt::new` must refuse.
    pub fn new(
        tpb: i64,
        prompt: i64,
        reused: i64,
        window: Option<i64>,
    ) -> Result<Self, &'static str> {
        if tpb <= 0 {
            return Err("tokens_per_block");
        }
        if prompt <= 0 {
            return Err("prompt_len");
        }
        if reused < 0 || reused >= prompt {
            return Err("reused_len");
        }
        if window.is_some_and(|w| w <= 0) {
            return Err("window");
        }
        let prompt = i128::from(prompt);
        Ok(Self {
            tpb: tpb.into(),
            prompt,
            reused: reused.into(),
            window: window.map(i128::from).filter(|&w| w < prompt),
        })
    }

    /// Prompt length in tokens.
    pub fn prompt_len(&self) -> i64 {
        self.prompt as i64
    }

    /// Reused length in tokens.
    pub fn reused_len(&self) -> i64 {
        self.reused as i64
    }

    /// Whether the prompt has a sliding window shorter than itself.
    pub fn windowed(&self) -> bool {
        self.window.is_some()
    }

    /// `ceil(P / tpb)`.
    pub fn num_blocks(&self) -> u64 {
        ceil_div(self.prompt, self.tpb)
    }

    /// Whether a ledger may track the prompt (it refuses more than `MAX_LEDGER_BLOCKS`).
    pub fn fits_ledger(&self) -> bool {
        self.num_blocks() <= MAX_LEDGER_BLOCKS
    }

    /// The blocks the generation worker needs.
    pub fn needed(&self) -> Span {
        let start = self.window.map_or(0, |w| (self.prompt + 1 - w) / self.tpb);
        (start as u64, self.num_blocks())
    }

    /// The early slice, eligibility aside: the complete reused blocks, full attention only.
    pub fn early(&self) -> Option<Span> {
        let end = self.reused / self.tpb;
        (self.window.is_none() && end > 0).then_some((0, end as u64))
    }

    /// The argument a chunk `[s, e)` is refused for, if it is outside `[R, P]` or empty.
    pub fn chunk_error(&self, s: i64, e: i64) -> Option<&'static str> {
        let (s, e) = (i128::from(s), i128::from(e));
        if s < self.reused || s >= self.prompt {
            Some("chunk_start")
        } else if e <= s || e > self.prompt {
            Some("chunk_end")
        } else {
            None
        }
    }

    /// The slice of a valid chunk `[s, e)`.
    pub fn chunk(&self, s: i64, e: i64, prefix_sent: bool) -> Option<Span> {
        let (s, e) = (i128::from(s), i128::from(e));
        let last = e == self.prompt;
        if self.window.is_some() {
            let (start, end) = self.needed();
            return (last && start < end).then_some((start, end));
        }
        let start = if s == self.reused && !prefix_sent {
            0
        } else {
            s / self.tpb
        };
        let end = if last {
            i128::from(ceil_div(e, self.tpb))
        } else {
            e / self.tpb
        };
        (start < end).then_some((start as u64, end as u64))
    }
}

fn ceil_div(a: i128, b: i128) -> u64 {
    ((a + b - 1) / b) as u64
}

/// What a call must be refused with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// `UnknownRequest(id)`.
    Unknown(i64),
    /// `InvalidArgument` naming the argument; `Some(id)` when the argument belongs to one
    /// request of a batch, whose id the message must then carry.
    Invalid(&'static str, Option<i64>),
    /// `DuplicateTransfer` of request `id`: `block` is the first claimed block of `claim`.
    Duplicate {
        /// The request.
        id: i64,
        /// The first already-claimed block.
        block: u64,
        /// The refused claim.
        claim: Span,
    },
}

/// Checks that `err` is exactly the refusal the oracle expected, with a message that names
/// what went wrong.
pub fn check_refusal(err: &CoreError, want: &Refusal) {
    let msg = err.to_string();
    match (err, want) {
        (CoreError::UnknownRequest(got), Refusal::Unknown(id)) => assert_eq!(got, id, "{msg}"),
        (CoreError::InvalidArgument { name, expected, .. }, Refusal::Invalid(want, id)) => {
            assert_eq!(name, want, "{msg}");
            assert!(msg.starts_with(&format!("invalid {want}=")), "{msg}");
            if let Some(id) = id {
                assert!(expected.ends_with(&format!("(request_id={id})")), "{msg}");
            }
        }
        (
            CoreError::DuplicateTransfer {
                owner,
                block,
                start,
                end,
            },
            Refusal::Duplicate {
                id,
                block: b,
                claim,
            },
        ) => {
            assert_eq!((*block, (*start, *end)), (*b, *claim), "{msg}");
            assert_eq!(owner, &format!("of request {id} "), "{msg}");
        }
        _ => panic!("refused with {err:?} ({msg}), expected {want:?}"),
    }
}
