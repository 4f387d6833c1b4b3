"""The worker start-up hook: armed by `tfdist run` in scripts that never import tfdist, and nowhere else."""

import json
import subprocess
import sys

import pytest

from tests.jobs import WORKERS, job_env
from tfdist.launch import output


@pytest.fixture(scope="module")
def user_site(tmp_path_factory):
    """A user's own sitecustomize.py, on PYTHONPATH, that marks that it ran."""
    folder = tmp_path_factory.mktemp("usersite")
    (folder / "sitecustomize.py").write_text("import builtins\nbuiltins.USER_SITECUSTOMIZE_RAN = True\n")
    env = job_env()
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{folder}"
    return env


def probe(env, launcher_args=None):
    """What hook_probe.py reports, started by `tfdist run -n 1 LAUNCHER_ARGS`, or plainly when None."""
    script = [sys.executable, str(WORKERS / "hook_probe.py")]
    command = script if launcher_args is None else [
        sys.executable, "-m", "tfdist.run", "-n", "1", *launcher_args, "--", *script]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if "keras_patched" in line)
    return json.loads(line.split("] ", 1)[-1])


def test_tfdist_run_arms_tfdist_and_still_runs_the_users_sitecustomize(user_site):
    assert probe(user_site, ()) == {"keras_patched": True, "user_sitecustomize_ran": True, "tfdist_loaded": True}


def test_no_fixes_runs_the_script_as_it_is(user_site):
    assert probe(user_site, ("--no-fixes",)) == {
        "keras_patched": False, "user_sitecustomize_ran": True, "tfdist_loaded": False}


def test_outside_tfdist_run_nothing_is_armed(user_site):
    assert probe(user_site) == {"keras_patched": False, "user_sitecustomize_ran": True, "tfdist_loaded": False}


def test_start_up_noise_is_dropped_and_errors_kept():
    keep = output.StartupNoiseFilter().keep
    noise = [
        b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
        b"I0000 00:00:1795400470.056422   20822 port.cc:153] oneDNN custom operations are on.\n",
        b"I0000 00:00:1795400470.056888   20822 cudart_stub.cc:31] Could not find cuda drivers on your machine\n",
        b"E0000 00:00:1795400475.006954   20824 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error\n",
        b"W0000 00:00:1795400475.436040   20822 dataset.cc:997] Input of GeneratorDatasetOp::Dataset will not be\n",
    ]
    assert [keep(line) for line in noise] == [False] * len(noise)
    kept = [b"E0000 00:00:1795400475.1   20824 collective_ops.cc:1] Collective has timed out\n",
            b"Epoch 1/3\n", b"ValueError: bad shape\n"]
    assert all(keep(line) for line in kept)


def test_a_cuinit_error_is_kept_where_a_driver_exists():
    assert output.StartupNoiseFilter().keep(b"E0000 00:00:1.0   1 cuda_platform.cc:52] failed call to cuInit: X\n")


@pytest.mark.parametrize("first", ["tfdist.compression", "tfdist.horovod", "tfdist.optimizer", "tfdist.devices",
                                   "tfdist.checkpoint.store", "tfdist.keras_fixes.sharded_state",
                                   "tfdist.keras_fixes.callbacks"])
def test_every_keras_fix_applies_whichever_tfdist_module_is_imported_first(first):
    """Importing a tfdist module imports TensorFlow, which imports Keras, whose hook imports every fix:
    a fix that imports a name from the module still being imported would fail, and the fixes stay off."""
    script = (f"import {first}, keras\nfrom tfdist import keras_fixes\n"
              "print('applied', all(p.applied for p in keras_fixes.patches()))")
    result = subprocess.run([sys.executable, "-W", "error::Warning", "-c", script], env=job_env(),
                            capture_output=True, text=True, timeout=120)
    assert "applied True" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("before, imports, env, expected", [
    ("", "tfdist, keras", {}, "on True frozen True"),
    ("", "tfdist, tensorflow", {}, "on True frozen True"),
    ("", "tfdist, keras", {"TFDIST_GC_FREEZE": "0"}, "on True frozen False"),
    ("gc.disable()\n", "tfdist, keras", {}, "on False frozen False"),  # the program's choice stays
    ("", "tfdist, keras", {"TFDIST_GC_FREEZE": "off"}, "on True frozen False"),  # a bad value: warned, left alone
])
def test_tensorflow_and_keras_import_with_the_collector_paused_and_their_objects_frozen_out_of_it(
        before, imports, env, expected):
    script = (f"import gc\n{before}import {imports}\n"
              "print('on', gc.isenabled(), 'frozen', gc.get_freeze_count() > 100_000)")
    result = subprocess.run([sys.executable, "-c", script], env={**job_env(), **env},
                            capture_output=True, text=True, timeout=120)
    assert expected in result.stdout, result.stdout + result.stderr[-3000:]
    bad = env.get("TFDIST_GC_FREEZE") == "off"
    assert ("TFDIST_GC_FREEZE='off': set it to 0" in result.stderr) == bad, result.stderr[-3000:]


FROZEN_IMPORTS = """
import gc, os, sys, threading, weakref
from tfdist import startup
startup.arm(frozen=["outer_heavy", "inner_heavy", "broken_heavy", "forking_heavy", "threaded_heavy"])
try:
    import broken_heavy
except RuntimeError:
    pass
print("after a failed import", gc.isenabled())
class Cycle:
    pass
dead = Cycle(); dead.me = dead; dead = weakref.ref(dead)  # garbage before the import, not yet collected
import outer_heavy, inner_heavy
print("inside", outer_heavy.INSIDE, inner_heavy.INSIDE, "after", gc.isenabled(), "dead freed", dead() is None,
      "frozen", gc.get_freeze_count() > 0)
import forking_heavy
print("child", forking_heavy.CHILD)
seen = []
importing = threading.Thread(target=lambda: __import__("threaded_heavy"))
importing.start()
while "threaded_heavy" not in sys.modules:
    pass
seen.append(gc.isenabled())  # another thread: no pause
importing.join()
print("beside a thread", seen, "inside", sys.modules["threaded_heavy"].INSIDE)
"""
HEAVY_MODULES = {
    "outer_heavy": "import gc, inner_heavy\nINSIDE = gc.isenabled()\n",
    "inner_heavy": "import gc\nINSIDE = gc.isenabled()\n",
    "broken_heavy": "raise RuntimeError('broken')\n",
    # A process forked while the import has the collector paused: the child's import may never end.
    "forking_heavy": "import gc, os\nread, write = os.pipe()\nif os.fork() == 0:\n"
                     "    os.write(write, str(gc.isenabled()).encode())\n    os._exit(0)\n"
                     "os.wait()\nCHILD = os.read(read, 10).decode()\n",
    "threaded_heavy": "import gc, time\ntime.sleep(0.5)\nINSIDE = gc.isenabled()\n",
}


def test_a_frozen_modules_import_that_fails_nests_forks_or_runs_beside_a_thread_leaves_the_collector_on(tmp_path):
    for name, text in HEAVY_MODULES.items():
        (tmp_path / f"{name}.py").write_text(text)
    env = job_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    result = subprocess.run([sys.executable, "-c", FROZEN_IMPORTS], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.splitlines() == [
        "after a failed import True", "inside False False after True dead freed True frozen True", "child True",
        "beside a thread [True] inside True"], result.stdout + result.stderr[-3000:]
