"""The one-node tests share tests/e2e's drivers (e2e_kube): pytest puts only this folder on the
import path for the modules in it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
