"""Bounded user labels: cap, overflow bucket, sanitizing, exact totals."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.telemetry.labels import OTHER, UserLabeler, sanitize


def max_values(labeler: UserLabeler) -> int:
    """Most distinct label values a labeler may ever produce: its pinned
    users' labels, its top-K, the overflow bucket."""
    return len(set(labeler.pinned.values())) + labeler.top_k + 1


def test_pinned_users_always_have_their_label():
    lab = UserLabeler(pinned=["gold", "silver"], top_k=2)
    for i in range(1000):
        lab.observe(f"noise-{i}", 5)
    lab.rebalance()
    assert lab.label("gold") == "gold" and lab.label("silver") == "silver"


def test_top_k_most_active_get_labels_others_overflow():
    lab = UserLabeler(top_k=3)
    for user, tokens in [("a", 100), ("b", 90), ("c", 80), ("d", 1), ("e", 2)]:
        lab.observe(user, tokens)
    added, evicted = lab.rebalance()
    assert added == ["a", "b", "c"] and evicted == []
    assert lab.label("d") == OTHER and lab.label("a") == "a"
    # d becomes the busiest: it replaces the least active, whose series must go
    for _ in range(3):
        lab.observe("d", 1000)
        lab.observe("a", 1)
        lab.observe("b", 1)
    added, evicted = lab.rebalance()
    assert added == ["d"] and evicted == ["c"]
    assert lab.label("c") == OTHER


def test_ten_thousand_users_give_at_most_cap_plus_one_values_and_exact_totals():
    lab = UserLabeler(pinned=["vip"], top_k=100)
    per_label: Counter[str] = Counter()
    total = 0
    for step in range(50):
        for i in range(200):
            user = f"user-{step * 200 + i}" if i else "vip"
            tokens = 1 + (i % 7)
            lab.observe(user, tokens)
            per_label[lab.label(user)] += tokens
            total += tokens
        lab.rebalance()
    assert len(per_label) <= max_values(lab) == 102
    assert sum(per_label.values()) == total
    assert len(lab._activity) <= lab.capacity


def test_sanitize_removes_control_characters_and_caps_length():
    assert sanitize("a\nb\x00c\x7f") == "a_b_c_"
    long_a, long_b = "x" * 100 + "a", "x" * 100 + "b"
    assert len(sanitize(long_a)) == 64
    assert sanitize(long_a) != sanitize(long_b)
    assert sanitize("") == "_"


def test_spoofing_the_overflow_bucket_does_not_get_a_label():
    lab = UserLabeler(top_k=5)
    lab.observe(OTHER, 100)
    lab.rebalance()
    assert lab.label(OTHER) == OTHER
    assert OTHER not in lab.labelled_users()


@settings(max_examples=100, deadline=None)
@given(
    top_k=st.integers(0, 20),
    events=st.lists(st.tuples(st.text(max_size=80), st.integers(1, 50)), max_size=400),
    rebalance_every=st.integers(1, 50),
)
def test_labels_stay_bounded_and_distinct(top_k, events, rebalance_every):
    lab = UserLabeler(pinned=["p1", "p2"], top_k=top_k)
    seen: set[str] = set()
    for i, (user, tokens) in enumerate(events):
        lab.observe(user, tokens)
        seen.add(lab.label(user))
        if i % rebalance_every == 0:
            lab.rebalance()
            values = list(lab.labelled_users().values())
            assert len(values) == len(set(values))  # no two users share a series
            assert len(values) <= 2 + top_k
        assert len(lab._activity) <= lab.capacity
    assert all(len(v) <= 64 and v.isprintable() for v in lab.labelled_users().values())


def test_free_seats_label_new_users_at_once_and_rebalance_reports_them():
    labeler = UserLabeler(pinned=["vip"], top_k=2)
    labeler.observe("a", 1)
    assert labeler.label("a") == "a"  # no wait for a rebalance
    labeler.observe("b", 1)
    labeler.observe("c", 5)  # no seat left: __other__ until a rebalance
    assert labeler.label("b") == "b" and labeler.label("c") == OTHER
    added, evicted = labeler.rebalance()
    assert added == ["a", "c"] and evicted == ["b"]  # a and c are the top 2
    assert labeler.label("c") == "c" and labeler.label("b") == OTHER
    assert len({labeler.label(u) for u in ("vip", "a", "b", "c", "d")}) <= max_values(labeler)


