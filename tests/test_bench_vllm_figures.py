"""`kvferry bench vllm`'s arithmetic, without vLLM (python/kvferry/bench/vllm_figures.py and
link.py): the configurations' order per slot, the bytes a turn must move, the ideal bound and
the losses against it, ratios of medians with their bootstrap interval, the quiet-machine
verdict, the link's sizing, and the refusal to shape anything but a bench namespace's veth.
No timing here: every figure is given."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvferry.bench import link
from kvferry.bench import vllm_figures as vf
from kvferry.errors import InvalidArgumentError

NAMES = ["nixl", "nixl-push", "kvferry-early", "kvferry-aware"]


def test_the_order_reverses_from_slot_to_slot() -> None:
    assert vf.order(NAMES, 0) == NAMES
    assert vf.order(NAMES, 1) == NAMES[::-1]
    assert vf.order(NAMES, 2) == NAMES
    # Over two slots every configuration runs at every position once from each end.
    firsts = [vf.order(NAMES, s)[0] for s in range(2)]
    assert firsts == ["nixl", "kvferry-aware"]


BLOCK, PER_BLOCK = 32, 1000


def test_decode_cold_moves_the_prefix_early_and_the_new_blocks_after() -> None:
    # Turn 1: 2048 cached tokens, 8 output, 128 new: the prefill server hit the 64 blocks of
    # the previous prompt; the decode server holds nothing.
    moved = vf.turn_bytes(2048 + 8 + 128, 2048, 0, BLOCK, PER_BLOCK)
    assert moved == vf.TurnBytes(prefix=64 * PER_BLOCK, tail=(69 - 64) * PER_BLOCK)


def test_decode_warm_with_awareness_moves_only_the_tail() -> None:
    # The decode server computed the previous prompt and all output tokens but the last.
    moved = vf.turn_bytes(2048 + 8 + 128, 2048, 2048 + 8 - 1, BLOCK, PER_BLOCK)
    assert moved == vf.TurnBytes(prefix=0, tail=(69 - 64) * PER_BLOCK)
    # Holding more complete blocks than the prefill server's hit: nothing early, less tail.
    assert vf.turn_bytes(100, 32, 64, BLOCK, PER_BLOCK) == vf.TurnBytes(prefix=0, tail=2 * PER_BLOCK)


@pytest.mark.parametrize("arg", ["prompt_tokens", "hit_tokens", "held_tokens", "block_tokens", "block_bytes"])
def test_turn_bytes_names_a_bad_argument(arg: str) -> None:
    args: dict[str, Any] = dict(prompt_tokens=10, hit_tokens=0, held_tokens=0, block_tokens=BLOCK, block_bytes=1)
    args[arg] = -1
    with pytest.raises(ValueError, match=rf"invalid {arg}=-1"):
        vf.turn_bytes(**args)


def test_the_ideal_overlaps_the_prefix_with_the_prefill_then_adds_the_tail() -> None:
    moved = vf.TurnBytes(prefix=200_000, tail=50_000)
    # 1 MB/s: the prefix takes 200 ms, the tail 50 ms.
    assert vf.ideal(150.0, moved, 1e6) == (250.0, 200.0, 50.0)  # the prefix is longer
    assert vf.ideal(300.0, moved, 1e6) == (350.0, 200.0, 50.0)  # the prefill is longer
    with pytest.raises(ValueError, match="invalid link_bytes_per_s=0"):
        vf.ideal(1.0, moved, 0)


ms = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)


@given(kv=ms, ttft=ms, end=ms, prefill=ms, clean=ms, prefix=ms, tail=ms, step=ms)
def test_the_losses_add_up_to_kv_ready_minus_the_ideal(
    kv: float, ttft: float, end: float, prefill: float, clean: float, prefix: float, tail: float, step: float
) -> None:
    loss = vf.losses(
        kv_ready_ms=kv, ttft_ms=ttft, prefill_end_ms=end, prefill_ms=prefill, clean_prefill_ms=clean,
        prefix_ms=prefix, tail_ms=tail, decode_step_ms=step,
    )  # fmt: skip
    ideal = max(clean, prefix) + tail
    assert loss["admission"] + loss["prefill_slowed"] + loss["after_prefill"] == pytest.approx(kv - ideal, abs=1e-6)
    assert loss["first_token"] == pytest.approx(ttft - kv - step)


def test_a_turn_that_reaches_its_ideal_loses_nothing() -> None:
    # Prefill 300 ms from arrival (no queue), the prefix (200 ms) hidden under it, the tail
    # 50 ms after: KV-ready 350 ms, exactly the ideal.
    loss = vf.losses(
        kv_ready_ms=350.0, ttft_ms=380.0, prefill_end_ms=300.0, prefill_ms=300.0, clean_prefill_ms=300.0,
        prefix_ms=200.0, tail_ms=50.0, decode_step_ms=30.0,
    )  # fmt: skip
    assert loss == {"admission": 0.0, "prefill_slowed": 0.0, "after_prefill": 0.0, "first_token": 0.0}


def test_ratio_of_medians_and_its_interval() -> None:
    a = [60.0, 62.0, 58.0, 61.0, 59.0, 200.0]  # one disturbed turn
    b = [100.0, 101.0, 99.0, 100.0, 102.0, 98.0]
    r = vf.ratio_of_medians(a, b, reps=500)
    assert r["ratio"] == pytest.approx(60.5 / 100.0)
    assert r["lo"] <= r["ratio"] <= r["hi"] and r["n"] == 6
    assert vf.ratio_of_medians(a, b, reps=500) == r  # a fixed seed: the same interval
    same = vf.ratio_of_medians([2.0] * 5, [4.0] * 5, reps=100)
    assert same["lo"] == same["hi"] == same["ratio"] == 0.5


def test_ratio_of_medians_refuses_unpaired_samples() -> None:
    with pytest.raises(ValueError, match="need the same number"):
        vf.ratio_of_medians([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="need the same number"):
        vf.ratio_of_medians([], [])


def test_the_busy_verdict_reads_the_same_prefill_of_one_engine_over_sessions() -> None:
    quiet = [{0: 100.0, 1: 103.0, 2: 101.0}, {0: 101.0, 1: 99.0, 2: 100.0}]
    assert vf.busy_verdict(quiet)["busy"] is False
    busy = [{0: 100.0, 1: 180.0}, {0: 150.0, 1: 100.0}, quiet[0]]
    verdict = vf.busy_verdict(busy)
    assert verdict["busy"] is True and verdict["worst_group"] == 0 and verdict["prefill_spread"] == 1.5


def test_the_verdict_leaves_a_connectors_own_slower_prefill_out() -> None:
    """NixlConnector's engine computing every prefill 3x slower than kvferry's is its cost,
    not load: each engine's own turns agree, so the verdict is quiet."""
    rows = [
        {"case": case, "config": conf, "turn": turn, "session": session, "prefill_ms": ms + session + 50 * early}
        for case in ("decode-cold", "decode-warm")
        for turn in (1, 2)
        for session in (0, 1, 2)
        for conf, ms, early in (("nixl", 90.0, 0), ("kvferry-baseline", 30.0, 0), ("kvferry-early", 30.0, 1))
    ]
    groups = vf.same_prefill_groups(rows, "decode-cold", ["nixl", "kvferry-baseline"])
    assert sorted(groups, key=lambda g: g[0]) == [{0: 30.0, 1: 31.0, 2: 32.0}] * 2 + [{0: 90.0, 1: 91.0, 2: 92.0}] * 2
    load = vf.busy_verdict(groups)
    assert load["busy"] is False and load["prefill_spread"] == pytest.approx((32 / 30 + 92 / 90) / 2)


