"""tfdist.autotune in one process: the candidates, the schedule and decision of a Tuner (over stand-in train
functions), the switches, the record file. On 2 real workers: tests/test_buckets_multi_worker.py."""

import json

import pytest

from tfdist import autotune, buckets

KIB, MIB = 1 << 10, 1 << 20
CNN = [3456, 128, 73728, 256, 1179648, 512, 5120, 40]  # a small CNN's float32 gradients, variable order
KINDS = ["float32"] * len(CNN)


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(buckets, "_settings", {})
    monkeypatch.setattr(buckets, "_tuned", None)
    monkeypatch.setattr(autotune, "_switch", None)
    monkeypatch.setattr(autotune, "_chosen", {})
    for name in (buckets.ENV, autotune.ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(autotune.ENV_FILE, str(tmp_path / "autotune.json"))


def test_candidates_are_the_default_one_pack_and_settings_with_other_plans():
    settings = autotune.candidates(CNN, KINDS)
    assert [str(s) for s in settings] == ["buckets 4 MiB, first 1 MiB", "one pack", "buckets 4 MiB, first 4 KiB"]
    plans = [repr(buckets.plan(CNN, s.bucket_bytes, s.first_bucket_bytes, KINDS)) for s in settings]
    assert len(set(plans)) == len(plans)


def test_the_first_candidate_is_the_default_setting():
    assert autotune.GRID[0] == (buckets.DEFAULT_BUCKET_BYTES, buckets.DEFAULT_FIRST_BUCKET_BYTES)


def test_a_model_whose_plans_are_all_one_pack_has_one_candidate():
    assert autotune.candidates([40, 16], ["float32"] * 2) == [autotune.Setting(4 * MIB, 1 * MIB)]


class Steps:
    """Stand-in train functions: each call 'runs' 4 steps taking ms[candidate] per step; counts calls."""

    def __init__(self, ms):
        self.ms, self.calls, self.made, self.now = ms, [], [], 0.0

    def make(self):
        number = len(self.made)
        self.made.append(buckets.bucket_sizes())  # the setting current when the function is built (traced)

        def function(steps):
            self.calls.append(number)
            per_step = self.ms[number] * (1 if steps == 4 else 3) / 1000
            self.now += 4 * per_step + (1.0 if self.calls.count(number) == 1 else 0.0)  # the first call traces
            return number
        return function


def run_tuner(monkeypatch, ms, chief_ms=None, calls=40):
    fake = Steps(ms)
    monkeypatch.setattr(autotune.time, "perf_counter", lambda: fake.now)
    settings = [autotune.Setting(4 * MIB, MIB), autotune.Setting(0, 0), autotune.Setting(4 * MIB, 4 * KIB)][:len(ms)]
    agreed, settled = [], []

    def agree(local):
        agreed.append(local)
        return chief_ms or local

    tuner = autotune.Tuner(settings, fake.make, lambda steps: steps, agree, lambda *args: settled.append(args))
    # every 5th call is an epoch's last, of 2 steps (the stand-ins charge it as 4 steps at 3x the time: not timed)
    results = [tuner(2 if i % 5 == 4 else 4) for i in range(calls)]
    return fake, agreed, settled, results


def test_the_tuner_times_every_candidate_in_alternating_rounds_and_keeps_the_fastest(monkeypatch):
    fake, agreed, settled, _ = run_tuner(monkeypatch, [60.0, 50.0, 55.0])
    assert len(fake.made) == 3  # one traced function per candidate, however often it comes back
    assert fake.made == [(4 * MIB, MIB), (0, 0), (4 * MIB, 4 * KIB)]
    order = [c for i, c in enumerate(fake.calls) if i == 0 or c != fake.calls[i - 1]]
    assert order == [0, 1, 2, 1, 0, 1]  # round 2 in reverse (2 twice in a row), then the chosen one for good
    assert [round(ms, 3) for ms in agreed[0]] == [60.0, 50.0, 55.0]  # neither a first call nor an epoch's last
    setting, step_ms, steps, function = settled[0]
    assert len(settled) == 1 and setting == autotune.Setting(0, 0) and function(4) == 1
    assert [round(ms, 3) for ms in step_ms["one pack"]] == [50.0, 50.0]
    assert steps <= 144 + 12  # 16 timed per turn, 3 candidates, 2 rounds, a first call each; and the 2-step calls


def test_every_worker_decides_on_the_chiefs_times(monkeypatch):
    _, _, settled, _ = run_tuner(monkeypatch, [60.0, 50.0, 55.0], chief_ms=[70.0, 80.0, 45.0])
    assert settled[0][0] == autotune.Setting(4 * MIB, 4 * KIB)


def test_a_tie_keeps_the_earlier_candidate(monkeypatch):
    _, _, settled, _ = run_tuner(monkeypatch, [50.0, 50.0])
    assert settled[0][0] == autotune.Setting(4 * MIB, MIB)


def test_the_switches(monkeypatch):
    """Off unless asked for (issue 52: its trials cost a new job's first steps more than its choice won back)."""
    monkeypatch.setattr(autotune, "_switch", None)
    assert autotune.enabled({}) is False
    assert autotune.enabled({autotune.ENV: "1"}) is True
    assert autotune.enabled({autotune.ENV: "0"}) is False
    monkeypatch.setenv(autotune.ENV, "0")
    autotune.set_autotune(True)
    assert autotune.enabled() is True


def test_a_bad_switch_names_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"TFDIST_AUTOTUNE='yes': set it to 1 \(tune the gradient buckets while "
                                         r"training\) or 0 \(keep the default buckets, as when it is unset\), or "
                                         r"unset it\."):
        autotune.enabled({autotune.ENV: "yes"})
    with pytest.raises(TypeError, match=r"set_autotune takes True or False; received enabled='off'\."):
        autotune.set_autotune("off")


