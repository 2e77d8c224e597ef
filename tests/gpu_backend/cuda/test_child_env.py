"""child_env(): a process a check starts sees the parent's PYTHONPATH (carried
wheels on the lent GPU machine) in the same order, plus the checkout."""
from __future__ import annotations

import os
import subprocess
import sys

from gpu_backend.cuda.child_env import REPO, child_env


def test_keeps_the_parents_entries_in_order_and_adds_the_checkout(tmp_path):
    env = child_env({"PYTHONPATH": f"/a{os.pathsep}/b", "X": "1"}, BLINK_Y="2")
    assert env["PYTHONPATH"].split(os.pathsep) == ["/a", "/b", str(REPO)]
    assert env["X"] == "1" and env["BLINK_Y"] == "2"
    again = child_env({"PYTHONPATH": f"{REPO}{os.pathsep}/a"})
    assert again["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/a"]
    assert child_env({})["PYTHONPATH"] == str(REPO)


def test_a_child_imports_from_the_parents_site_folder(tmp_path):
    site = tmp_path / "site"
    (site / "carried_pkg").mkdir(parents=True)
    (site / "carried_pkg" / "__init__.py").write_text("WHERE = __file__\n")
    env = child_env(dict(os.environ, PYTHONPATH=str(site)))
    code = "import carried_pkg, gpu_backend; print(carried_pkg.WHERE); print(gpu_backend.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout.split()
    assert out[0].startswith(str(site)) and out[1].startswith(str(REPO))
    bare = subprocess.run([sys.executable, "-c", "import carried_pkg"], env=dict(env, PYTHONPATH=str(REPO)),
                          capture_output=True, cwd=tmp_path)
    assert bare.returncode != 0          # what the tests did before: the carried folder lost
