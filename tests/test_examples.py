"""The README's examples run as written, through the launcher."""

import os
import re
import subprocess
import sys

from tests.jobs import REPO, job_env

TIMEOUT = 180


def launch(*args, env=None):
    command = [sys.executable, "-m", "tfdist.run", *args]
    return subprocess.run(command, cwd=REPO, env=env or job_env(), capture_output=True, text=True, timeout=TIMEOUT)


def test_mirrored_example_trains_on_two_logical_cpus():
    result = launch("-n", "1", "--cpu-devices", "2", "--timeout", str(TIMEOUT), "--",
                    sys.executable, "examples/mirrored_fit.py")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "MirroredStrategy with 2 replica(s)" in result.stdout
    accuracy = float(result.stdout.split("final accuracy: ")[1].split()[0])
    assert accuracy > 0.9


# Every line the README's main command may print, by kind: what the script prints, the chief's Keras
# progress (worker 1 is silent), tfdist's report after fit (with each worker's split when it names a straggler),
# and the launcher's closing line. Nothing else: no TensorFlow start-up log, absl or Keras warning, from either
# worker.
LINE_KINDS = {
    "script": r"\[0\] worker 0 of 2: 2 replicas in sync"
              r"|\[0\] loss [\d.]+ -> [\d.]+; saved \S+/multi_worker_model\.keras",
    "epoch": r"\[0\] Epoch [123]/3",
    "progress": r"\[0\] 64/64 - \d+s - \d+ms/step - loss: [\d.]+",
    "report": r"\[0\] tfdist: fit: 2 workers, [\d.]+ ms a step \(median of \d+ steps\); (no straggler|straggler: .*)",
    "report detail": r"\[0\]   worker [01] \(.*\): input .*",
    "end": r"tfdist run: 2 worker\(s\), exit codes \[0, 0\], \d+\.\ds; all workers finished",
}
STORY = ["script", "epoch", "progress", "epoch", "progress", "epoch", "progress", "report", "script", "end"]


def kind(line: str) -> str:
    return next((name for name, pattern in LINE_KINDS.items() if re.fullmatch(pattern, line)), f"unexpected: {line}")


def readme_main_command() -> tuple[list[str], list[str]]:
    """The README's main command (its words) and the output it shows (its lines)."""
    section = (REPO / "README.md").read_text().split("## The main command", 1)[1]
    command = re.search(r"```bash\n(.*?)\n```", section, re.S)[1]
    shown = re.search(r"```text\n(.*?)\n```", section, re.S)[1]
    return command.split(), shown.splitlines()


def test_the_readme_main_command_prints_only_what_the_user_caused_on_80_columns(tmp_path):
    """As a newcomer types it (the installed tfdist command), with no TF_CPP_MIN_LOG_LEVEL of their own, on a
    terminal of 80 columns: the script's lines, the chief's progress once, the report after fit, the closing line."""
    words, shown = readme_main_command()
    assert words[:2] == ["tfdist", "run"] and words[4:6] == ["--", "python"], words
    assert [kind(line) for line in shown] == STORY  # the README shows the story this test checks
    tfdist = os.path.join(os.path.dirname(sys.executable), "tfdist")  # pip's console script, beside this Python
    env = job_env({"COLUMNS": "80", "TMPDIR": str(tmp_path)})  # the script saves into tempfile.gettempdir()
    env.pop("TF_CPP_MIN_LOG_LEVEL")
    result = subprocess.run([tfdist, *words[1:5], sys.executable, *words[6:]], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr == ""  # both workers' output comes through the launcher's stdout, prefixed
    lines = result.stdout.splitlines()
    kinds = [kind(line) for line in lines]
    assert [k for k in kinds if k != "report detail"] == STORY, result.stdout
    # Keras' and tfdist's lines fit 80 columns; not the script's own (a long path), nor a report that names a
    # straggler and why (only a shared, busy machine prints one here).
    assert [line for line, k in zip(lines, kinds)
            if len(line) > 80 and k in ("epoch", "progress", "report", "end") and "; straggler: " not in line] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multi_worker_model.keras"]  # the chief's, nothing left


def test_horovod_style_example_checkpoints_on_rank_0_only(tmp_path):
    result = launch("-n", "2", "--timeout", str(TIMEOUT), "--",
                    sys.executable, "examples/horovod_style.py", str(tmp_path), "1")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[0] test accuracy" in result.stdout and "[1] test accuracy" not in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1.keras"]  # no worker temp dirs left