def test_the_link_is_sized_so_the_prefix_crosses_in_the_prefill() -> None:
    # 16.5 MiB in 160 ms, at the TCP share of a tbf rate.
    mbit = link.mbit_for(16_500_000, 0.16)
    assert mbit * 1e6 / 8 * link.TCP_SHARE * 0.16 == pytest.approx(16_500_000)
    # A rate that gave 90 % of what was wanted is raised by 1/0.9.
    assert link.corrected_mbit(900.0, 100e6, 90e6) == pytest.approx(1000.0)
    with pytest.raises(InvalidArgumentError, match="invalid prefix_bytes=0"):
        link.mbit_for(0, 0.16)
    with pytest.raises(InvalidArgumentError, match="invalid prefill_s=0"):
        link.mbit_for(1, 0)


@pytest.fixture
def netns_dir(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A stand-in for /run/netns: namespaces are files there, this process's own is the file
    named "mine" points at (by inode), the machine's first process's is unreadable."""
    monkeypatch.setattr(link, "NETNS_DIR", str(tmp_path))
    real = link._inode
    own: dict[str, str] = {}

    def inode(path: str) -> int:
        if path == "/proc/1/ns/net":
            raise PermissionError(path)
        if path == "/proc/self/ns/net":
            return real(own["path"]) if "path" in own else -7
        return real(path)

    monkeypatch.setattr(link, "_inode", inode)

    def make(name: str, mine: bool = False) -> None:
        (tmp_path / name).write_text("")
        if mine:
            own["path"] = str(tmp_path / name)

    return make


def test_shaping_refuses_a_namespace_no_bench_made(netns_dir: Any) -> None:
    asked: list[list[str]] = []
    netns_dir("prod")  # named, but not by a bench
    with pytest.raises(InvalidArgumentError, match=r"refusing to shape network namespace prod: not one a kvferry"):
        link.veth_of("prod", run=lambda argv: asked.append(argv) or "")
    # This process's own namespace, unnamed (the machine's, as a rule).
    with pytest.raises(InvalidArgumentError, match=r"refusing to shape network namespace \(this process's\)"):
        link.veth_of(None, run=lambda argv: asked.append(argv) or "")
    with pytest.raises(InvalidArgumentError, match="invalid network namespace no-such-ns"):
        link.veth_of("no-such-ns", run=lambda argv: asked.append(argv) or "")
    assert asked == []  # refused before anything ran


def test_shaping_finds_the_one_veth_of_a_bench_namespace(netns_dir: Any) -> None:
    netns_dir("kvferry-123-a", mine=True)
    netns_dir("kvferry-123-b")
    one = "7: kvf123a@if6: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc tbf state UP\n"
    assert link.veth_of(None, run=lambda argv: one) == "kvf123a"
    asked: list[list[str]] = []
    assert link.veth_of("kvferry-123-b", run=lambda argv: asked.append(argv) or one) == "kvf123a"
    assert asked == [["ip", "-n", "kvferry-123-b", "-o", "link", "show", "type", "veth"]]
    with pytest.raises(InvalidArgumentError, match="2 veth devices"):
        link.veth_of(None, run=lambda argv: one + one.replace("kvf123a", "kvf999a"))
    asked.clear()
    link.shape(None, "kvf123a", 812.5, run=lambda argv: asked.append(argv) or "")
    assert asked == [["tc", "qdisc", "replace", "dev", "kvf123a", "root", "tbf", "rate", "812.5mbit", "burst",
                      "256kb", "latency", "50ms"]]  # fmt: skip


def test_each_namespace_receives_on_its_own_core(netns_dir: Any) -> None:
    netns_dir("kvferry-123-a", mine=True)
    netns_dir("kvferry-123-b")
    asked: list[list[str]] = []
    link.steer_receive("kvferry-123-b", "kvf123b", 1, run=lambda argv: asked.append(argv) or "")
    link.steer_receive(None, "kvf123a", 0, run=lambda argv: asked.append(argv) or "")
    loop = "for q in /sys/class/net/{}/queues/rx-*; do echo {} > $q/rps_cpus; done"
    assert asked == [
        ["ip", "netns", "exec", "kvferry-123-b", "sh", "-c", loop.format("kvf123b", 2)],
        ["sh", "-c", loop.format("kvf123a", 1)],
    ]
    asked.clear()
    with pytest.raises(InvalidArgumentError, match="refusing to shape network namespace prod"):
        netns_dir("prod")
        link.steer_receive("prod", "kvf123b", 1, run=lambda argv: asked.append(argv) or "")
    with pytest.raises(InvalidArgumentError, match=r"invalid device='x; reboot'"):
        link.steer_receive(None, "x; reboot", 1, run=lambda argv: asked.append(argv) or "")
    with pytest.raises(InvalidArgumentError, match="invalid cpu=-1"):
        link.steer_receive(None, "kvf123a", -1, run=lambda argv: asked.append(argv) or "")
    assert asked == []