def test_a_spoofed_overflow_label_never_takes_a_free_seat():
    labeler = UserLabeler(top_k=5)
    labeler.observe(OTHER, 3)
    assert labeler.label(OTHER) == OTHER
    assert labeler.labelled_users() == {}


# -- --output-rate-user-label: raw, hashed, off ---------------------------------------

import pytest  # noqa: E402

from vllm_output_rate import user_label  # noqa: E402
from vllm_output_rate.config import OutputRateConfigError  # noqa: E402

SALT = b"a-salt-of-sixteen-bytes-or-more"


def test_hashed_labels_are_stable_salted_and_show_no_id():
    policy = user_label.UserLabelPolicy("hashed", SALT)
    lab = UserLabeler(pinned=["alice"], top_k=5, public=policy.public_id)
    lab.observe("bob", 3)
    labels = lab.labelled_users()
    assert set(labels) == {"alice", "bob"}
    assert all(v.startswith("u-") and len(v) == 18 for v in labels.values())
    assert "alice" not in "".join(labels.values()) and "bob" not in "".join(labels.values())
    # stable for one salt (dashboards group by it across restarts), another salt differs
    again = UserLabeler(pinned=["alice"], public=policy.public_id)
    assert again.label("alice") == labels["alice"] == user_label.hashed("alice", SALT)
    other = user_label.UserLabelPolicy("hashed", SALT + b"x")
    assert other.public_id("alice") != labels["alice"]
    # placeholders are no one's id and stay readable
    assert policy.public_id("__anonymous__") == "__anonymous__"
    assert policy.public_id("__unlisted__") == "__unlisted__"
    lab.set_pinned(["carol"])
    assert lab.label("carol") == user_label.hashed("carol", SALT)


def test_off_keeps_every_user_in_the_overflow_bucket():
    policy = user_label.UserLabelPolicy("off")
    lab = UserLabeler(pinned=["alice"], top_k=5, public=policy.public_id)
    for user in ("alice", "bob", "carol"):
        lab.observe(user, 10)
        assert lab.promote(user) == OTHER
    lab.rebalance()
    lab.set_pinned(["alice", "dave"])
    assert lab.labelled_users() == {} and lab.pinned == {}
    assert {lab.label(u) for u in ("alice", "bob", "dave")} == {OTHER}
    assert policy.public_id("alice") is None


def test_raw_is_todays_label():
    lab = UserLabeler(pinned=["alice"], public=user_label.RAW.public_id)
    assert lab.label("alice") == "alice"


@pytest.mark.parametrize("mode, salt, names", [
    ("loud", None, ("--output-rate-user-label", "'loud'")),
    ("hashed", None, ("--output-rate-user-label hashed needs a salt", "--output-rate-user-label-salt-file")),
    ("hashed", "{dir}/absent-salt", ("--output-rate-user-label-salt-file", "absent-salt", "cannot read")),
    ("hashed", "{dir}/short-salt", ("--output-rate-user-label-salt-file", "short-salt", "16 bytes")),
    ("raw", "{dir}/salt", ("--output-rate-user-label-salt-file", "only used with")),
])
def test_bad_label_options_are_refused_naming_option_and_value(tmp_path, monkeypatch, mode, salt, names):
    monkeypatch.delenv("OUTPUT_RATE_USER_LABEL_SALT_FILE", raising=False)
    (tmp_path / "short-salt").write_text("abc\n")
    (tmp_path / "salt").write_bytes(SALT)
    with pytest.raises(OutputRateConfigError) as err:
        user_label.check_options(mode, salt and salt.replace("{dir}", str(tmp_path)))
    for name in names:
        assert name in str(err.value), (name, str(err.value))


def test_the_settings_carry_the_options_and_a_lost_salt_is_off_never_raw(tmp_path, monkeypatch):
    salt = tmp_path / "salt"
    salt.write_bytes(SALT + b"\n")
    env = user_label.child_settings("hashed", str(salt))
    assert env == {"OUTPUT_RATE_USER_LABEL": "hashed", "OUTPUT_RATE_USER_LABEL_SALT_FILE": str(salt)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    user_label.forget()
    try:
        assert user_label.current() == user_label.UserLabelPolicy("hashed", SALT)
        salt.unlink()  # gone when the engine core starts: no ids, never raw ones
        user_label.forget()
        assert user_label.current().mode == "off"
        monkeypatch.setenv("OUTPUT_RATE_USER_LABEL", "loud")
        with pytest.raises(OutputRateConfigError, match="OUTPUT_RATE_USER_LABEL='loud'"):
            user_label.check_options(None, None)
    finally:
        user_label.forget()
