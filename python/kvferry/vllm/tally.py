"""What the worker half counts and observes (`Tally`), and the names and helps of those
figures; kvferry.vllm.stats turns them into vLLM's stats and Prometheus metrics. No vLLM
here: the worker's data path runs without it (a GPU machine's tests)."""

from __future__ import annotations

from typing import Any

from kvferry.vllm.config import TRANSPORTS

__all__ = ["COUNTERS", "FAILURE_REASONS", "HISTOGRAMS", "UNHONOURED_REASONS", "Tally", "failure_reason"]

# name -> help; each becomes the counter vllm:kvferry_<name>_total.
COUNTERS = {
    # Prefill side, per write, counted once its copy finished and its notice was posted: its
    # kind says when it was issued, not when it landed (early_landed_bytes says that).
    "early_issued_bytes": (
        "Bytes written for the prefix-cache hit, issued before the forward of the request's first chunk."
    ),
    "early_landed_bytes": (
        "Of early_issued_bytes: bytes whose copy had finished before the first chunk's forward ended."
    ),
    "early_deferred": (
        "Sends whose prefix-cache hit held blocks that the same step's forward writes (the same prompt scheduled"
        " twice in one step): their prefix left after that forward, with the first chunk."
    ),
    "chunk_bytes": "Bytes sent after the forward of the chunk that computed them.",
    "layer_bytes": "Bytes sent layer group by layer group during the last chunk's forward.",
    "held_blocks": "Prompt blocks not sent because the decode server's prefix cache held them.",
    "preempted_resends": (
        "Sends the prefill engine preempted mid-transfer: revoked, then sent again under a new epoch once the"
        " request was computed again (prefill side, one per decode rank a prefill rank sends to)."
    ),
    "reoffered_parts": (
        "Transfers (one per prefill rank's part) a prefill engine revoked before every block arrived, expected"
        " again under a new epoch (decode side)."
    ),
    "parked_prompts": (
        "Prompts computed before their destination whose blocks were copied into host memory, so that vLLM's"
        " pool freed them at once; their late send reads the copy (prefill side, one per rank)."
    ),
    # Decode side: a refused notice counts once, in one of the three.
    "duplicates_refused": "Notices the decode side refused because their blocks had already arrived.",
    "checksum_mismatches": (
        "Notices the decode side refused because a block's checksum where it landed differed from the one its prefill"
        " side summed (corrupted in flight): each fails its request."
    ),
    "notices_refused": "Notices the decode side refused for another reason (unknown request, epoch, sender or blocks).",
    "checksummed_blocks": "Blocks (per layer group written) whose checksum the decode side checked and found intact.",
    "transfers": "Transfers whose every block landed (prefill side).",
    "failed_transfers": "Transfers released before every block landed (prefill side).",
    # Prefill side: which path each connection to a decode endpoint took (kvferry.vllm.paths).
    **{
        f"connections_{name.replace('-', '_')}": f"Connections a prefill rank made to a decode endpoint over {name}."
        for name in TRANSPORTS
        if name != "auto"
    },
}
# name -> (help, buckets); each becomes the histogram vllm:kvferry_<name>.
HISTOGRAMS = {
    "transfer_seconds": (
        "Seconds from a request's first write to its last landing (prefill side).",
        (0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0, 60.0),
    ),
    "hidden_fraction": (
        "Per request: the fraction of its bytes that landed before its last forward ended.",
        (0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
    ),
    "recv_seconds": (
        "Seconds from a decode request's blocks being expected to their arrival.",
        (0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0, 60.0),
    ),
}

# The counter vllm:kvferry_failures_total{reason=...}: transfers that failed on either side, by
# the kind of their error (`failure_reason`), each label made at start so a rate starts at 0.
FAILURE_REASONS = (
    "timeout",
    "aborted",
    "preempted",
    "peer_lost",
    "peer_gave_up",
    "authentication",
    "checksum",
    "refused",
    "other",
)
_REASON_WORDS = (  # first match wins: the words kvferry's errors say for each kind
    ("authentication", ("authentication", "different keys")),
    ("checksum", ("corrupted in flight",)),
    ("preempted", ("preempted",)),
    ("aborted", ("aborted",)),
    ("peer_gave_up", ("gave up", "abandoned")),
    ("timeout", ("timed out", "within", "timeout")),
    ("peer_lost", ("cannot reach", "went away", "lost", "closed", "cannot send", "connection")),
    ("refused", ("refused", "invalid", "cannot expect", "differ")),
)


# The counter vllm:kvferry_unhonoured_total{reason=...}: requests whose kv_transfer_params were
# not served as they asked (the scheduler half counts them, each with a log line):
UNHONOURED_REASONS = {
    "refused": "refused by name (bad or unusable parameters, the wrong role): the request failed",
    "ignored_keys": "NixlConnector-protocol parameters with keys kvferry does not read (served without them)",
    "not_kvferry": "parameters that ask for no kvferry transfer (another connector's protocol): computed here alone",
    "duplicate": "a second prefill request of one transfer id (n > 1 samples): the first one sends",
    "offer_failed": "decode side: the prefill server could not be told where to send (the request failed)",
    "no_offer": "prefill side: no decode server asked for the KV in time (its blocks were freed)",
    "no_request": "prefill side: a decode server's offer that no prefill request took in time",
    "prefill_gave_up": "decode side: the prefill side gave the transfer up before this server admitted its request"
    " (computed here)",
}


def failure_reason(text: str) -> str:
    """The `FAILURE_REASONS` label of a failed transfer's error text."""
    low = text.lower()
    return next((label for label, words in _REASON_WORDS if any(w in low for w in words)), "other")


class Tally:
    """Counters and observations since the last `take`."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.observed: dict[str, list[float]] = {}
        # Since the start, never taken: what a test or a debugger reads in the process.
        self.totals: dict[str, int] = {}
        self.all_observed: dict[str, list[float]] = {}

    def add(self, name: str, value: int) -> None:
        assert name in COUNTERS, name
        if value:
            self.counts[name] = self.counts.get(name, 0) + int(value)
            self.totals[name] = self.totals.get(name, 0) + int(value)

    def fail(self, reason: str) -> None:
        """One failed transfer, counted under its reason's label (`failure_reason`)."""
        key = f"failures/{failure_reason(reason)}"
        self.counts[key] = self.counts.get(key, 0) + 1
        self.totals[key] = self.totals.get(key, 0) + 1

    def unhonoured(self, reason: str) -> None:
        """One request not served as its parameters asked, by `UNHONOURED_REASONS`."""
        assert reason in UNHONOURED_REASONS, reason
        key = f"unhonoured/{reason}"
        self.counts[key] = self.counts.get(key, 0) + 1
        self.totals[key] = self.totals.get(key, 0) + 1

    def observe(self, name: str, value: float) -> None:
        assert name in HISTOGRAMS, name
        self.observed.setdefault(name, []).append(float(value))
        self.all_observed.setdefault(name, []).append(float(value))

    def take(self) -> dict[str, Any]:
        data = {"counts": self.counts, "observed": self.observed}
        self.counts, self.observed = {}, {}
        return data