def test_a_setting_of_yours_is_explicit_and_wins_over_the_tuned_one(monkeypatch):
    assert not buckets.explicit()
    buckets.use_tuned(0, 0)
    assert buckets.bucket_sizes() == (0, 0)
    monkeypatch.setenv(buckets.ENV, "1024")
    assert buckets.explicit() and buckets.bucket_sizes() == (1024, 1024)
    monkeypatch.delenv(buckets.ENV)
    monkeypatch.setattr(buckets, "_settings", {})
    buckets.set_bucket_bytes(2048)
    assert buckets.explicit() and buckets.bucket_sizes() == (2048, 2048)


def test_the_chief_records_its_choice_and_a_later_run_finds_it(tmp_path, capsys):
    key = autotune.key(["10.0.0.1", "10.0.0.2"], CNN, KINDS)
    choice = autotune.Choice(autotune.Setting(0, 0), {"one pack": [50.0, 51.0]}, 96, key)
    autotune.apply(choice, chief=True, record=True)
    assert buckets.bucket_sizes() == (0, 0) and autotune.last_choice() is choice
    assert capsys.readouterr().err == ("tfdist autotune: one pack after 96 steps (ms per step, each round: one pack "
                                       "50.0, 51.0)\n")
    entry = json.loads((tmp_path / "autotune.json").read_text())[key]
    assert entry["setting"] == {"bucket_bytes": 0, "first_bucket_bytes": 0} and entry["steps"] == 96
    assert autotune.recorded(key) == autotune.Setting(0, 0)
    assert autotune.recorded(autotune.key(["10.0.0.1", "10.0.0.3"], CNN, KINDS)) is None  # another network


def test_the_record_file_defaults_to_the_user_cache(monkeypatch):
    assert autotune.file_path({"XDG_CACHE_HOME": "/c"}) == "/c/tfdist/autotune.json"
    assert autotune.file_path({autotune.ENV_FILE: "/x.json"}) == "/x.json"
